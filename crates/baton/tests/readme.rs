//! The README's examples, run as written (#36): a README whose commands have gone stale is the
//! first thing a new user meets.
//!
//! - Every fenced `sh` block runs in `bash`, in README order, with this build's `baton` first on
//!   `PATH` (the README's `cargo run --release --` and `target/release/baton` become `baton`) and
//!   port 8000 moved to a free one. The run block starts the server; each `curl` block must answer
//!   JSON without an error, a structured answer must parse with its schema's required keys; the
//!   cluster block starts a conductor and two workers, and the `curl` blocks run again against
//!   it. The GPU block (it needs a CUDA build) and the test block (this suite) are skipped.
//! - Every inline command of the README and the crates' READMEs (`` `baton sim --elastic` ``)
//!   parses: the binary is run with its arguments (placeholders such as `N` or `MODEL` filled in)
//!   and `--help` after them, so an unknown flag or a bad value fails it.
//! - Every `--flag` the README names is in some command's `--help`, and every script it names is
//!   in the repository.
//! - What moved out of the README into `docs/` (#61) is held to the same two rules, and the README
//!   stays a user's page: at most 300 lines, the run and test commands in its first 60, every
//!   file it, ARCHITECTURE.md and `docs/` link to present.

#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn readme() -> String {
    std::fs::read_to_string(repo().join("README.md")).expect("README.md")
}

/// Every Markdown file under `docs/`, with its path: the README's long forms and the benchmark
/// results that moved out of it (#61), held to the README's rules.
fn docs() -> Vec<(PathBuf, String)> {
    fn walk(dir: &Path, out: &mut Vec<(PathBuf, String)>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for entry in entries {
            let path = entry.expect("a docs/ entry").path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push((path.clone(), std::fs::read_to_string(&path).expect("a docs/ file")));
            }
        }
    }
    let mut out = Vec::new();
    walk(&repo().join("docs"), &mut out);
    out.sort();
    out
}

/// The relative link targets of a Markdown text (`[text](target)`, `![alt](target)`), without
/// any `#fragment`; web addresses left out.
fn relative_links(md: &str) -> Vec<String> {
    md.match_indices("](")
        .filter_map(|(i, _)| {
            let rest = &md[i + 2..];
            let target = &rest[..rest.find(')')?];
            let target = target.split('#').next().unwrap_or_default();
            (!target.is_empty() && !target.contains("://") && !target.starts_with("mailto:")).then(|| target.to_owned())
        })
        .collect()
}

/// The fenced blocks tagged `sh`, in order.
fn sh_blocks(md: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in md.lines() {
        match (&mut current, line.trim_start()) {
            (None, "```sh") => current = Some(String::new()),
            (Some(_), "```") => blocks.extend(current.take()),
            (Some(block), _) => {
                block.push_str(line);
                block.push('\n');
            }
            (None, _) => {}
        }
    }
    blocks
}

/// Inline code spans outside fenced blocks (a span may wrap a line).
fn code_spans(md: &str) -> Vec<String> {
    let mut prose = String::new();
    let mut fenced = false;
    for line in md.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced {
            prose.push_str(line);
            prose.push('\n');
        }
    }
    prose.split('`').skip(1).step_by(2).map(|s| s.split_whitespace().collect::<Vec<_>>().join(" ")).collect()
}

/// A directory holding `baton`: this build's binary.
fn bin_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("baton-readme-bin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let link = dir.join("baton");
    if !link.exists() {
        std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_baton"), &link).unwrap();
    }
    dir
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A README block as this test runs it: this build's `baton`, and `port` for 8000.
fn adapt(block: &str, port: u16) -> String {
    block
        .replace("cargo run --release -- serve", &format!("baton serve --port {port}"))
        .replace("cargo run --release --", "baton")
        .replace("target/release/baton", "baton")
        .replace(":8000", &format!(":{port}"))
        .replace("--port 8000", &format!("--port {port}"))
}

fn bash(script: &str, path: &str) -> Command {
    let mut cmd = Command::new("bash");
    cmd.arg("-euo").arg("pipefail").arg("-c").arg(script).current_dir(repo()).env("PATH", path);
    cmd
}

/// A block left running (a server, a cluster), in a process group of its own that `Drop` kills
/// whole.
struct Background {
    child: Child,
    what: String,
}

impl Background {
    fn start(what: &str, script: &str, path: &str) -> Background {
        let child = bash(script, path)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("bash runs");
        Background { child, what: what.to_owned() }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        let _ = Command::new("kill").arg("-KILL").arg("--").arg(format!("-{}", self.child.id())).status();
        let _ = self.child.wait();
        eprintln!("readme: stopped {}", self.what);
    }
}

/// Runs `cmd` to its end, killed at `limit`.
fn run_with_deadline(mut cmd: Command, limit: Duration) -> Output {
    let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let deadline = Instant::now() + limit;
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stdout.read_to_end(&mut s);
        s
    });
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("a README block ran past {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = Vec::new();
    let _ = child.stderr.take().unwrap().read_to_end(&mut stderr);
    Output { status, stdout: reader.join().unwrap(), stderr }
}

/// Waits until the OpenAI API on `port` completes a request.
fn wait_serving(port: u16, server: &mut Background, limit: Duration) {
    let client = reqwest::blocking::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();
    let url = format!("http://127.0.0.1:{port}/v1/completions");
    let deadline = Instant::now() + limit;
    loop {
        let body = serde_json::json!({"prompt": "Hello", "max_tokens": 1});
        if client.post(&url).json(&body).send().is_ok_and(|r| r.status().is_success()) {
            return;
        }
        // The cluster block's shell exits once it has started its processes; the run block's
        // server never should.
        if let Some(status) = server.child.try_wait().unwrap().filter(|s| !s.success()) {
            panic!("{} exited ({status}) before serving", server.what);
        }
        assert!(Instant::now() < deadline, "{} did not serve within {limit:?}", server.what);
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The keys a block's JSON schema requires, if it has one.
fn required_keys(block: &str) -> Vec<String> {
    let Some(at) = block.find("\"required\": [") else { return Vec::new() };
    let rest = &block[at + "\"required\": [".len()..];
    let list = &rest[..rest.find(']').unwrap()];
    list.split(',').map(|k| k.trim().trim_matches('"').to_owned()).filter(|k| !k.is_empty()).collect()
}

/// A client block's output: one JSON answer per request, none an error, structured ones parsed.
fn check_answers(block: &str, out: &Output) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "block failed ({}):\n{block}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let answers: Vec<Value> = serde_json::Deserializer::from_str(&stdout)
        .into_iter::<Value>()
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("not JSON ({e}):\n{stdout}"));
    let requests = block.matches("curl ").count();
    assert_eq!(answers.len(), requests, "one answer a request:\n{stdout}");
    let required = required_keys(block);
    for answer in &answers {
        assert!(answer.get("error").is_none(), "an error answer to\n{block}\n{answer}");
        let choice = &answer["choices"][0];
        assert!(choice.is_object(), "no choice in {answer}");
        let text = choice["message"]["content"].as_str().or(choice["text"].as_str()).unwrap_or_default();
        assert!(!text.trim().is_empty(), "an empty answer: {answer}");
        if !required.is_empty() {
            let parsed: Value =
                serde_json::from_str(text).unwrap_or_else(|e| panic!("structured answer does not parse ({e}): {text}"));
            for key in &required {
                assert!(parsed.get(key).is_some(), "structured answer lacks `{key}`: {text}");
            }
            assert_eq!(choice["finish_reason"], "stop", "{answer}");
        }
    }
}

fn placeholder(word: &str) -> Option<&'static str> {
    Some(match word {
        "N" | "G" | "R" => "2",
        "M" | "MODEL" | "NAME" => "smollm2-135m-instruct",
        "TEXT" => "Hello",
        "MODE" => "pull",
        "PATH" | "DIR" | "FILE" | "PEM" => "/tmp/x",
        _ => return None,
    })
}

#[test]
fn every_inline_command_parses() {
    let bin = env!("CARGO_BIN_EXE_baton");
    let mut checked = 0;
    let mut texts = vec![readme()];
    for entry in std::fs::read_dir(repo().join("crates")).unwrap() {
        texts.extend(std::fs::read_to_string(entry.unwrap().path().join("README.md")).ok());
    }
    texts.extend(docs().into_iter().map(|(_, text)| text));
    for span in texts.iter().flat_map(|t| code_spans(t)) {
        let Some(args) =
            ["baton ", "cargo run --release -- ", "target/release/baton "].iter().find_map(|p| span.strip_prefix(p))
        else {
            continue;
        };
        let template = |w: &str| w.len() > 1 && w.chars().all(|c| c.is_ascii_uppercase() || c == '_');
        if args.contains("...") || args.split(' ').any(|w| template(w) && placeholder(w).is_none()) {
            continue; // elided arguments, or a stand-in for several: nothing to check
        }
        let args: Vec<String> = args
            .split(' ')
            .filter(|w| !w.starts_with('[') && !w.ends_with(']'))
            .map(|w| placeholder(w).map(str::to_owned).unwrap_or_else(|| w.split('|').next().unwrap().to_owned()))
            .collect();
        let out = Command::new(bin).args(&args).arg("--help").output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        // A span may name a flag rather than write a command (`baton sim --context-sessions`).
        let names_a_flag = args.last().is_some_and(|a| a.starts_with("--")) && stderr.contains("a value is required");
        assert!(out.status.success() || names_a_flag, "`{span}` does not parse:\n{stderr}");
        checked += 1;
    }
    assert!(checked >= 15, "only {checked} inline commands found: has the README's form changed?");
}

#[test]
fn every_flag_and_script_the_readme_names_exists() {
    let bin = env!("CARGO_BIN_EXE_baton");
    let commands = [
        "",
        "serve",
        "worker",
        "conductor",
        "generate",
        "sim",
        "profile",
        "check-device",
        "bench engine",
        "bench transfer",
        "bench conductor",
        "bench serve",
        "bench compare",
        "bench storm",
        "bench index",
        "bench worker-memory",
    ];
    let mut help = String::new();
    for c in commands {
        let out = Command::new(bin).args(c.split_whitespace()).arg("--help").output().unwrap();
        assert!(out.status.success(), "baton {c} --help");
        help.push_str(&String::from_utf8_lossy(&out.stdout));
    }
    // The scripts' own flags, as their usage lines give them.
    let scripts = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts");
    for entry in std::fs::read_dir(&scripts).expect("scripts/") {
        let path = entry.expect("an entry").path();
        if path.extension().is_some_and(|e| e == "sh") {
            let text = std::fs::read_to_string(&path).expect("a script");
            text.lines().filter(|l| l.contains("usage: ")).for_each(|l| help.push_str(l));
        }
    }
    // Cargo's own flags, in the build, install and test commands, and the test harness's.
    let cargo = [
        "--all-features",
        "--features",
        "--locked",
        "--path",
        "--release",
        "--workspace",
        "--no-fail-fast",
        "--ignored",
        "--nocapture",
        "--lib",
        "--example",
    ];
    // The README and what moved out of it into docs/ (#61) are held to the same rule.
    let text = std::iter::once(readme()).chain(docs().into_iter().map(|(_, text)| text)).collect::<Vec<_>>().join("\n");
    let mut missing = Vec::new();
    for (i, _) in text.match_indices("--") {
        let flag: String = text[i + 2..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '-').collect();
        let flag = format!("--{}", flag.trim_end_matches('-'));
        let known = help
            .match_indices(&flag)
            .any(|(j, _)| !help[j + flag.len()..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '-'));
        if flag.len() > 3 && !known && !cargo.contains(&flag.as_str()) && !missing.contains(&flag) {
            missing.push(flag);
        }
    }
    assert!(missing.is_empty(), "flags the README names that no command has: {missing:?}");
    let mut absent = Vec::new();
    for (i, _) in text.match_indices("scripts/") {
        let path: String =
            text[i..].chars().take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '/' | '.' | '_' | '-')).collect();
        let path = path.trim_end_matches('.');
        if path != "scripts/" && !repo().join(path).exists() {
            absent.push(path.to_owned());
        }
    }
    assert!(absent.is_empty(), "scripts the README names that are not in the repository: {absent:?}");
}

#[test]
fn the_readme_command_blocks_run_as_written() {
    let model = repo().join(".models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(model.exists(), "{} is missing: run scripts/fetch-model.sh (scripts/test.sh does)", model.display());
    let path = format!("{}:{}", bin_dir().display(), std::env::var("PATH").unwrap_or_default());
    let curl = Command::new("bash").args(["-c", "command -v curl"]).env("PATH", &path).output().unwrap();
    assert!(curl.status.success(), "the README's examples use curl: install it (apt-get install curl)");
    let port = free_port();
    let mut server: Option<Background> = None;
    let mut clients: Vec<String> = Vec::new();
    let (mut ran, mut skipped) = (0, 0);
    for block in sh_blocks(&readme()) {
        if block.contains("scripts/test.sh") || block.contains("--features cuda") {
            eprintln!("readme: skipped (this suite, or a CUDA build):\n{block}");
            skipped += 1;
            continue;
        }
        let script = adapt(&block, port);
        let background = script.lines().any(|l| {
            let l = l.split('#').next().unwrap_or_default().trim_end();
            l.ends_with('&') && !l.ends_with("&&")
        });
        if script.contains("baton serve") || background {
            drop(server.take()); // the next server takes the same port
            let what = if background { "the cluster block" } else { "the run block" };
            let mut started = Background::start(what, &script, &path);
            wait_serving(port, &mut started, Duration::from_secs(180));
            eprintln!("readme: {what} serves on {port}");
            // The examples so far must hold against this server too.
            for client in &clients {
                eprintln!("readme: again, against {what}:\n{client}");
                check_answers(client, &run_with_deadline(bash(client, &path), Duration::from_secs(120)));
            }
            server = Some(started);
        } else {
            assert!(server.is_some(), "a block before any server was started:\n{block}");
            let start = Instant::now();
            check_answers(&script, &run_with_deadline(bash(&script, &path), Duration::from_secs(120)));
            eprintln!("readme: ran in {:.1?}:\n{block}", start.elapsed());
            clients.push(script);
        }
        ran += 1;
    }
    assert!(ran >= 4 && skipped == 2, "ran {ran} blocks, skipped {skipped}: has the README's form changed?");
}

/// The README is a user's page (#61): short, the two commands a newcomer needs near the top, and
/// every file it, ARCHITECTURE.md or docs/ links to is in the repository (so what moved to
/// docs/ stays reachable).
#[test]
fn the_readme_is_a_page_a_newcomer_reads() {
    let text = readme();
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.len() <= 300, "README.md has {} lines: the long forms belong in docs/", lines.len());
    let top = lines[..lines.len().min(60)].join("\n");
    for command in ["scripts/fetch-model.sh && cargo run --release -- serve", "scripts/test.sh"] {
        assert!(top.contains(command), "the README's first 60 lines lack `{command}`");
    }
    let architecture = std::fs::read_to_string(repo().join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    assert!(architecture.lines().count() <= 400, "ARCHITECTURE.md is a map: keep it within 400 lines");
    assert!(!architecture.contains("../"), "ARCHITECTURE.md cites something outside the repository");
    let mut pages = vec![(repo().join("README.md"), text.clone()), (repo().join("ARCHITECTURE.md"), architecture)];
    pages.extend(docs());
    let mut broken = Vec::new();
    let mut checked = 0;
    for (path, md) in &pages {
        let dir = path.parent().expect("a page's directory");
        for target in relative_links(md) {
            checked += 1;
            if !dir.join(&target).exists() {
                broken.push(format!("{} -> {target}", path.strip_prefix(repo()).unwrap_or(path).display()));
            }
        }
    }
    assert!(broken.is_empty(), "links to files that are not there: {broken:?}");
    assert!(checked >= 20, "only {checked} links found: has the README's form changed?");
    assert!(text.contains("](docs/dashboard.png)"), "the README shows the status page's screenshot");
}
