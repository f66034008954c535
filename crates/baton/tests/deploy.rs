//! The container image and the Kubernetes manifests (`deploy/`, #61), checked offline: no
//! Docker and no cluster here, so what can be checked without them is.
//!
//! - Every kustomization under `deploy/k8s` renders (`kubectl kustomize`) and what it renders
//!   passes the Kubernetes schemas (`kubernetes-validate --strict` from PyPI, installed in
//!   `.venv` by `scripts/install-python-deps.sh`; its schemas ship with it, so it needs no
//!   network).
//! - Every command line the manifests and the Dockerfile give `baton` parses: the binary is run
//!   with those arguments and `--help` after them, so an unknown flag or a bad value fails.
//! - The probes ask paths the conductor and the workers serve.

#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The kustomizations: each directory under `deploy/k8s` with a `kustomization.yaml`.
fn kustomizations() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(repo().join("deploy/k8s"))
        .expect("deploy/k8s")
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("kustomization.yaml").exists())
        .collect();
    dirs.sort();
    dirs
}

fn tool(name: &str, hint: &str) -> PathBuf {
    let venv = repo().join(".venv/bin").join(name);
    if venv.exists() {
        return venv;
    }
    let found = Command::new("sh").arg("-c").arg(format!("command -v {name}")).output().unwrap();
    assert!(found.status.success(), "no `{name}`: {hint}");
    PathBuf::from(String::from_utf8_lossy(&found.stdout).trim())
}

/// `kubectl kustomize DIR`: the manifests as they would be applied.
fn render(dir: &Path) -> String {
    let kubectl = tool("kubectl", "scripts/install-deps.sh installs it");
    let out = Command::new(kubectl).arg("kustomize").arg(dir).output().unwrap();
    assert!(out.status.success(), "{} does not render:\n{}", dir.display(), String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// YAML documents as JSON, through the PyYAML that kubernetes-validate brings into `.venv`.
fn documents(yaml: &str) -> Vec<Value> {
    let python = tool("python", "run scripts/install-python-deps.sh");
    let mut child = Command::new(python)
        .args(["-c", "import json, sys, yaml; print(json.dumps([d for d in yaml.safe_load_all(sys.stdin) if d]))"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(yaml.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "the manifests are not YAML");
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn every_kustomization_renders_and_passes_the_kubernetes_schemas() {
    let validate = tool("kubernetes-validate", "run scripts/install-python-deps.sh");
    let dirs = kustomizations();
    assert!(dirs.len() >= 3, "base, etcd and cpu expected under deploy/k8s: {dirs:?}");
    let scratch = std::env::temp_dir().join(format!("baton-deploy-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    for dir in &dirs {
        let rendered = render(dir);
        let docs = documents(&rendered);
        let kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
        for kind in ["Deployment", "Service", "Secret"] {
            assert!(kinds.contains(&kind), "{} renders no {kind}: {kinds:?}", dir.display());
        }
        let file = scratch.join(format!("{}.yaml", dir.file_name().unwrap().to_string_lossy()));
        std::fs::write(&file, &rendered).unwrap();
        let out = Command::new(&validate).arg("--strict").arg(&file).output().unwrap();
        assert!(
            out.status.success(),
            "{} fails the Kubernetes schemas:\n{}{}",
            dir.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The validator can fail: a manifest with a wrong type is refused.
    let bad = scratch.join("bad.yaml");
    std::fs::write(&bad, "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec: {replicas: two}\n")
        .unwrap();
    let out = Command::new(&validate).arg("--strict").arg(&bad).output().unwrap();
    assert!(!out.status.success(), "kubernetes-validate passed a Deployment with `replicas: two`");
    let _ = std::fs::remove_dir_all(&scratch);
}

/// Runs `baton ARGS --help`: it succeeds only when every flag before `--help` exists and every
/// value parses.
fn parses(args: &[String], whence: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_baton")).args(args).arg("--help").output().unwrap();
    assert!(
        out.status.success(),
        "{whence}: `baton {}` does not parse:\n{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn every_command_line_the_manifests_and_the_dockerfile_give_baton_parses() {
    let mut checked = 0;
    let mut probes = Vec::new();
    for dir in kustomizations() {
        for doc in documents(&render(&dir)) {
            let containers = doc["spec"]["template"]["spec"]["containers"].as_array().cloned().unwrap_or_default();
            for c in containers.iter().filter(|c| c["image"].as_str().is_some_and(|i| i.starts_with("baton"))) {
                let args: Vec<String> = c["args"]
                    .as_array()
                    .expect("a baton container's args")
                    .iter()
                    .map(|a| {
                        // The kubelet fills these in from the downward API.
                        let a = a.as_str().unwrap();
                        a.replace("$(POD_IP)", "10.0.0.7").replace("$(POD_NAME)", "baton-prefill-0")
                    })
                    .collect();
                parses(&args, &format!("{} {}", dir.display(), doc["metadata"]["name"]));
                checked += 1;
                for probe in ["livenessProbe", "readinessProbe", "startupProbe"] {
                    if let Some(path) = c[probe]["httpGet"]["path"].as_str() {
                        probes.push((args[0].clone(), path.to_owned()));
                    }
                }
            }
        }
    }
    assert!(checked >= 9, "only {checked} baton containers found in deploy/k8s");
    // The probes ask what each process serves: the conductor's /health, a worker's probes.
    for (command, path) in &probes {
        let served: &[&str] = match command.as_str() {
            "conductor" => &["/health"],
            "worker" => &[baton_protocol::control::LIVE_PATH, baton_protocol::control::READY_PATH],
            other => panic!("a probe on `baton {other}`"),
        };
        assert!(served.contains(&path.as_str()), "`baton {command}` does not serve the probe path {path}");
    }
    assert!(probes.iter().any(|(c, _)| c == "worker") && probes.iter().any(|(c, _)| c == "conductor"));

    // The Dockerfile: each image's default command, and the features it builds with.
    let dockerfile = std::fs::read_to_string(repo().join("deploy/Dockerfile")).unwrap();
    let mut cmds = 0;
    for line in dockerfile.lines().filter(|l| l.starts_with("CMD ")) {
        let args: Vec<String> = serde_json::from_str(&line["CMD ".len()..]).expect("CMD in exec form");
        parses(&args, "deploy/Dockerfile");
        cmds += 1;
    }
    assert_eq!(cmds, 1, "one default command, the image's");
    for variant in ["cpu", "cuda"] {
        assert!(dockerfile.contains(&format!("AS build-{variant}")), "the Dockerfile builds the {variant} variant");
    }
    let manifest = std::fs::read_to_string(repo().join("crates/baton/Cargo.toml")).unwrap();
    for line in dockerfile.lines().filter(|l| l.contains("--features")) {
        let features = line.split("--features ").nth(1).unwrap().split_whitespace().next().unwrap();
        for feature in features.split(',') {
            assert!(
                manifest.contains(&format!("\n{feature} = [")),
                "the Dockerfile builds an unknown feature {feature}"
            );
        }
    }
    assert!(
        include_str!("../../baton-gguf/src/known.rs").contains("\"BATON_MODELS_DIR\"")
            && dockerfile.contains("BATON_MODELS_DIR=/models"),
        "the images find their models through BATON_MODELS_DIR"
    );
}
