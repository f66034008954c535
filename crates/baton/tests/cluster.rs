//! Multi-process clusters: `baton conductor` and `baton worker` processes on real sockets,
//! KV pulled and pushed between processes over TCP and shared memory, membership through the
//! embedded registry and through a real etcd, workers joining, leaving and killed mid-request
//! (and mid-push), and a KV accounting check on every worker after each scenario.

#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

#[cfg(feature = "etcd")]
#[path = "../../baton-cluster/tests/common/mod.rs"]
mod etcd_common;
#[path = "../../baton-transfer/tests/relay/mod.rs"]
mod relay;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use baton_cluster::{AUTH_HEADER, ClusterSecret, unix_millis};
use serde_json::{Value, json};

const SECRET: &str = "test-cluster-secret";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn model(name: &str) -> PathBuf {
    repo().join("fixtures/models").join(name)
}

/// A child process killed on drop, with the lines of its stdout.
struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
    what: String,
}

impl Proc {
    fn spawn(what: &str, args: &[&str], secret: &str) -> Proc {
        Proc::spawn_env(what, args, secret, &[])
    }

    fn spawn_env(what: &str, args: &[&str], secret: &str, env: &[(&str, &str)]) -> Proc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_baton"))
            .args(args)
            .envs(env.iter().copied())
            .env("BATON_CLUSTER_SECRET", secret)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let (tx, lines) = mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        Proc { child, lines, what: what.to_owned() }
    }

    /// The first stdout line containing `needle`.
    fn wait_line(&mut self, needle: &str, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return line,
                Ok(_) => {}
                Err(_) => {
                    let status = self.child.try_wait().unwrap();
                    panic!("{} printed no `{needle}` within {limit:?} (exit status {status:?})", self.what)
                }
            }
        }
    }

    /// Waits for the process to exit, with a deadline.
    fn wait_exit(&mut self, limit: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "{} did not exit within {limit:?}", self.what);
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    #[cfg_attr(not(feature = "etcd"), allow(dead_code))] // only the etcd test interrupts
    fn interrupt(&mut self) {
        let _ = Command::new("kill").arg("-INT").arg(self.child.id().to_string()).status();
    }

    /// Sends `signal` (a name `kill` takes: STOP, CONT, ...).
    fn signal(&self, signal: &str) {
        let status = Command::new("kill").arg(format!("-{signal}")).arg(self.child.id().to_string()).status();
        assert!(status.is_ok_and(|s| s.success()), "kill -{signal} {}", self.what);
    }

    /// SIGTERM, what Kubernetes and systemd send.
    fn terminate(&self) {
        let _ = Command::new("kill").arg("-TERM").arg(self.child.id().to_string()).status();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A started worker: its process and its control URL.
struct WorkerProc {
    proc: Proc,
    url: String,
    /// Where its KV server listens.
    kv: String,
}

fn conductor(model_dir: &Path, registry: &str) -> (Proc, String) {
    conductor_with(model_dir, registry, &[])
}

fn conductor_with(model_dir: &Path, registry: &str, extra: &[&str]) -> (Proc, String) {
    let mut args = vec![
        "conductor",
        "--model",
        model_dir.to_str().unwrap(),
        "--model-id",
        "tiny",
        "--port",
        "0",
        "--registry",
        registry,
    ];
    args.extend_from_slice(extra);
    let mut p = Proc::spawn("conductor", &args, SECRET);
    let line = p.wait_line("listening on", Duration::from_secs(60));
    let url = line.rsplit(' ').next().unwrap().to_owned();
    (p, url)
}

fn worker(model_dir: &Path, role: &str, registry: &str, extra: &[&str]) -> WorkerProc {
    worker_with_secret(model_dir, role, registry, extra, SECRET)
}

fn worker_with_secret(model_dir: &Path, role: &str, registry: &str, extra: &[&str], secret: &str) -> WorkerProc {
    worker_env(model_dir, role, registry, extra, secret, &[])
}

fn worker_env(
    model_dir: &Path,
    role: &str,
    registry: &str,
    extra: &[&str],
    secret: &str,
    env: &[(&str, &str)],
) -> WorkerProc {
    let mut args = vec![
        "worker",
        "--role",
        role,
        "--model",
        model_dir.to_str().unwrap(),
        "--model-id",
        "tiny",
        "--registry",
        registry,
    ];
    if !extra.contains(&"--num-blocks") {
        args.extend_from_slice(&["--num-blocks", "256"]);
    }
    if !extra.contains(&"--ttl-s") {
        args.extend_from_slice(&["--ttl-s", "1.5"]);
    }
    args.extend_from_slice(extra);
    let mut proc = Proc::spawn_env(&format!("{role} worker"), &args, secret, env);
    let line = proc.wait_line("ready:", Duration::from_secs(60));
    let url = line.split("control ").nth(1).unwrap().split(' ').next().unwrap().to_owned();
    let kv = line.split(" kv ").nth(1).unwrap().trim().to_owned();
    WorkerProc { proc, url, kv }
}

fn http() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap()
}

/// The names of the workers the conductor routes to.
fn members(conductor: &str) -> Vec<String> {
    let r = http().get(format!("{conductor}/health")).send().unwrap();
    let body: Value = r.json().unwrap_or(Value::Null);
    body["workers"]
        .as_array()
        .map_or_else(Vec::new, |a| a.iter().map(|w| w["name"].as_str().unwrap_or_default().to_owned()).collect())
}

fn wait_members(conductor: &str, n: usize, limit: Duration) -> Vec<String> {
    let deadline = Instant::now() + limit;
    loop {
        let m = members(conductor);
        if m.len() == n {
            return m;
        }
        assert!(Instant::now() < deadline, "the conductor saw {m:?}, not {n} workers, within {limit:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn complete(base: &str, prompt: &str, max_tokens: usize) -> Value {
    complete_with_key(base, None, prompt, max_tokens)
}

fn complete_with_key(base: &str, key: Option<&str>, prompt: &str, max_tokens: usize) -> Value {
    let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0});
    let mut r = http().post(format!("{base}/v1/completions")).json(&body);
    if let Some(key) = key {
        r = r.bearer_auth(key);
    }
    let r = r.send().unwrap();
    let status = r.status();
    let v: Value = r.json().unwrap();
    assert!(status.is_success(), "{base}: {status} {v}");
    v
}

fn text(v: &Value) -> String {
    v["choices"][0]["text"].as_str().unwrap().to_owned()
}

/// A worker's stats through its control API (signed with the cluster secret).
fn stats(url: &str) -> Value {
    let secret = ClusterSecret::new(SECRET).unwrap();
    let proof = secret.sign_request("GET", "/worker/v1/stats", unix_millis(), b"");
    let r = http().get(format!("{url}/worker/v1/stats")).header(AUTH_HEADER, proof).send().unwrap();
    let status = r.status();
    let v: Value = r.json().unwrap_or(Value::Null);
    assert!(status.is_success(), "stats of {url}: {status} {v}");
    v
}

/// Every worker ends with nothing in flight, nothing leased and every block allocatable.
fn assert_no_leak(workers: &[&WorkerProc]) {
    for w in workers {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let s = stats(&w.url);
            let quiet = serde_json::from_value::<baton_protocol::WorkerStats>(s.clone()).unwrap().is_quiet();
            if quiet {
                break;
            }
            assert!(Instant::now() < deadline, "worker {} still holds KV: {s}", w.url);
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// `baton generate`'s greedy text for a prompt.
fn generate(model_dir: &Path, prompt: &str, max_tokens: usize) -> String {
    generate_with(model_dir, prompt, max_tokens, &[])
}

fn generate_with(model_dir: &Path, prompt: &str, max_tokens: usize, extra: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["generate", "--model", model_dir.to_str().unwrap(), "--prompt", prompt, "--json"])
        .args(["--max-tokens", &max_tokens.to_string()])
        .args(extra)
        .output()
        .unwrap();
    assert!(out.status.success(), "baton generate: {}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["text"].as_str().unwrap().to_owned()
}

/// A prompt of several KV blocks.
const LONG: &str = "The quick brown fox jumps over the lazy dog while the cat watches from the \
    warm windowsill, and the farmer counts his sheep one by one before the evening rain begins";

#[test]
fn one_prefill_one_decode_over_tcp_matches_colocated_and_generate() {
    for name in ["tiny-llama", "tiny-qwen2"] {
        let dir = model(name);
        let (_c, url) = conductor(&dir, "embedded");
        let p = worker(&dir, "prefill", &url, &[]);
        let d = worker(&dir, "decode", &url, &["--transport", "tcp"]);
        wait_members(&url, 2, Duration::from_secs(10));
        // A colocated worker of its own cluster: its direct OpenAI API is the reference.
        let (_c2, url2) = conductor(&dir, "embedded");
        let colo = worker(&dir, "colocated", &url2, &["--api-key", "direct-key"]);
        // Its control port serves that API only with the key.
        let body = json!({"model": "tiny", "prompt": "Hello", "max_tokens": 2});
        let r = http().post(format!("{}/v1/completions", colo.url)).json(&body).send().unwrap();
        assert_eq!(r.status(), 401, "a colocated worker's API answered without its key");
        assert_eq!(r.json::<Value>().unwrap()["error"]["type"], "authentication_error");
        let r = http().post(format!("{}/v1/completions", p.url)).json(&body).send().unwrap();
        assert_eq!(r.status(), 404, "a prefill worker's control port served the OpenAI API");
        assert!(r.json::<Value>().unwrap()["error"]["message"].as_str().unwrap().contains("conductor"));
        for prompt in ["Hello", LONG] {
            let disagg = complete(&url, prompt, 12);
            let colocated = complete_with_key(&colo.url, Some("direct-key"), prompt, 12);
            let expected = generate(&dir, prompt, 12);
            assert_eq!(text(&disagg), expected, "{name}: disaggregated vs baton generate for {prompt:?}");
            assert_eq!(text(&colocated), expected, "{name}: colocated vs baton generate for {prompt:?}");
            assert_eq!(disagg["usage"], colocated["usage"], "{name}");
        }
        let metrics = http().get(format!("{url}/metrics")).send().unwrap().text().unwrap();
        let moved = metrics.lines().find(|l| l.starts_with("baton_kv_transfer_bytes_total")).unwrap();
        assert!(!moved.ends_with(" 0"), "no KV moved between the processes: {moved}");
        assert_no_leak(&[&p, &d, &colo]);
    }
}

/// A prefill worker with float32 KV and a decode worker with float16 KV cannot exchange KV (their
/// KV servers refuse each other): the conductor runs what it would split between them whole on
/// the decode worker, counted, instead of prefilling on one and recomputing on the other.
#[test]
fn workers_whose_kv_types_differ_run_requests_whole_on_the_decode_worker() {
    let dir = model("tiny-llama");
    let (_c, url) = conductor(&dir, "embedded");
    let p = worker(&dir, "prefill", &url, &[]);
    let d = worker(&dir, "decode", &url, &["--kv-dtype", "f16"]);
    wait_members(&url, 2, Duration::from_secs(10));
    let expected = generate_with(&dir, LONG, 12, &["--kv-dtype", "f16"]);
    for _ in 0..2 {
        assert_eq!(text(&complete(&url, LONG, 12)), expected, "against baton generate --kv-dtype f16");
    }
    let whole = metric(&url, "baton_kv_incompatible_routes_total ");
    assert_eq!(whole, 2.0, "each request ran whole on the decode worker");
    assert_eq!(metric_sum(&url, "baton_kv_transfers_total"), 0.0, "no KV moved");
    // /health says each worker's KV kind, so an operator can see which pair differs.
    let health: Value = http().get(format!("{url}/health")).send().unwrap().json().unwrap();
    let kinds: Vec<&str> = health["workers"].as_array().unwrap().iter().filter_map(|w| w["kv"].as_str()).collect();
    assert_eq!(kinds.len(), 2, "{health}");
    assert!(kinds.iter().any(|k| k.starts_with("f32 KV")) && kinds.iter().any(|k| k.starts_with("f16 KV")), "{health}");
    assert_no_leak(&[&p, &d]);
}

/// With a decode worker of each KV type, a prefill worker hands off only to the one that can
/// take its KV, though the other is every policy's first pick (it joined first: the lower id,
/// and both are idle). Before the snapshot carried KV groups the policy picked that one and the
/// conductor ran each request whole on it.
#[test]
fn a_prefill_worker_hands_off_only_to_a_decode_worker_of_its_kv_type() {
    let dir = model("tiny-llama");
    let (_c, url) = conductor(&dir, "embedded");
    let d32 = worker(&dir, "decode", &url, &[]);
    wait_members(&url, 1, Duration::from_secs(10));
    let p = worker(&dir, "prefill", &url, &["--kv-dtype", "f16"]);
    let d16 = worker(&dir, "decode", &url, &["--kv-dtype", "f16"]);
    wait_members(&url, 3, Duration::from_secs(10));
    let expected = generate_with(&dir, LONG, 12, &["--kv-dtype", "f16"]);
    for _ in 0..3 {
        assert_eq!(text(&complete(&url, LONG, 12)), expected, "against baton generate --kv-dtype f16");
    }
    assert_eq!(metric(&url, "baton_kv_incompatible_routes_total "), 0.0, "a request ran whole");
    assert!(metric_sum(&url, "baton_kv_transfers_total") > 0.0, "no KV moved");
    assert_no_leak(&[&p, &d32, &d16]);
}

#[test]
fn concurrent_streams_across_processes_over_shared_memory() {
    let dir = model("tiny-llama");
    let (_c, url) = conductor(&dir, "embedded");
    let p = worker(&dir, "prefill", &url, &[]);
    let d = worker(&dir, "decode", &url, &["--transport", "shm"]);
    wait_members(&url, 2, Duration::from_secs(10));
    let expected = generate(&dir, LONG, 16);
    let handles: Vec<_> = (0..6)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || {
                let body = json!({"model": "tiny", "prompt": LONG, "max_tokens": 16, "temperature": 0, "stream": true});
                let r = http().post(format!("{url}/v1/completions")).json(&body).send().unwrap();
                assert!(r.status().is_success());
                let mut text = String::new();
                for line in r.text().unwrap().lines() {
                    if let Some(data) = line.strip_prefix("data: ")
                        && data != "[DONE]"
                    {
                        let v: Value = serde_json::from_str(data).unwrap();
                        text.push_str(v["choices"][0]["text"].as_str().unwrap_or_default());
                    }
                }
                text
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), expected);
    }
    assert_no_leak(&[&p, &d]);
}

/// Streams a long completion; calls `after_some` once a few chunks arrived; returns the body.
#[cfg_attr(not(feature = "etcd"), allow(dead_code))] // only the etcd test uses it
fn stream_and_then(url: &str, after_some: impl FnOnce()) -> String {
    use std::io::Read;
    let body = json!({"model": "tiny", "prompt": LONG, "max_tokens": 900, "temperature": 0,
        "ignore_eos": true, "stream": true});
    let mut r = http().post(format!("{url}/v1/completions")).json(&body).send().unwrap();
    assert!(r.status().is_success());
    let mut all = String::new();
    let mut buf = [0u8; 256];
    let mut hook = Some(after_some);
    loop {
        let n = r.read(&mut buf).unwrap_or(0);
        if n == 0 {
            return all;
        }
        all.push_str(&String::from_utf8_lossy(&buf[..n]));
        if all.matches("data: ").count() >= 4
            && let Some(h) = hook.take()
        {
            h();
        }
    }
}

#[cfg(not(feature = "etcd"))]
#[test]
fn an_etcd_registry_without_the_feature_says_to_rebuild_with_it() {
    let dir = model("tiny-llama");
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["conductor", "--model", dir.to_str().unwrap(), "--port", "0", "--registry", "etcd://127.0.0.1:2379"])
        .env("BATON_CLUSTER_SECRET", SECRET)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a conductor without etcd support started: {stderr}");
    assert!(stderr.contains("--features etcd"), "{stderr}");
}

#[cfg(feature = "etcd")]
#[test]
fn etcd_membership_workers_join_leave_and_die_mid_request() {
    let etcd = etcd_common::TestEtcd::start();
    let registry = format!("etcd://{}", etcd.endpoint);
    let dir = model("tiny-llama");
    let (_c, url) = conductor(&dir, &registry);
    let p = worker(&dir, "prefill", &registry, &["--name", "prefill-1"]);
    let mut d1 = worker(&dir, "decode", &registry, &["--transport", "tcp", "--name", "decode-1"]);
    wait_members(&url, 2, Duration::from_secs(10));
    let expected = generate(&dir, LONG, 8);
    assert_eq!(text(&complete(&url, LONG, 8)), expected);

    // Kill the decode worker in the middle of a stream it serves: no other decode worker is
    // left, so the prefill worker continues the request whole from what was streamed (no role
    // is a single point of failure); the worker is dropped within its TTL; nothing stays held
    // on the prefill side.
    let body = stream_and_then(&url, || d1.proc.kill());
    assert!(
        body.contains("[DONE]") && !body.contains("\"error\""),
        "the stream did not go on after its decode worker died: ...{}",
        &body[body.len().saturating_sub(300)..]
    );
    let left = wait_members(&url, 1, Duration::from_secs(10));
    assert_eq!(left, ["prefill-1"]);
    assert_no_leak(&[&p]);

    // A new decode worker joins at run time and serves.
    let mut d2 = worker(&dir, "decode", &registry, &["--transport", "tcp", "--name", "decode-2"]);
    wait_members(&url, 2, Duration::from_secs(10));
    assert_eq!(text(&complete(&url, LONG, 8)), expected);
    assert_no_leak(&[&p, &d2]);

    // A worker that leaves cleanly (Ctrl-C) deregisters at once; the prefill worker alone runs
    // requests whole.
    d2.proc.interrupt();
    assert!(d2.proc.wait_exit(Duration::from_secs(10)).success());
    wait_members(&url, 1, Duration::from_secs(3));
    assert_eq!(text(&complete(&url, LONG, 8)), expected);
    assert_no_leak(&[&p]);
}

#[test]
fn a_request_routed_to_a_dead_worker_is_retried_elsewhere() {
    let dir = model("tiny-llama");
    let (_c, url) = conductor(&dir, "embedded");
    // Joined first, so least-load's tie-break picks it; dead before its 10 s lease runs out.
    let mut dead = worker(&dir, "colocated", &url, &["--name", "a-dead", "--ttl-s", "10"]);
    let live = worker(&dir, "colocated", &url, &["--name", "b-live"]);
    wait_members(&url, 2, Duration::from_secs(10));
    dead.proc.kill();
    let expected = generate(&dir, LONG, 6);
    assert_eq!(text(&complete(&url, LONG, 6)), expected);
    let metrics = http().get(format!("{url}/metrics")).send().unwrap().text().unwrap();
    assert!(metrics.contains("baton_retries_total 1"), "{metrics}");
    assert_no_leak(&[&live]);
}

#[test]
fn a_worker_without_the_secret_is_refused_and_the_control_api_wants_proof() {
    let dir = model("tiny-llama");
    let (_c, url) = conductor(&dir, "embedded");
    let mut intruder = Proc::spawn(
        "intruder",
        &["worker", "--role", "decode", "--model", dir.to_str().unwrap(), "--model-id", "tiny", "--registry", &url],
        "not-the-secret",
    );
    let status = intruder.wait_exit(Duration::from_secs(60));
    assert!(!status.success(), "a worker with the wrong secret joined");
    assert!(members(&url).is_empty());

    // The control API of a real worker refuses unsigned and wrongly signed calls.
    let p = worker(&dir, "prefill", &url, &[]);
    let r = http().get(format!("{}/worker/v1/stats", p.url)).send().unwrap();
    assert_eq!(r.status(), 401);
    let wrong = ClusterSecret::new("wrong").unwrap().sign_request("GET", "/worker/v1/stats", unix_millis(), b"");
    let r = http().get(format!("{}/worker/v1/stats", p.url)).header(AUTH_HEADER, wrong).send().unwrap();
    assert_eq!(r.status(), 401);
    let body = r.json::<Value>().unwrap();
    assert!(body["error"]["message"].as_str().unwrap().contains("cluster"), "{body}");
    // A captured call is accepted once: played again, it is refused.
    let proof = ClusterSecret::new(SECRET).unwrap().sign_request("GET", "/worker/v1/stats", unix_millis(), b"");
    let r = http().get(format!("{}/worker/v1/stats", p.url)).header(AUTH_HEADER, &proof).send().unwrap();
    assert_eq!(r.status(), 200);
    let r = http().get(format!("{}/worker/v1/stats", p.url)).header(AUTH_HEADER, &proof).send().unwrap();
    assert_eq!(r.status(), 401, "a replayed control call was accepted");
    let body = r.json::<Value>().unwrap();
    assert!(body["error"]["message"].as_str().unwrap().contains("replayed"), "{body}");
    // Re-spelled, it is refused too (#37: each of these was accepted again).
    let (t, rest) = proof.split_once(',').unwrap();
    let (n, sig) = rest.split_once(',').unwrap();
    let respelled = [
        format!("{t}, {n}, {sig}"),
        format!("{t},\t{n},{sig}"),
        format!("t=0{},{n},{sig}", &t[2..]),
        format!("{t},{n},sig={}", sig[4..].to_uppercase()),
        format!("{t},n={},{sig}", n[2..].to_uppercase()),
    ];
    for spelling in respelled {
        let r = http().get(format!("{}/worker/v1/stats", p.url)).header(AUTH_HEADER, &spelling).send().unwrap();
        assert_eq!(r.status(), 401, "the replay {spelling:?} was accepted");
    }
}

/// Streams a completion, calls `hook` once `after` chunks arrived, and returns the whole body.
fn stream_with_hook(url: &str, max_tokens: usize, after: usize, hook: impl FnOnce()) -> String {
    use std::io::Read;
    let body = json!({"model": "tiny", "prompt": LONG, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": true, "stream": true});
    let mut r = http().post(format!("{url}/v1/completions")).json(&body).send().unwrap();
    assert!(r.status().is_success());
    let mut all = String::new();
    let mut buf = [0u8; 256];
    let mut hook = Some(hook);
    loop {
        let n = r.read(&mut buf).unwrap_or(0);
        if n == 0 {
            return all;
        }
        all.push_str(&String::from_utf8_lossy(&buf[..n]));
        if all.matches("data: ").count() >= after
            && let Some(h) = hook.take()
        {
            h();
        }
    }
}

/// The text of a streamed completion's body.
fn streamed_text(body: &str) -> String {
    let mut text = String::new();
    for line in body.lines() {
        if let Some(data) = line.strip_prefix("data: ")
            && data != "[DONE]"
        {
            let v: Value = serde_json::from_str(data).unwrap();
            assert!(v.get("error").is_none(), "streamed error: {v}");
            text.push_str(v["choices"][0]["text"].as_str().unwrap_or_default());
        }
    }
    text
}

#[test]
fn push_mode_over_tcp_matches_pull_mode_and_generate() {
    for name in ["tiny-llama", "tiny-qwen2"] {
        let dir = model(name);
        // One pair of workers, two conductors: the push one serves the registry, the pull one
        // follows it. Workers take either mode, request by request.
        let (_push, push_url) = conductor_with(&dir, "embedded", &["--kv-transfer", "push"]);
        let p = worker(&dir, "prefill", &push_url, &[]);
        let d = worker(&dir, "decode", &push_url, &["--transport", "tcp"]);
        let (_pull, pull_url) = conductor_with(&dir, &push_url, &["--kv-transfer", "pull"]);
        wait_members(&push_url, 2, Duration::from_secs(10));
        wait_members(&pull_url, 2, Duration::from_secs(10));
        for prompt in ["Hello", LONG] {
            let expected = generate(&dir, prompt, 12);
            let pushed = complete(&push_url, prompt, 12);
            let pulled = complete(&pull_url, prompt, 12);
            assert_eq!(text(&pushed), expected, "{name}: push vs baton generate for {prompt:?}");
            assert_eq!(text(&pulled), expected, "{name}: pull vs baton generate for {prompt:?}");
            // The same counts; the second request may find the prompt in the prefill worker's
            // prefix cache (`prompt_tokens_details.cached_tokens`).
            for key in ["prompt_tokens", "completion_tokens", "total_tokens"] {
                assert_eq!(pushed["usage"][key], pulled["usage"][key], "{name}: {key}");
            }
        }
        for url in [&push_url, &pull_url] {
            let metrics = http().get(format!("{url}/metrics")).send().unwrap().text().unwrap();
            let moved = metrics.lines().find(|l| l.starts_with("baton_kv_transfer_bytes_total")).unwrap();
            assert!(!moved.ends_with(" 0"), "no KV moved between the processes: {moved}");
        }
        assert_no_leak(&[&p, &d]);
    }
}

/// Two worker processes whose KV arenas pose as device arenas (host memory standing in for GPU
/// memory, `--device stand-in`): the transfer plane finds at CONNECT that both arenas are on
/// devices of one host, and hand-offs pulled, pushed and pushed layer by layer go device to
/// device, with the texts `baton generate` gives and nothing left held.
#[test]
fn hand_offs_between_device_arenas_go_device_to_device_in_every_mode() {
    let dir = model("tiny-llama");
    let (_pull, pull_url) = conductor_with(&dir, "embedded", &["--kv-transfer", "pull"]);
    let p = worker(&dir, "prefill", &pull_url, STAND_IN);
    let d = worker(&dir, "decode", &pull_url, STAND_IN);
    let (_push, push_url) = conductor_with(&dir, &pull_url, &["--kv-transfer", "push"]);
    let (_layers, layers_url) = conductor_with(&dir, &pull_url, &["--kv-transfer", "layerwise"]);
    // A prompt of its own for each mode, so that no hand-off finds its prompt cached already.
    let modes = [
        (&pull_url, "pull", LONG),
        (&push_url, "push", "Once upon a time, in a quiet village by the sea"),
        (&layers_url, "layerwise", "Write a short note about rivers, mountains and the long roads between them"),
    ];
    for (url, _, _) in &modes {
        wait_members(url, 2, Duration::from_secs(10));
    }
    for (url, mode, prompt) in modes {
        let expected = generate(&dir, prompt, 12);
        assert_eq!(text(&complete(url, prompt, 12)), expected, "{mode}: device-to-device hand-off vs baton generate");
        let device = metric(url, "baton_kv_transfers_total{transport=\"device\"}");
        let others = metric(url, "baton_kv_transfers_total{transport=\"shm\"}")
            + metric(url, "baton_kv_transfers_total{transport=\"tcp\"}");
        assert_eq!((device, others), (1.0, 0.0), "{mode}: the hand-off did not go device to device");
        // The workers' copy meters (`baton_kv_copy_bytes_total`): the KV went device to device,
        // and nothing left a device arena for the host.
        let copied = |direction: &str| copy_bytes(url, direction);
        assert!(copied("device_to_device") > 0.0, "{mode}: no device-to-device bytes counted");
        assert_eq!(copied("device_to_host"), 0.0, "{mode}: bytes left a device arena for the host");
    }
    assert_no_leak(&[&p, &d]);
}

/// Bytes the workers behind the conductor at `url` copied `direction`, summed over workers.
fn copy_bytes(url: &str, direction: &str) -> f64 {
    sum_of_lines(url, &format!("baton_kv_copy_bytes_total{{direction=\"{direction}\""))
}

/// A worker lets go of a dead peer's arena. After a hand-off the receiving side of it maps the
/// other's arena — the decode worker the prefill worker's when it pulls, the prefill worker the
/// decode worker's when it pushes; over shared memory, or the stand-in device arena, a memfd
/// handed over as a CUDA VMM allocation is: either stays allocated while any process holds it,
/// so a dead worker's arena would live on in its peers. Once the peer is killed, with no
/// transfer under way, the survivor drops its mapping within seconds (a decode worker's
/// transfer thread sees the process gone; a prefill worker's KV server, the connection
/// closed).
#[test]
fn a_worker_lets_go_of_a_dead_peers_arena() {
    for mode in ["pull", "push"] {
        lets_go_of_a_dead_peers_arena(mode, &[]);
        lets_go_of_a_dead_peers_arena(mode, STAND_IN);
    }
}

/// A worker's flags that put its KV on the stand-in device (host memory posing as a GPU's).
const STAND_IN: &[&str] = &["--device", "stand-in"];

fn lets_go_of_a_dead_peers_arena(mode: &str, device: &[&str]) {
    // The memfds process `pid` maps (by inode): its own arena, and those of peers it opened.
    let arenas = |pid: u32| -> std::collections::BTreeSet<u64> {
        std::fs::read_to_string(format!("/proc/{pid}/maps"))
            .expect("maps")
            .lines()
            .filter(|l| l.contains("/memfd:baton-"))
            .filter_map(|l| l.split_whitespace().nth(4)?.parse().ok())
            .collect()
    };
    let dir = model("tiny-llama");
    let (_c, url) = conductor_with(&dir, "embedded", &["--kv-transfer", mode]);
    let mut p = worker(&dir, "prefill", &url, &[&["--name", "p"], device].concat());
    let mut d = worker(&dir, "decode", &url, &[&["--name", "d"], device].concat());
    wait_members(&url, 2, Duration::from_secs(10));
    let (survivor, dead) = if mode == "pull" { (&d, &mut p) } else { (&p, &mut d) };
    let pid = survivor.proc.child.id();
    let own = arenas(pid);
    assert_eq!(text(&complete(&url, LONG, 4)), generate(&dir, LONG, 4));
    let transport = if device.is_empty() { "shm" } else { "device" };
    assert_eq!(metric(&url, &format!("baton_kv_transfers_total{{transport=\"{transport}\"}}")), 1.0);
    let opened = arenas(pid);
    assert!(opened.len() > own.len(), "{mode} over {transport}: no peer's arena mapped: {own:?}, then {opened:?}");
    dead.proc.kill();
    let deadline = Instant::now() + Duration::from_secs(10);
    while arenas(pid) != own {
        assert!(Instant::now() < deadline, "{mode} over {transport}: the dead worker's arena is still mapped");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A prefill worker restarted at the same KV address gets its next hand-off over a fresh
/// connection: the decode worker saw the old one closed while idle and dropped it, rather than
/// fail that hand-off on it first (and recompute the prompt). Over TCP, the path between hosts.
#[test]
fn a_prefill_worker_restarted_at_the_same_address_hands_off_at_once() {
    let dir = model("tiny-llama");
    let (_c, url) = conductor_with(&dir, "embedded", &["--kv-transfer", "pull"]);
    let kv_port = free_port().to_string();
    let prefill = |url: &str| worker(&dir, "prefill", url, &["--name", "p", "--kv-port", &kv_port]);
    let mut p = prefill(&url);
    let _d = worker(&dir, "decode", &url, &["--name", "d", "--transport", "tcp"]);
    wait_members(&url, 2, Duration::from_secs(10));
    let tcp = || metric(&url, "baton_kv_transfers_total{transport=\"tcp\"}");
    assert_eq!(text(&complete(&url, LONG, 4)), generate(&dir, LONG, 4));
    assert_eq!(tcp(), 1.0, "the first hand-off");
    p.proc.kill();
    // The conductor forgets the dead worker (its lease lapses), then meets the new one.
    let deadline = Instant::now() + Duration::from_secs(20);
    while members(&url).len() > 1 {
        assert!(Instant::now() < deadline, "the killed worker was never dropped");
        std::thread::sleep(Duration::from_millis(100));
    }
    let _p = prefill(&url);
    wait_members(&url, 2, Duration::from_secs(10));
    let prompt = "Once upon a time, in a quiet village by the sea";
    assert_eq!(text(&complete(&url, prompt, 4)), generate(&dir, prompt, 4));
    assert_eq!(tcp(), 2.0, "the hand-off to the restarted worker failed on the old connection");
}

/// A client that leaves mid-stream frees what its request held on remote workers: the
/// conductor drops its streams from them, and each worker's stream task (which also sends the
/// keep-alives) ends at once and aborts the request.
#[test]
fn a_client_that_leaves_mid_stream_frees_its_kv_on_remote_workers() {
    use std::io::Read;
    let dir = model("tiny-llama");
    let (_c, url) = conductor(&dir, "embedded");
    let p = worker(&dir, "prefill", &url, &[]);
    let d = worker(&dir, "decode", &url, &[]);
    wait_members(&url, 2, Duration::from_secs(10));
    let body = json!({"model": "tiny", "prompt": LONG, "max_tokens": 900, "ignore_eos": true, "stream": true});
    let mut r = http().post(format!("{url}/v1/completions")).json(&body).send().unwrap();
    assert!(r.status().is_success());
    let mut first = [0u8; 256];
    let n = r.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).contains("data:"), "streaming");
    drop(r);
    assert_no_leak(&[&p, &d]);
}

/// No role is a single point of failure (#36, item 9: with the only prefill worker killed, 20 of
/// 20 requests got 503 "no worker is available" while the decode worker sat idle). Killed
/// (SIGKILL): 20 sequential requests are all served whole by the decode worker, with the
/// undisturbed text. A new prefill worker joins: disaggregation resumes. It hangs (SIGSTOP,
/// still a member): the request sent to it runs on the decode worker after the conductor's
/// `--worker-timeout-s`, and the next ones go there at once; none gets a 503.
#[test]
fn the_only_prefill_worker_dying_or_hanging_costs_no_request() {
    let dir = model("tiny-llama");
    let (_c, url) = conductor_with(&dir, "embedded", &["--worker-timeout-s", "1"]);
    let mut p1 = worker(&dir, "prefill", &url, &["--name", "p1", "--ttl-s", "2"]);
    let d = worker(&dir, "decode", &url, &["--name", "d"]);
    wait_members(&url, 2, Duration::from_secs(10));
    let expected = generate(&dir, LONG, 6);
    let disaggregated = || metric(&url, "baton_routing_decisions_total{route=\"disaggregated\"}");
    assert_eq!(text(&complete(&url, LONG, 6)), expected);
    assert_eq!(disaggregated(), 1.0);

    p1.proc.kill();
    for i in 0..20 {
        assert_eq!(text(&complete(&url, LONG, 6)), expected, "request {i} after the prefill worker died");
    }
    // (The first may have been routed to the dead worker before its stream broke.)
    let before = disaggregated();
    assert!(before <= 2.0, "requests were disaggregated without a prefill worker: {before}");
    assert_eq!(wait_members(&url, 1, Duration::from_secs(10)), ["d"]);

    let p2 = worker(&dir, "prefill", &url, &["--name", "p2", "--ttl-s", "600"]);
    wait_members(&url, 2, Duration::from_secs(10));
    assert_eq!(text(&complete(&url, LONG, 6)), expected);
    assert_eq!(disaggregated(), before + 1.0, "disaggregation resumes when a prefill worker is back");

    p2.proc.signal("STOP");
    for i in 0..5 {
        assert_eq!(text(&complete(&url, LONG, 6)), expected, "request {i} with the prefill worker hung");
    }
    p2.proc.signal("CONT");
    assert_no_leak(&[&d]);
}

/// A worker frozen past its TTL (SIGSTOP: a long pause, or a partition as the registry sees it)
/// is dropped from the cluster; once it runs again its heartbeat finds its lease gone and it joins
/// again and serves, instead of exiting.
#[test]
fn a_worker_dropped_for_silence_joins_again_when_it_wakes() {
    let dir = model("tiny-llama");
    let (_c, url) = conductor(&dir, "embedded");
    let p = worker(&dir, "prefill", &url, &[]);
    let mut d = worker(&dir, "decode", &url, &[]);
    wait_members(&url, 2, Duration::from_secs(10));
    let expected = generate(&dir, LONG, 12);
    assert_eq!(text(&complete(&url, LONG, 12)), expected);
    d.proc.signal("STOP");
    wait_members(&url, 1, Duration::from_secs(10));
    d.proc.signal("CONT");
    wait_members(&url, 2, Duration::from_secs(10));
    assert!(d.proc.child.try_wait().unwrap().is_none(), "the woken worker exited instead of joining again");
    assert_eq!(text(&complete(&url, LONG, 12)), expected, "served after joining again");
    assert_no_leak(&[&p, &d]);
}

/// A worker that stays a member but answers nothing (frozen, with a lease longer than the test:
/// a half-open connection as the conductor sees it) holds no request past the conductor's
/// `--worker-timeout-s`: what was sent to it runs on the other prefill worker, with the same
/// text. (Without a deadline on the worker's stream those requests waited forever.)
#[test]
fn a_silent_worker_that_is_still_a_member_holds_no_request() {
    let dir = model("tiny-llama");
    let (_c, url) = conductor_with(&dir, "embedded", &["--worker-timeout-s", "1"]);
    // Once woken, the frozen worker prefills what it was sent and holds the KV for a hand-off
    // no one will take (the conductor gave up on it): its lease bounds that (`--lease-s`).
    let p1 = worker(&dir, "prefill", &url, &["--ttl-s", "600", "--lease-s", "2"]);
    let p2 = worker(&dir, "prefill", &url, &[]);
    let d = worker(&dir, "decode", &url, &[]);
    wait_members(&url, 3, Duration::from_secs(10));
    let expected = generate(&dir, LONG, 8);
    p1.proc.signal("STOP");
    // Two at once, so that the fewest-in-flight policy sends one of them to the frozen worker.
    for round in 0..2 {
        std::thread::scope(|s| {
            let calls: Vec<_> = (0..2).map(|_| s.spawn(|| complete(&url, LONG, 8))).collect();
            for c in calls {
                assert_eq!(text(&c.join().expect("request thread")), expected, "round {round}");
            }
        });
    }
    assert!(metric(&url, "baton_worker_breaker_trips_total") >= 1.0, "no request went to the frozen worker");
    p1.proc.signal("CONT");
    assert_eq!(members(&url).len(), 3, "the silent worker kept its membership");
    assert_no_leak(&[&p1, &p2, &d]);
}

/// Two conductor replicas behind one load balancer route to the same workers at once: each
/// request keeps its own id on the worker. (Every conductor used to number requests from 1, so
/// the replicas' first requests met on the worker as one id and one of them failed with "already
/// running on this worker"; `scripts/live-vs-sim.sh` with CONDUCTORS=2 found it.)
#[test]
fn conductor_replicas_sharing_workers_never_mix_requests() {
    let dir = model("tiny-llama");
    let (_a, a_url) = conductor(&dir, "embedded");
    let p = worker(&dir, "prefill", &a_url, &[]);
    let d = worker(&dir, "decode", &a_url, &[]);
    let (_b, b_url) = conductor(&dir, &a_url);
    wait_members(&a_url, 2, Duration::from_secs(10));
    wait_members(&b_url, 2, Duration::from_secs(10));
    let expected = generate(&dir, LONG, 24);
    // Rounds of one request to each replica at once, so the replicas' n-th requests overlap.
    for round in 0..3 {
        let answers: Vec<Value> = std::thread::scope(|s| {
            let calls: Vec<_> = [&a_url, &b_url].map(|url| s.spawn(move || complete(url, LONG, 24))).into();
            calls.into_iter().map(|c| c.join().expect("request thread")).collect()
        });
        for (answer, url) in answers.iter().zip([&a_url, &b_url]) {
            assert_eq!(text(answer), expected, "round {round}, via {url}: {answer}");
        }
    }
    assert_no_leak(&[&p, &d]);
}

#[test]
fn concurrent_streams_in_push_mode_over_shared_memory() {
    let dir = model("tiny-llama");
    let (_c, url) = conductor_with(&dir, "embedded", &["--kv-transfer", "push"]);
    let p = worker(&dir, "prefill", &url, &[]);
    let d = worker(&dir, "decode", &url, &["--transport", "shm"]);
    wait_members(&url, 2, Duration::from_secs(10));
    let expected = generate(&dir, LONG, 16);
    let handles: Vec<_> = (0..6)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || {
                let body = json!({"model": "tiny", "prompt": LONG, "max_tokens": 16, "temperature": 0, "stream": true});
                let r = http().post(format!("{url}/v1/completions")).json(&body).send().unwrap();
                assert!(r.status().is_success());
                streamed_text(&r.text().unwrap())
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), expected);
    }
    assert_no_leak(&[&p, &d]);
}

#[cfg(feature = "fault-injection")] // Fault injection through the environment.
#[test]
fn a_worker_killed_mid_push_fails_or_recomputes_and_the_survivor_holds_nothing() {
    // Every push of the prefill worker first waits 1.5 s: the window to kill a worker in.
    kill_mid_push("push", "1500", false);
}

/// The same between stand-in device arenas: the prefill worker writes into the decode worker's
/// arena through the device link, which holds that memory itself (as an imported CUDA VMM
/// allocation does: a write after the decode worker died lands in memory no one reads; a
/// legacy CUDA IPC link must stop writing instead, a dead process's memory may already serve
/// another).
#[cfg(feature = "fault-injection")] // Fault injection through the environment.
#[test]
fn a_worker_killed_mid_push_between_device_arenas_fails_or_recomputes_and_the_survivor_holds_nothing() {
    kill_mid_push("push", "1500", true);
}

/// Layer-wise push across processes, and a worker killed in the middle of one (#17): the decode
/// worker registers its blocks when the prefill starts and the prefill worker writes each layer
/// into them as it computes it (here 0.6 s apart: the window to kill a worker in).
#[cfg(feature = "fault-injection")] // Fault injection through the environment.
#[test]
fn a_worker_killed_mid_layerwise_push_fails_or_hands_over_again_and_the_survivor_holds_nothing() {
    kill_mid_push("layerwise", "600", false);
}

/// A push in `mode` whose writes are delayed `delay_ms`: works; the decode worker killed
/// mid-push leaves the prefill worker to run the rest whole (no decode worker is left; the
/// client has the first token and gets the rest); the prefill worker killed
/// mid-push leaves the decode worker to finish the request (it recomputes the prompt; a
/// layer-wise one is first given back and handed over again with the first token). The
/// survivor holds nothing after either. With `device`, every worker's arena poses as a device
/// arena and every hand-off goes through the device link; else the decode workers take TCP,
/// then shared memory.
#[cfg(feature = "fault-injection")]
fn kill_mid_push(mode: &str, delay_ms: &str, device: bool) {
    let layerwise = mode == "layerwise";
    let dir = model("tiny-llama");
    let (_c, url) = conductor_with(&dir, "embedded", &["--kv-transfer", mode]);
    let stand_in: &[&str] = if device { STAND_IN } else { &[] };
    let delay = [(baton_conductor::deploy::PUSH_DELAY_ENV, delay_ms)];
    let (first, second) = if device { ("auto", "auto") } else { ("tcp", "shm") };
    let p = worker_env(&dir, "prefill", &url, &[&["--name", "prefill-1"], stand_in].concat(), SECRET, &delay);
    let mut d1 = worker(&dir, "decode", &url, &[&["--transport", first, "--name", "decode-1"], stand_in].concat());
    wait_members(&url, 2, Duration::from_secs(10));
    let expected = generate(&dir, LONG, 4);
    assert_eq!(text(&complete(&url, LONG, 4)), expected, "{mode}: pushes work, if slowly");
    let metric = |name: &str| -> usize {
        let text = http().get(format!("{url}/metrics")).send().unwrap().text().unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in\n{text}"))
    };
    assert_eq!(metric("baton_kv_layerwise_handoffs_total"), usize::from(layerwise), "{mode}");
    if device {
        assert_eq!(metric("baton_kv_transfers_total{transport=\"device\"}"), 1, "{mode}: not device to device");
    }

    // The decode worker dies after registering its blocks, before the push wrote them all: no
    // decode worker is left, so the prefill worker runs the rest of the request whole from the
    // prompt and the first token (the client has it), and its lease of the pushed KV ends.
    let undisturbed = streamed_text(&stream_with_hook(&url, 40, 1, || {}));
    let body = stream_with_hook(&url, 40, 1, || d1.proc.kill());
    assert!(body.contains("[DONE]"), "{mode}: the request did not go on on the prefill worker: {body}");
    assert_eq!(streamed_text(&body), undisturbed, "{mode}");
    assert_eq!(wait_members(&url, 1, Duration::from_secs(10)), ["prefill-1"]);
    assert_no_leak(&[&p]);

    // The prefill worker dies while the decode worker waits for its push: the decode worker
    // gives its reserved blocks back and, holding the prompt and the first token (layer-wise:
    // handed over again with it), recomputes the prompt's KV itself: the whole answer.
    let d2 = worker(&dir, "decode", &url, &[&["--transport", second, "--name", "decode-2"], stand_in].concat());
    wait_members(&url, 2, Duration::from_secs(10));
    let mut p = p;
    let body = stream_with_hook(&url, 40, 1, || p.proc.kill());
    assert!(body.contains("[DONE]"), "{mode}: the request did not complete: {body}");
    assert_eq!(streamed_text(&body), undisturbed);
    assert_eq!(wait_members(&url, 1, Duration::from_secs(10)), ["decode-2"]);
    assert_no_leak(&[&d2]);
    // A retry for the lost decode worker, and for a layer-wise hand-off sent again (one more
    // when the conductor saw the prefill worker's stream break before it said it finished).
    let retries = metric("baton_retries_total");
    assert!(retries > usize::from(layerwise), "{mode}: {retries} retries");
    if layerwise {
        // The undisturbed request was handed over layer by layer; the disturbed ones, which
        // completed, were not: one ran on without its decode worker, the other was handed over
        // again.
        assert_eq!(metric("baton_kv_layerwise_handoffs_total"), 2, "{mode}");
    }
}

/// `baton worker --emulate h100 --emulate-link-gbps`: emulated worker processes hand the KV
/// over an emulated link in every mode, each hand-off (from the prefill's end to the decode
/// worker's first token, `baton_kv_transfer_seconds`) lasting at least the 70B model's KV
/// (327,680 bytes a token) over 0.1 Gb/s, less the prefill's time for a layer-wise push, which
/// crosses the prefill worker's link as the prefill computes.
#[test]
fn emulated_worker_processes_hand_kv_over_an_emulated_link() {
    let dir = model("tiny-llama");
    let emulate = ["--emulate", "h100", "--emulate-link-gbps", "0.1"];
    let profile = baton_sched::CostProfile::llama2_70b_8xh100();
    for mode in ["pull", "push", "layerwise"] {
        let (_c, url) = conductor_with(&dir, "embedded", &["--kv-transfer", mode]);
        let p = worker(&dir, "prefill", &url, &[&["--name", "p"][..], &emulate].concat());
        let d = worker(&dir, "decode", &url, &[&["--name", "d"][..], &emulate].concat());
        wait_members(&url, 2, Duration::from_secs(10));
        let v = complete(&url, LONG, 3);
        assert_eq!(v["usage"]["completion_tokens"], 3, "{mode}: {v}");
        let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
        let least = (prompt_tokens * profile.kv_bytes_per_token) as f64 / 12_500_000.0;
        let hidden = match mode {
            "layerwise" => profile.prefill_time(prompt_tokens, 0.0) as f64 / 1e6,
            _ => 0.0,
        };
        let metrics = http().get(format!("{url}/metrics")).send().unwrap().text().unwrap();
        let figure = |name: &str| -> f64 {
            metrics.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.trim().parse().ok()).unwrap_or(0.0)
        };
        assert_eq!(figure("baton_kv_transfer_seconds_count "), 1.0, "{mode}");
        let took = figure("baton_kv_transfer_seconds_sum ");
        assert!(took >= least - hidden, "{mode}: the hand-off took {took} s, the link needs {least} s");
        let layerwise = figure("baton_kv_layerwise_handoffs_total ");
        assert_eq!(layerwise, if mode == "layerwise" { 1.0 } else { 0.0 }, "{mode}");
        assert_no_leak(&[&p, &d]);
    }
}

/// A TCP relay from `from` to `to` that forwards everything while `mute` is false, and then
/// only what goes to `to`: what comes back is read and dropped (a connection half cut).
fn one_way_relay(from: SocketAddr, to: SocketAddr, mute: Arc<AtomicBool>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind(from).unwrap();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            let Ok(upstream) = std::net::TcpStream::connect(to) else { continue };
            let (mut c_in, mut u_out) = (client.try_clone().unwrap(), upstream.try_clone().unwrap());
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut c_in, &mut u_out);
                let _ = u_out.shutdown(std::net::Shutdown::Write);
            });
            let mute = Arc::clone(&mute);
            std::thread::spawn(move || {
                let (mut u_in, mut c_out) = (upstream, client);
                let mut buf = [0u8; 16 << 10];
                while let Ok(n @ 1..) = u_in.read(&mut buf) {
                    if !mute.load(Ordering::Relaxed) && c_out.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = c_out.shutdown(std::net::Shutdown::Write);
            });
        }
    });
}

/// A free port on 127.0.0.1 (and so, on Linux, on all of 127/8).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A colocated worker started against `registry` while nothing answers there, still up 1.5 s
/// later (not yet ready: `wait_line("ready:")` tells when it joined).
fn early_worker(dir: &Path, registry: &str) -> Proc {
    let args = ["worker", "--role", "colocated", "--model", dir.to_str().unwrap(), "--model-id", "tiny"];
    let mut w =
        Proc::spawn("early worker", &[&args[..], &["--registry", registry, "--num-blocks", "64"]].concat(), SECRET);
    std::thread::sleep(Duration::from_millis(1500));
    assert!(w.child.try_wait().unwrap().is_none(), "the worker exited while its registry was down");
    w
}

/// A worker started before its conductor (a compose file or a script starting both at once)
/// waits for the registry, saying so, and joins once it answers, instead of exiting.
#[test]
fn a_worker_started_before_its_conductor_joins_when_the_registry_comes_up() {
    let dir = model("tiny-llama");
    let port = free_port().to_string();
    let registry = format!("http://127.0.0.1:{port}");
    let mut w = early_worker(&dir, &registry);
    let model = dir.to_str().unwrap();
    let c_args = ["conductor", "--model", model, "--model-id", "tiny", "--port", &port, "--registry", "embedded"];
    let mut c = Proc::spawn("conductor", &c_args, SECRET);
    c.wait_line("listening on", Duration::from_secs(60));
    w.wait_line("ready:", Duration::from_secs(30));
    wait_members(&registry, 1, Duration::from_secs(10));
    assert_eq!(text(&complete(&registry, LONG, 8)), generate(&dir, LONG, 8));
}

/// The same with etcd as the registry: a worker started before etcd listens waits for it and
/// joins once it answers.
#[cfg(feature = "etcd")]
#[test]
fn a_worker_started_before_etcd_joins_when_etcd_comes_up() {
    let dir = model("tiny-llama");
    let port = free_port();
    let registry = format!("etcd://127.0.0.1:{port}");
    let mut w = early_worker(&dir, &registry);
    let _etcd = etcd_common::TestEtcd::start_on(port);
    let (_c, url) = conductor(&dir, &registry);
    w.wait_line("ready:", Duration::from_secs(30));
    wait_members(&url, 1, Duration::from_secs(10));
    assert_eq!(text(&complete(&url, LONG, 8)), generate(&dir, LONG, 8));
}

/// A hand-off the conductor gave up on is released (#19): the prefill worker is reached through
/// a relay that, mid-request, stops passing its answers back (the conductor's calls still reach
/// it). It computes the prompt and offers the KV under a 60 s lease, but the conductor never
/// hears: its stream goes silent past `--worker-timeout-s`. The conductor releases the hand-off
/// by the request's id anyway, so the worker holds nothing long before its lease would end.
#[test]
fn a_hand_off_the_conductor_gave_up_on_is_released_before_its_lease_ends() {
    let dir = model("tiny-llama");
    let (_c, url) = conductor_with(&dir, "embedded", &["--worker-timeout-s", "1.5"]);
    let (control, kv) = (free_port(), free_port());
    let mute = Arc::new(AtomicBool::new(false));
    for port in [control, kv] {
        let from = SocketAddr::from(([127, 0, 0, 2], port));
        one_way_relay(from, SocketAddr::from(([127, 0, 0, 1], port)), Arc::clone(&mute));
    }
    let (control_s, kv_s) = (control.to_string(), kv.to_string());
    let args = [
        "--name",
        "p",
        "--host",
        "127.0.0.1",
        "--port",
        &control_s,
        "--kv-port",
        &kv_s,
        "--advertise",
        "127.0.0.2",
        "--lease-s",
        "60",
    ];
    let mut p = worker(&dir, "prefill", &url, &args);
    let d = worker(&dir, "decode", &url, &["--name", "d"]);
    wait_members(&url, 2, Duration::from_secs(10));
    assert_eq!(text(&complete(&url, LONG, 4)), generate(&dir, LONG, 4), "through the relay");
    // Checked past the relay.
    p.url = format!("http://127.0.0.1:{control}");
    assert_no_leak(&[&p, &d]);

    mute.store(true, Ordering::Relaxed);
    let body = json!({"model": "tiny", "prompt": LONG, "max_tokens": 4, "temperature": 0});
    // The request runs elsewhere or ends with an error; either way it ends.
    let r = http().post(format!("{url}/v1/completions")).json(&body).send().unwrap();
    eprintln!("with the prefill worker's answers cut: {}", r.status());
    let leased = |w: &WorkerProc| stats(&w.url)["leased"].as_u64().unwrap_or(0);
    eprintln!("leased on p after the request: {}", leased(&p));
    assert_no_leak(&[&p, &d]);
}

/// A 16-bit KV cache across processes (#17): prefill and decode workers started with
/// `--kv-dtype f16` hand KV over TCP with half the bytes a token of float32, and answer what
/// `baton generate --kv-dtype f16` does, on both fixture models.
#[test]
fn workers_with_16_bit_kv_hand_over_half_the_bytes_and_the_same_text() {
    for (name, f32_bytes) in [("tiny-llama", 512.0), ("tiny-qwen2", 384.0)] {
        let dir = model(name);
        let (_c, url) = conductor(&dir, "embedded");
        let half = ["--kv-dtype", "f16", "--transport", "tcp"];
        let p = worker(&dir, "prefill", &url, &half);
        let d = worker(&dir, "decode", &url, &half);
        wait_members(&url, 2, Duration::from_secs(10));
        let v = complete(&url, LONG, 8);
        assert_eq!(text(&v), generate_with(&dir, LONG, 8, &["--kv-dtype", "f16"]), "{name}");
        let bytes = metric(&url, "baton_kv_transfer_bytes_total");
        let tokens = metric(&url, "baton_kv_transfer_tokens_total");
        eprintln!("{name}: {bytes} bytes for {tokens} tokens handed over with f16 KV");
        // Whole 16-token blocks move: the prompt's tokens rounded up, at 2 bytes an element.
        let blocks = (tokens / 16.0).ceil();
        assert_eq!(bytes, blocks * 16.0 * f32_bytes / 2.0, "{name}: not half of float32's bytes");
        assert_no_leak(&[&p, &d]);
    }
}

/// A prefill worker and two decode workers: `decode-a`, which least-load's tie-break picks (it
/// joined first) and whose 60 s TTL outlives a test that kills it, and `decode-b`.
fn prefill_and_two_decoders(dir: &Path, url: &str) -> (WorkerProc, WorkerProc, WorkerProc) {
    prefill_and_two_decoders_on(dir, url, &[])
}

/// [`prefill_and_two_decoders`] with `device` flags for every worker (`STAND_IN`: their arenas
/// device arenas, each hand-off device to device but decode-b's, which takes TCP).
fn prefill_and_two_decoders_on(dir: &Path, url: &str, device: &[&str]) -> (WorkerProc, WorkerProc, WorkerProc) {
    let p = worker(dir, "prefill", url, &[&["--name", "prefill-1"][..], device].concat());
    let first = worker(dir, "decode", url, &[&["--name", "decode-a", "--ttl-s", "60"][..], device].concat());
    wait_members(url, 2, Duration::from_secs(10));
    let second = worker(dir, "decode", url, &[&["--name", "decode-b", "--transport", "tcp"][..], device].concat());
    wait_members(url, 3, Duration::from_secs(10));
    (p, first, second)
}

/// Issue reproduction: a decode worker killed with SIGKILL used to attract every request for
/// its registry TTL (least-in-flight picked it, since its requests failed at once). Now its
/// first failure trips the conductor's breaker: that request's decode half goes to the other
/// decode worker, and no later request is routed to the dead one — while membership, which
/// waits for the TTL, still lists it.
#[test]
fn a_dead_decode_worker_is_routed_to_at_most_once() {
    let dir = model("tiny-llama");
    let (_c, url) = conductor(&dir, "embedded");
    let (p, mut dead, live) = prefill_and_two_decoders(&dir, &url);
    let expected = text(&complete(&url, LONG, 8));
    dead.proc.kill();
    let _ = dead.proc.wait_exit(Duration::from_secs(10));
    for _ in 0..12 {
        assert_eq!(text(&complete(&url, LONG, 8)), expected, "a request failed after the kill");
    }
    let metrics = http().get(format!("{url}/metrics")).send().unwrap().text().unwrap();
    assert!(metrics.contains("baton_worker_breaker_trips_total 1"), "{metrics}");
    assert!(metrics.contains("baton_retries_total 1"), "routed to the dead worker more than once: {metrics}");
    assert_eq!(members(&url).len(), 3, "the breaker, not membership, kept it out of routing");
    assert_no_leak(&[&p, &live]);
}

/// A decode worker killed while requests queue in the conductor for decode room (#63): each
/// decode worker has room for one request at a time, so most of a burst waits in the admission
/// queue when one of the two is killed. The request it held goes on elsewhere (migrated), the
/// queue drains onto the survivor, every answer that got a 200 is `baton generate`'s text, a
/// refusal is a 429 before any body, nothing hangs, the queue ends empty and the survivors hold
/// nothing.
#[test]
fn a_decode_worker_killed_while_requests_queue_leaves_each_served_or_refused_up_front() {
    const REQUESTS: usize = 10;
    const TOKENS: usize = 160;
    let dir = model("tiny-llama");
    let (_c, url) = conductor(&dir, "embedded");
    let p = worker(&dir, "prefill", &url, &["--name", "prefill-1"]);
    // 24 blocks of 16 tokens: one request (prompt and answer) at a time.
    let small = ["--num-blocks", "24"];
    let mut dying = worker(&dir, "decode", &url, &[&["--name", "decode-a", "--ttl-s", "60"][..], &small].concat());
    let survivor = worker(&dir, "decode", &url, &[&["--name", "decode-b"][..], &small].concat());
    wait_members(&url, 3, Duration::from_secs(10));
    let expected = generate_with(&dir, LONG, TOKENS, &["--ignore-eos"]);
    let answers: Vec<(u16, Value)> = std::thread::scope(|s| {
        let sent: Vec<_> = (0..REQUESTS)
            .map(|_| {
                s.spawn(|| {
                    let body = json!({"model": "tiny", "prompt": LONG, "max_tokens": TOKENS, "temperature": 0,
                        "ignore_eos": true});
                    let r = http().post(format!("{url}/v1/completions")).json(&body).send().unwrap();
                    (r.status().as_u16(), r.json::<Value>().unwrap_or(Value::Null))
                })
            })
            .collect();
        // Once the burst queues behind the two running requests.
        let deadline = Instant::now() + Duration::from_secs(10);
        while metric(&url, "baton_queue_length{role=\"conductor\",state=\"admission\",worker=\"conductor\"}") < 2.0 {
            assert!(Instant::now() < deadline, "the burst never queued for decode room");
            std::thread::sleep(Duration::from_millis(20));
        }
        dying.proc.kill();
        sent.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let served = answers.iter().filter(|(status, _)| *status == 200).count();
    for (status, v) in &answers {
        match status {
            200 => assert_eq!(text(v), expected, "a served answer differs from baton generate's"),
            429 => assert_eq!(v["error"]["type"], "rate_limit_error", "a refusal's body: {v}"),
            other => panic!("neither served nor refused up front: {other} {v}"),
        }
    }
    eprintln!("{served} of {REQUESTS} served after the kill, {} refused", REQUESTS - served);
    assert!(served >= REQUESTS / 2, "the survivor served too few of the queued requests: {served}");
    let queued = metric(&url, "baton_queue_length{role=\"conductor\",state=\"admission\",worker=\"conductor\"}");
    assert_eq!(queued, 0.0, "requests left in the admission queue");
    assert_no_leak(&[&p, &survivor]);
}

/// Each worker's role as a conductor's `/health` lists it.
fn roles(conductor: &str) -> Vec<(String, String)> {
    let body: Value = http().get(format!("{conductor}/health")).send().unwrap().json().unwrap_or(Value::Null);
    let mut roles: Vec<(String, String)> = body["workers"].as_array().map_or_else(Vec::new, |a| {
        a.iter().map(|w| (w["name"].as_str().unwrap().to_owned(), w["role"].as_str().unwrap().to_owned())).collect()
    });
    roles.sort();
    roles
}

/// An elastic conductor that switches at the first imbalance (no hold), at most once a minute,
/// with a TTFT target of 1 ms that every prefill misses (the prefill pool is always over it).
const ELASTIC_AT_ONCE: [&str; 9] = [
    "--elastic",
    "--elastic-hold-s",
    "0",
    "--elastic-max-switches-per-min",
    "1",
    "--slo-ttft-ms",
    "1",
    "--slo-tbt-ms",
    "60000",
];

/// The prompts of [`prefill_heavy_round`] and their texts by `baton generate`.
fn elastic_prompts(dir: &Path) -> ([String; 2], Vec<String>) {
    let prompts = [LONG.to_owned(), format!("Another story. {LONG}")];
    let expected = prompts.iter().map(|p| generate(dir, p, 8)).collect();
    (prompts, expected)
}

/// Four requests at once, the two prompts in turn, each answer checked against `expected`.
fn prefill_heavy_round(url: &str, prompts: &[String; 2], expected: &[String], round: usize) {
    let answers: Vec<String> = std::thread::scope(|s| {
        let calls: Vec<_> = (0..4).map(|i| s.spawn(move || text(&complete(url, &prompts[i % 2], 8)))).collect();
        calls.into_iter().map(|c| c.join().expect("request thread")).collect()
    });
    for (i, answer) in answers.iter().enumerate() {
        assert_eq!(answer, &expected[i % 2], "round {round}, request {i}");
    }
}

/// Elastic prefill/decode across processes (issue #18): under prefill load (a 1 ms TTFT target
/// the 70B cost profile never meets, a 60 s TBT target always met) the conductor switches one
/// decode worker process to prefill through its control API, mid-traffic. Every request keeps
/// `baton generate`'s text; a second conductor replica that switched nothing learns the new
/// role from the worker's state stream; no worker holds KV afterwards.
#[test]
fn an_elastic_conductor_switches_a_worker_process_mid_traffic() {
    let dir = model("tiny-llama");
    let (_c, url) = conductor_with(&dir, "embedded", &ELASTIC_AT_ONCE);
    let (p, a, b) = prefill_and_two_decoders(&dir, &url);
    let (_replica, replica_url) = conductor(&dir, &url);
    wait_members(&replica_url, 3, Duration::from_secs(10));
    let (prompts, expected) = elastic_prompts(&dir);
    for round in 0..3 {
        prefill_heavy_round(&url, &prompts, &expected, round);
    }
    assert_eq!(metric(&url, "baton_role_switches_total{from=\"decode\",to=\"prefill\"}"), 1.0);
    let now = roles(&url);
    assert_eq!(now.iter().filter(|(_, r)| r == "prefill").count(), 2, "{now:?}");
    // The replica switched nothing; the worker's reports told it.
    let deadline = Instant::now() + Duration::from_secs(10);
    while roles(&replica_url) != now {
        assert!(Instant::now() < deadline, "the replica sees {:?}, not {now:?}", roles(&replica_url));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(metric_sum(&replica_url, "baton_role_switches_total"), 0.0);
    // The replica routes prompts to the switched worker too, and the text holds.
    for prompt in &prompts {
        assert_eq!(text(&complete(&replica_url, prompt, 8)), expected[usize::from(prompt != LONG)]);
    }
    assert_no_leak(&[&p, &a, &b]);
}

/// Two workers, one of each role (issue #18's two-worker headline): under prefill load the
/// decode worker cannot be given away, so the conductor makes it colocated. It prefills and
/// decodes from then on, prompts still hand off from the prefill worker to it, every text is
/// `baton generate`'s, and neither worker holds KV afterwards.
#[test]
fn an_elastic_pair_colocates_its_decode_worker_under_prefill_load() {
    let dir = model("tiny-llama");
    let (_c, url) = conductor_with(&dir, "embedded", &ELASTIC_AT_ONCE);
    let p = worker(&dir, "prefill", &url, &["--name", "prefill-1"]);
    let d = worker(&dir, "decode", &url, &["--name", "decode-1"]);
    wait_members(&url, 2, Duration::from_secs(10));
    let (prompts, expected) = elastic_prompts(&dir);
    for round in 0..3 {
        prefill_heavy_round(&url, &prompts, &expected, round);
    }
    assert_eq!(metric(&url, "baton_role_switches_total{from=\"decode\",to=\"colocated\"}"), 1.0);
    assert_eq!(metric_sum(&url, "baton_role_switches_total"), 1.0, "one switch, to the middle state");
    assert_eq!(
        roles(&url),
        [("decode-1".to_owned(), "colocated".to_owned()), ("prefill-1".to_owned(), "prefill".to_owned())]
    );
    assert_no_leak(&[&p, &d]);
}

/// A role switch the worker refuses (`BATON_FAULT_REFUSE_ROLE_SWITCHES`: its control API answers
/// the first one 503) fails: the conductor counts the failure, does not spend its one switch a
/// minute on it, and switches a worker on a later look; every text is the engine's.
#[cfg(feature = "fault-injection")] // Fault injection through the environment.
#[test]
fn a_role_switch_the_worker_refuses_fails_and_the_next_look_switches() {
    let dir = model("tiny-llama");
    let (_c, url) = conductor_with(&dir, "embedded", &ELASTIC_AT_ONCE);
    let p = worker(&dir, "prefill", &url, &["--name", "prefill-1"]);
    let refuse = [(baton_conductor::deploy::REFUSE_ROLE_SWITCHES_ENV, "1")];
    let a = worker_env(&dir, "decode", &url, &["--name", "decode-a"], SECRET, &refuse);
    let b = worker_env(&dir, "decode", &url, &["--name", "decode-b"], SECRET, &refuse);
    wait_members(&url, 3, Duration::from_secs(10));
    let (prompts, expected) = elastic_prompts(&dir);
    let switched = || metric(&url, "baton_role_switches_total{from=\"decode\",to=\"prefill\"}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut round = 0;
    while switched() < 1.0 {
        assert!(Instant::now() < deadline, "no switch after {round} rounds of a prefill-heavy burst");
        prefill_heavy_round(&url, &prompts, &expected, round);
        round += 1;
    }
    let failed = metric(&url, "baton_role_switch_failures_total");
    assert!((1.0..=2.0).contains(&failed), "each decode worker refuses one switch: {failed} failed");
    assert_eq!(switched(), 1.0);
    let now = roles(&url);
    assert_eq!(now.iter().filter(|(_, r)| r == "prefill").count(), 2, "{now:?}");
    assert_no_leak(&[&p, &a, &b]);
}

#[test]
fn serve_and_conductor_offer_both_kv_transfer_modes() {
    for command in ["serve", "conductor"] {
        let out = Command::new(env!("CARGO_BIN_EXE_baton")).args([command, "--help"]).output().unwrap();
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "baton {command} --help");
        for needle in ["--kv-transfer", "pull", "push", "registers them with the prefill worker"] {
            assert!(help.contains(needle), "baton {command} --help lacks `{needle}`:\n{help}");
        }
    }
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["conductor", "--kv-transfer", "teleport", "--cluster-secret", "x"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("teleport"));
}

/// `--admission-tbt-headroom` is a fraction of the TBT SLO: `baton serve`, `baton conductor`
/// and `baton sim` take it, and refuse one outside 0..=0.9 with a message that says so.
#[test]
fn the_admission_headroom_is_a_fraction_every_command_checks() {
    for command in ["serve", "conductor", "sim"] {
        let out = Command::new(env!("CARGO_BIN_EXE_baton")).args([command, "--help"]).output().unwrap();
        assert!(String::from_utf8_lossy(&out.stdout).contains("--admission-tbt-headroom"), "baton {command}");
        for bad in ["1.5", "-0.1", "much"] {
            let out = Command::new(env!("CARGO_BIN_EXE_baton"))
                .args([command, &format!("--admission-tbt-headroom={bad}")])
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "baton {command} took headroom {bad}");
            assert!(err.contains("--admission-tbt-headroom"), "baton {command}, {bad}: {err}");
        }
    }
}

/// The text of a 200-token greedy stream of `LONG`, and the body of the same stream during which
/// `kill` ran after 4 chunks.
fn undisturbed_and_killed(url: &str, kill: impl FnOnce()) -> (String, String) {
    let undisturbed = streamed_text(&stream_with_hook(url, 200, 1, || {}));
    let body = stream_with_hook(url, 200, 4, kill);
    (undisturbed, body)
}

fn migrations(url: &str) -> String {
    let metrics = http().get(format!("{url}/metrics")).send().unwrap().text().unwrap();
    metrics.lines().find(|l| l.starts_with("baton_migrations_total")).unwrap_or("none").to_owned()
}

/// Mid-stream migration: a colocated worker killed with SIGKILL while it streams a request; the
/// conductor hands the prompt and the tokens streamed so far to the other worker, which
/// recomputes their KV and continues: the client's stream completes with the undisturbed text
/// (no gap, no duplicate).
#[test]
fn a_colocated_worker_killed_mid_stream_hands_the_stream_on() {
    let dir = model("tiny-llama");
    let (_c, url) = conductor(&dir, "embedded");
    // Joined first, so least-load's tie-break sends the streams to it.
    let mut first = worker(&dir, "colocated", &url, &["--name", "a-first", "--ttl-s", "60"]);
    wait_members(&url, 1, Duration::from_secs(10));
    let second = worker(&dir, "colocated", &url, &["--name", "b-second"]);
    wait_members(&url, 2, Duration::from_secs(10));
    let (undisturbed, body) = undisturbed_and_killed(&url, || first.proc.kill());
    assert!(body.contains("[DONE]"), "the stream did not complete: ...{}", &body[body.len().saturating_sub(400)..]);
    assert_eq!(streamed_text(&body), undisturbed);
    assert_eq!(migrations(&url), "baton_migrations_total 1");
    assert_no_leak(&[&second]);
}

/// The same for a decode worker killed mid-stream: the decode goes on on the other decode
/// worker, from the prompt and every token streamed (the prefill's first and the dead worker's),
/// on the CPU and on the stand-in device.
#[test]
fn a_decode_worker_killed_mid_stream_hands_the_stream_on() {
    // On the CPU, and on the stand-in device (issue #58: its hand-offs device to device).
    for device in [&[][..], STAND_IN] {
        let dir = model("tiny-llama");
        let (_c, url) = conductor(&dir, "embedded");
        let (p, mut dead, live) = prefill_and_two_decoders_on(&dir, &url, device);
        let (undisturbed, body) = undisturbed_and_killed(&url, || dead.proc.kill());
        let tail = &body[body.len().saturating_sub(400)..];
        assert!(body.contains("[DONE]"), "{device:?}: the stream did not complete: ...{tail}");
        assert_eq!(streamed_text(&body), undisturbed, "{device:?}");
        assert_eq!(migrations(&url), "baton_migrations_total 1", "{device:?}");
        assert_no_leak(&[&p, &live]);
    }
}

/// SIGTERM mid-stream, to a colocated worker and to a decode worker: the worker leaves
/// membership at once (its TTL is a minute, so only its goodbye can do that), finishes the
/// stream it holds — nothing migrated, nothing failed — and exits 0; requests sent meanwhile
/// run elsewhere.
#[test]
fn a_worker_sent_sigterm_mid_stream_drains_leaves_and_exits_0() {
    let dir = model("tiny-llama");
    for kind in ["colocated", "decode"] {
        let (_c, url) = conductor(&dir, "embedded");
        let slow = ["--ttl-s", "60"];
        // Joined first, so least-load's tie-break sends the stream to it.
        let (mut draining, others) = if kind == "colocated" {
            let first = worker(&dir, "colocated", &url, &[&["--name", "a-first"][..], &slow].concat());
            wait_members(&url, 1, Duration::from_secs(10));
            let second = worker(&dir, "colocated", &url, &slow);
            wait_members(&url, 2, Duration::from_secs(10));
            (first, vec![second])
        } else {
            let p = worker(&dir, "prefill", &url, &slow);
            let first = worker(&dir, "decode", &url, &[&["--name", "a-first"][..], &slow].concat());
            wait_members(&url, 2, Duration::from_secs(10));
            let second = worker(&dir, "decode", &url, &slow);
            wait_members(&url, 3, Duration::from_secs(10));
            (first, vec![p, second])
        };
        let undisturbed = streamed_text(&stream_with_hook(&url, 200, 1, || {}));
        let expected = text(&complete(&url, LONG, 8));
        let mut meanwhile = None;
        let body = stream_with_hook(&url, 200, 4, || {
            draining.proc.terminate();
            let url = url.clone();
            meanwhile =
                Some(std::thread::spawn(move || (0..4).map(|_| text(&complete(&url, LONG, 8))).collect::<Vec<_>>()));
        });
        assert!(
            body.contains("[DONE]"),
            "{kind}: the stream did not complete: ...{}",
            &body[body.len().saturating_sub(400)..]
        );
        assert_eq!(streamed_text(&body), undisturbed, "{kind}");
        for t in meanwhile.unwrap().join().unwrap() {
            assert_eq!(t, expected, "{kind}: a request sent during the drain");
        }
        let members = wait_members(&url, others.len(), Duration::from_secs(5));
        assert!(!members.contains(&"a-first".to_owned()), "{kind}: {members:?}");
        let status = draining.proc.wait_exit(Duration::from_secs(20));
        assert!(status.success(), "{kind}: a drained worker exits 0, not {status:?}");
        assert_eq!(migrations(&url), "baton_migrations_total 0", "{kind}: drained, not migrated");
        assert_no_leak(&others.iter().collect::<Vec<_>>());
    }
}

/// An engine thread that panics mid-stream (fault injection): the worker leaves membership at
/// once and exits non-zero, the conductor hands the stream to the other worker (same text) and
/// routes nothing more to the dead one.
#[cfg(feature = "fault-injection")] // Fault injection through the environment.
#[test]
fn an_engine_thread_panic_takes_the_worker_out_and_it_exits_non_zero() {
    let dir = model("tiny-llama");
    let (_c, url) = conductor(&dir, "embedded");
    let env = [("BATON_FAULT_PANIC_AT_STEP", "20")];
    let args = ["--name", "a-first", "--ttl-s", "60"];
    let mut dying = worker_env(&dir, "colocated", &url, &args, SECRET, &env);
    wait_members(&url, 1, Duration::from_secs(10));
    let second = worker(&dir, "colocated", &url, &["--ttl-s", "60"]);
    wait_members(&url, 2, Duration::from_secs(10));
    let expected = generate_with(&dir, LONG, 48, &["--ignore-eos"]);
    // Least-load's tie-break sends it to the first worker, whose engine dies at step 20.
    let body = stream_with_hook(&url, 48, 1, || {});
    assert!(body.contains("[DONE]"), "the stream did not complete: ...{}", &body[body.len().saturating_sub(400)..]);
    assert_eq!(streamed_text(&body), expected);
    let status = dying.proc.wait_exit(Duration::from_secs(20));
    assert!(!status.success(), "a worker whose engine died must exit non-zero");
    let members = wait_members(&url, 1, Duration::from_secs(5));
    assert!(!members.contains(&"a-first".to_owned()), "{members:?}");
    for _ in 0..4 {
        assert_eq!(text(&complete(&url, LONG, 8)), generate(&dir, LONG, 8));
    }
    assert_eq!(migrations(&url), "baton_migrations_total 1");
    assert_no_leak(&[&second]);
}

/// The conductor's index of one worker: its confirmed blocks (chained hashes), as
/// `GET /debug/kv-index` shows them, or `None` before the worker's first update.
fn indexed(url: &str, worker: &str) -> Option<Vec<u64>> {
    let v: Value = http().get(format!("{url}/debug/kv-index")).send().unwrap().json().unwrap();
    let w = &v["workers"][worker];
    if w["report"].is_null() {
        return None;
    }
    let mut blocks: Vec<u64> = w["blocks"].as_array()?.iter().map(|b| b[0].as_u64().unwrap()).collect();
    blocks.sort_unstable();
    Some(blocks)
}

/// The blocks a worker's pool holds: the first update of its own state stream (a snapshot),
/// read through its control API.
fn pool_blocks(worker_url: &str) -> Vec<u64> {
    use std::io::Read;
    let secret = ClusterSecret::new(SECRET).unwrap();
    let proof = secret.sign_request("GET", "/worker/v1/state", unix_millis(), b"");
    let mut r = http().get(format!("{worker_url}/worker/v1/state")).header(AUTH_HEADER, proof).send().unwrap();
    assert!(r.status().is_success(), "state of {worker_url}: {}", r.status());
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while r.read(&mut byte).unwrap() == 1 && byte[0] != b'\n' {
        line.push(byte[0]);
    }
    let v: Value = serde_json::from_slice(&line).unwrap();
    assert_eq!(v["update"], "snapshot", "{v}");
    let mut blocks: Vec<u64> = v["blocks"].as_array().unwrap().iter().map(|b| b["hash"].as_u64().unwrap()).collect();
    blocks.sort_unstable();
    blocks
}

/// The same as [`pool_blocks`], from the state stream in its binary encoding (as the
/// conductor asks for it).
fn pool_blocks_binary(worker_url: &str) -> Vec<u64> {
    use baton_protocol::state_codec::{STATE_MEDIA_TYPE, StateFormat, StateReader};
    use baton_protocol::wire::StateUpdate;
    use std::io::Read;
    let proof = ClusterSecret::new(SECRET).unwrap().sign_request("GET", "/worker/v1/state", unix_millis(), b"");
    let mut r = http()
        .get(format!("{worker_url}/worker/v1/state"))
        .header(AUTH_HEADER, proof)
        .header("accept", STATE_MEDIA_TYPE)
        .send()
        .unwrap();
    assert!(r.status().is_success(), "state of {worker_url}: {}", r.status());
    assert_eq!(r.headers()["content-type"], STATE_MEDIA_TYPE);
    let mut reader = StateReader::new(StateFormat::Binary);
    let mut chunk = [0u8; 4096];
    let update = loop {
        if let Some(u) = reader.next_update().unwrap() {
            break u;
        }
        let n = r.read(&mut chunk).unwrap();
        assert!(n > 0, "the state stream ended before its snapshot");
        reader.extend(&chunk[..n]);
    };
    let StateUpdate::Snapshot { blocks, .. } = update else { panic!("the stream starts {update:?}") };
    let mut blocks: Vec<u64> = blocks.iter().map(|b| b.hash).collect();
    blocks.sort_unstable();
    blocks
}

/// Polls until `check` holds of the worker's index entry, or panics after `limit`; returns how
/// long it took.
fn wait_index(url: &str, worker: &str, limit: Duration, check: impl Fn(&[u64]) -> bool) -> Duration {
    let start = Instant::now();
    loop {
        if indexed(url, worker).is_some_and(|b| check(&b)) {
            return start.elapsed();
        }
        assert!(start.elapsed() < limit, "the index of {worker} is {:?} after {limit:?}", indexed(url, worker));
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn metric(url: &str, prefix: &str) -> f64 {
    let metrics = http().get(format!("{url}/metrics")).send().unwrap().text().unwrap();
    metrics.lines().find_map(|l| l.strip_prefix(prefix)).and_then(|v| v.trim().parse().ok()).unwrap_or(0.0)
}

/// The sum of a metric over all its labels (`name` without the braces).
fn metric_sum(url: &str, name: &str) -> f64 {
    sum_of_lines(url, &format!("{name}{{"))
}

/// The sum of the values of the metric lines that start with `prefix`.
fn sum_of_lines(url: &str, prefix: &str) -> f64 {
    let metrics = http().get(format!("{url}/metrics")).send().unwrap().text().unwrap();
    metrics
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}

/// The exact index: a prompt cached on a prefill worker is in the conductor's index as soon as
/// its events arrive (the time is printed), equal to the worker's pool; the next request that
/// shares the prompt goes to that worker under `kv-centric` and reports a cache hit; a worker
/// killed and restarted under the same name and port shows none of its old blocks.
#[test]
fn the_conductor_indexes_what_workers_cache_and_forgets_a_restarted_worker() {
    let dir = model("tiny-llama");
    let (_c, url) = conductor_with(&dir, "embedded", &["--policy", "kv-centric"]);
    let mut p1 = worker(&dir, "prefill", &url, &["--name", "p1", "--port", "0"]);
    let p1_port = p1.url.rsplit(':').next().unwrap().to_owned();
    let p2 = worker(&dir, "prefill", &url, &["--name", "p2"]);
    let d = worker(&dir, "decode", &url, &["--name", "d"]);
    wait_members(&url, 3, Duration::from_secs(10));
    let first = complete(&url, LONG, 4);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{first}");
    let holder = ["p1", "p2"].into_iter().find(|w| indexed(&url, w).is_some_and(|b| !b.is_empty()));
    let holder = match holder {
        Some(h) => h,
        None => {
            let took = wait_index(&url, "p1", Duration::from_secs(5), |b| !b.is_empty());
            eprintln!("the prompt's blocks reached the conductor's index {took:?} after the answer");
            "p1"
        }
    };
    let holder_url = if holder == "p1" { &p1.url } else { &p2.url };
    wait_index(&url, holder, Duration::from_secs(5), |b| b == pool_blocks(holder_url));
    // The conductor read that stream binary; asked for it, the worker answers the same blocks so.
    assert_eq!(pool_blocks_binary(holder_url), pool_blocks(holder_url));
    // The next request sharing the prompt goes where its KV is, and is served from it.
    let second = complete(&url, &format!("{LONG} and then the rain"), 4);
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached >= 16, "no cache hit: {second}");
    let hits = metric(&url, &format!("baton_prefix_cache_hits_tokens_total{{worker=\"{holder}\"}}"));
    assert!(hits >= cached as f64, "hits on {holder}: {hits}");
    assert_no_leak(&[&p2, &d]);

    // Killed and restarted on the same name and port: none of its old blocks stay indexed.
    if holder == "p1" {
        complete(&url, LONG, 4);
    }
    let _ = complete(&url, "A different prompt entirely, long enough to fill a block of sixteen tokens.", 4);
    wait_index(&url, "p1", Duration::from_secs(5), |b| !b.is_empty());
    p1.proc.kill();
    // Its membership lease lapses (the registry refuses the name until then).
    wait_members(&url, 2, Duration::from_secs(10));
    assert_eq!(indexed(&url, "p1"), None, "a worker that left keeps no blocks in the index");
    let p1 = worker(&dir, "prefill", &url, &["--name", "p1", "--port", &p1_port]);
    wait_index(&url, "p1", Duration::from_secs(10), <[u64]>::is_empty);
    assert!(pool_blocks(&p1.url).is_empty());
}

/// A lost KV event (injected) is seen as a gap: the conductor resynchronises from a snapshot and
/// its index ends equal to the worker's pool; eviction on a small pool removes blocks from the
/// index too.
#[cfg(feature = "fault-injection")] // Fault injection through the environment.
#[test]
fn a_gap_in_kv_events_resyncs_and_eviction_reaches_the_index() {
    let dir = model("tiny-llama");
    let (_c, url) = conductor(&dir, "embedded");
    let env = [("BATON_FAULT_DROP_EVENT_SEQ", "3")];
    // 24 blocks of 16 tokens: a few prompts fill it and later ones evict earlier ones.
    let w = worker_env(&dir, "colocated", &url, &["--name", "w", "--num-blocks", "24"], SECRET, &env);
    wait_members(&url, 1, Duration::from_secs(10));
    for i in 0..3 {
        let _ = complete(&url, &format!("Prompt number {i}: {LONG}"), 2);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while metric(&url, "baton_kv_index_resyncs_total{worker=\"w\"}") < 1.0 {
        assert!(Instant::now() < deadline, "the gap was not noticed");
        std::thread::sleep(Duration::from_millis(20));
    }
    wait_index(&url, "w", Duration::from_secs(5), |b| b == pool_blocks(&w.url));
    // More prompts than the pool holds: events (stored and removed) flow as deltas again.
    for i in 3..15 {
        let _ = complete(&url, &format!("Prompt number {i}: {LONG}"), 2);
    }
    wait_index(&url, "w", Duration::from_secs(5), |b| b == pool_blocks(&w.url));
    let held = indexed(&url, "w").unwrap();
    assert!(!held.is_empty() && held.len() <= 24, "{} blocks indexed", held.len());
    let events = metric(&url, "baton_kv_events_total{worker=\"w\"}");
    // 12 prompts of 3 or more blocks each went through a 24-block pool: blocks were evicted,
    // their removals applied.
    assert!(events >= 36.0 + 12.0, "{events} events for {} blocks", held.len());
    assert_eq!(metric(&url, "baton_kv_index_resyncs_total{worker=\"w\"}"), 1.0);
    assert_no_leak(&[&w]);
}

/// A self-signed certificate for 127.0.0.1 and localhost, written as `cert.pem` and `key.pem`
/// into a new directory named after `prefix`; returns the directory and the certificate.
fn self_signed(prefix: &str) -> (PathBuf, rcgen::CertifiedKey) {
    let tmp = std::env::temp_dir().join(format!("{prefix}-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let made = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned(), "localhost".to_owned()]).unwrap();
    std::fs::write(tmp.join("cert.pem"), made.cert.pem()).unwrap();
    std::fs::write(tmp.join("key.pem"), made.key_pair.serialize_pem()).unwrap();
    (tmp, made)
}

/// TLS on the API and the control API: a conductor started with `--tls-cert/--tls-key` (a
/// self-signed certificate made here) serves HTTPS; a worker that trusts it (`--tls-ca`)
/// registers over `https://` and serves its own control API over HTTPS, which the conductor
/// trusts with its `--tls-ca`; a client that trusts the conductor gets the same answer as
/// `baton generate`, and neither a client without the certificate nor plain HTTP gets one.
#[test]
fn a_conductor_serving_tls_takes_workers_and_clients_that_trust_its_certificate() {
    let dir = model("tiny-llama");
    let (tmp, made) = self_signed("baton-tls");
    let (cert, key) = (tmp.join("cert.pem"), tmp.join("key.pem"));
    let (cert_s, key_s) = (cert.to_str().unwrap(), key.to_str().unwrap());

    let tls = ["--tls-cert", cert_s, "--tls-key", key_s, "--tls-ca", cert_s];
    let (_c, url) = conductor_with(&dir, "embedded", &tls);
    assert!(url.starts_with("https://"), "{url}");
    // The worker's control API is HTTPS too: the conductor reaches it only by trusting it.
    let w = worker(&dir, "colocated", &url, &tls);
    assert!(w.url.starts_with("https://"), "{}", w.url);
    let trusting = reqwest::blocking::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(made.cert.pem().as_bytes()).unwrap())
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let health: Value = trusting.get(format!("{url}/health")).send().unwrap().json().unwrap_or(Value::Null);
        if health["workers"].as_array().is_some_and(|w| w.len() == 1) {
            break;
        }
        assert!(Instant::now() < deadline, "the worker did not join over https: {health}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let body = json!({"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0});
    let v: Value = trusting.post(format!("{url}/v1/completions")).json(&body).send().unwrap().json().unwrap();
    assert_eq!(text(&v), generate(&dir, "Hello", 8));

    assert!(http().get(format!("{url}/health")).send().is_err(), "a client without the certificate got an answer");
    let plain = url.replace("https://", "http://");
    assert!(http().get(format!("{plain}/health")).send().is_err(), "plain HTTP got an answer from the TLS port");
    let _ = std::fs::remove_dir_all(&tmp);
}

/// TLS on the KV plane (#19): prefill and decode workers started with `--tls-cert/--tls-key`
/// (one self-signed certificate they share, trusted with `--tls-ca`) hand KV over TCP inside
/// TLS: the answer equals `baton generate`'s, KV bytes moved, and the prefill worker's KV port
/// answers a peer that follows its member ticket with plaintext with a TLS alert. (The crate's `tests/tls.rs` shows that no KV byte
/// crosses the wire in clear.) The conductor speaks plain HTTP and trusts the workers' control
/// APIs with `--tls-ca`.
#[test]
fn workers_with_certificates_hand_kv_over_tls() {
    use std::io::{Read, Write};
    let dir = model("tiny-llama");
    let (tmp, _) = self_signed("baton-kv-tls");
    let (cert, key) = (tmp.join("cert.pem"), tmp.join("key.pem"));
    let (cert_s, key_s) = (cert.to_str().unwrap(), key.to_str().unwrap());

    let (_c, url) = conductor_with(&dir, "embedded", &["--tls-ca", cert_s]);
    let tls = ["--tls-cert", cert_s, "--tls-key", key_s, "--tls-ca", cert_s];
    let p = worker(&dir, "prefill", &url, &tls);
    let mut decode_args = tls.to_vec();
    decode_args.extend_from_slice(&["--transport", "tcp"]);
    let _d = worker(&dir, "decode", &url, &decode_args);
    wait_members(&url, 2, Duration::from_secs(10));
    let v = complete(&url, LONG, 8);
    assert_eq!(text(&v), generate(&dir, LONG, 8));
    assert!(metric(&url, "baton_kv_transfer_bytes_total") > 0.0, "no KV was handed over");

    let mut plain = std::net::TcpStream::connect(&p.kv).unwrap();
    plain.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    // A member's ticket first (sent in clear, before TLS), then plaintext where TLS should be.
    let unix_ms = unix_millis();
    plain.write_all(&baton_transfer::auth::ticket(SECRET.as_bytes(), unix_ms, &baton_transfer::auth::nonce())).unwrap();
    plain.write_all(&[0u8; 64]).unwrap();
    let mut first = [0u8; 1];
    plain.read_exact(&mut first).unwrap();
    assert_eq!(first[0], 0x15, "the KV port does not answer as a TLS server (0x15: an alert record)");
    let _ = std::fs::remove_dir_all(&tmp);
}

/// With prefill workers p1 and p2 and a decode worker members of the conductor at `url`: caches
/// [`LONG`] on one of them (waiting until the index shows it), and returns six prompts that
/// continue it, with `baton generate`'s text for each.
fn hot_prefix(dir: &Path, url: &str) -> (Vec<String>, Vec<String>) {
    wait_members(url, 3, Duration::from_secs(10));
    complete(url, LONG, 4);
    let cached_on = |w: &str| indexed(url, w).is_some_and(|b| !b.is_empty());
    let deadline = Instant::now() + Duration::from_secs(5);
    while !cached_on("p1") && !cached_on("p2") {
        assert!(Instant::now() < deadline, "the prompt's blocks never reached the index");
        std::thread::sleep(Duration::from_millis(10));
    }
    let prompts: Vec<String> = (0..6).map(|i| format!("{LONG} and then, in turn {i}, the story goes on")).collect();
    let want = prompts.iter().map(|p| generate(dir, p, 8)).collect();
    (prompts, want)
}

/// One KV pool across processes (#16): under kv-centric with fetching on (the default),
/// requests sharing a cached prefix that arrive together do not all queue on the worker caching
/// it: the other prefill worker takes some, fetching the prefix from the first one's pool over
/// the KV protocol and computing only the rest. Every output equals `baton generate`'s, no fetch
/// is recomputed, and no worker holds KV afterwards. (Requests sent to a worker while it still
/// computes the prefix do not share it: a sequence's blocks enter the cache when it finishes.)
#[test]
fn requests_sharing_a_hot_prefix_fetch_it_into_an_idle_prefill_worker() {
    let dir = model("tiny-llama");
    let (_c, url) = conductor_with(&dir, "embedded", &["--policy", "kv-centric"]);
    let p1 = worker(&dir, "prefill", &url, &["--name", "p1"]);
    let p2 = worker(&dir, "prefill", &url, &["--name", "p2"]);
    let d = worker(&dir, "decode", &url, &["--name", "d"]);
    let (prompts, want) = hot_prefix(&dir, &url);
    let cached_on = |w: &str| indexed(&url, w).is_some_and(|b| !b.is_empty());
    let got: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts.iter().map(|p| s.spawn(|| complete(&url, p, 8))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (v, want) in got.iter().zip(&want) {
        assert_eq!(&text(v), want, "a fetched prefix changes no output");
    }
    let fetched = metric(&url, "baton_kv_fetches_total{outcome=\"fetched\"}");
    eprintln!("{fetched} of 6 requests fetched the prefix from the other prefill worker");
    assert!(fetched >= 1.0, "no request was moved off the worker holding the prefix");
    assert_eq!(metric(&url, "baton_kv_fetches_total{outcome=\"recomputed\"}"), 0.0);
    assert!(metric(&url, "baton_kv_fetch_bytes_total") > 0.0);
    assert!(cached_on("p1") && cached_on("p2"), "the fetched prefix is cached on both workers now");
    assert_no_leak(&[&p1, &p2, &d]);
}

/// A prefill worker killed mid-fetch (kill -9 while another worker's pull of its cached prefix
/// is open: the fetcher pauses there, by fault injection) costs no request: the fetcher
/// recomputes the prefix, the killed worker's own requests run again elsewhere, every output
/// equals `baton generate`'s, and the survivors hold no KV. Over shared memory, and between
/// stand-in device arenas (the device link as a CUDA VMM arena makes it: the pull copies from
/// the dead exporter's memory, still the link's, and fails at the answers it never gets; a
/// legacy CUDA IPC link refuses to read instead, which `transport.rs` tests).
#[cfg(feature = "fault-injection")] // Fault injection through the environment.
#[test]
fn a_prefill_worker_killed_mid_fetch_leaves_every_request_complete() {
    killed_mid_fetch(&[]);
    killed_mid_fetch(STAND_IN);
}

#[cfg(feature = "fault-injection")]
fn killed_mid_fetch(device: &[&str]) {
    let dir = model("tiny-llama");
    let (_c, url) = conductor_with(&dir, "embedded", &["--policy", "kv-centric"]);
    let pause = [(baton_conductor::deploy::FETCH_DELAY_ENV, "2000")];
    let mut p1 = worker_env(&dir, "prefill", &url, &[&["--name", "p1"], device].concat(), SECRET, &pause);
    let mut p2 = worker_env(&dir, "prefill", &url, &[&["--name", "p2"], device].concat(), SECRET, &pause);
    let d = worker(&dir, "decode", &url, &[&["--name", "d"], device].concat());
    let (prompts, want) = hot_prefix(&dir, &url);
    let holder_is_p1 = indexed(&url, "p1").is_some_and(|b| !b.is_empty());
    let got: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts.iter().map(|p| s.spawn(|| complete(&url, p, 8))).collect();
        // The fetch is planned as the requests arrive; its pull then pauses for 2 s.
        std::thread::sleep(Duration::from_millis(700));
        if holder_is_p1 {
            p1.proc.kill()
        } else {
            p2.proc.kill()
        }
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (v, want) in got.iter().zip(&want) {
        assert_eq!(&text(v), want);
    }
    let recomputed = metric(&url, "baton_kv_fetches_total{outcome=\"recomputed\"}");
    eprintln!("{recomputed} fetch(es) recomputed after the holder died");
    assert!(recomputed >= 1.0, "a fetch was under way when the holder died");
    assert_eq!(metric(&url, "baton_kv_fetches_total{outcome=\"fetched\"}"), 0.0);
    if !device.is_empty() {
        let device = metric(&url, "baton_kv_transfers_total{transport=\"device\"}");
        assert!(device >= 1.0, "the stand-in arenas did not hand KV over device to device");
    }
    let survivor = if holder_is_p1 { &p2 } else { &p1 };
    assert_no_leak(&[survivor, &d]);
}

/// MemServe's modes across processes (#16), both fixture models: a two-turn session through a
/// `baton conductor --pd-caching N` and prefill and decode worker processes. Every text equals
/// `baton generate`'s; turn 2 computes the whole prompt in PD-Basic (0), only what the prefill
/// worker lacks from 1 on (3 fewer still: turn 1's answer came back into its cache); from 2 on
/// its hand-off moves only the blocks the decode worker lacks; no worker holds KV afterwards.
#[test]
fn pd_caching_modes_across_processes_keep_the_text_and_cut_what_is_computed_and_moved() {
    for name in ["tiny-llama", "tiny-qwen2"] {
        let dir = model(name);
        let want_1 = generate(&dir, LONG, 8);
        let turn_2 = format!("{LONG}{want_1} And then the story goes on.");
        let want_2 = generate(&dir, &turn_2, 8);
        let mut seen = Vec::new();
        for mode in ["0", "1", "2", "3"] {
            // Blocks of 4 tokens, so that turn 1's 8-token answer fills whole blocks.
            let (_c, url) = conductor_with(&dir, "embedded", &["--pd-caching", mode, "--block-size", "4"]);
            let p = worker(&dir, "prefill", &url, &["--name", "p", "--block-size", "4"]);
            let d = worker(&dir, "decode", &url, &["--name", "d", "--block-size", "4"]);
            wait_members(&url, 2, Duration::from_secs(10));
            assert_eq!(text(&complete(&url, LONG, 8)), want_1, "{name}, mode {mode}, turn 1");
            // Wait for what this mode keeps: the decode worker's copy (2, 3), the answer's
            // return to the prefill worker (3).
            let deadline = Instant::now() + Duration::from_secs(10);
            while (mode >= "2" && indexed(&url, "d").is_none_or(|b| b.is_empty()))
                || (mode == "3" && metric(&url, "baton_kv_return_tokens_total") == 0.0)
            {
                assert!(Instant::now() < deadline, "{name}, mode {mode}: turn 1 was not kept");
                std::thread::sleep(Duration::from_millis(10));
            }
            let computed = metric(&url, "baton_prefill_tokens_total");
            let moved = metric(&url, "baton_kv_transfer_tokens_total");
            let answer = complete(&url, &turn_2, 8);
            assert_eq!(text(&answer), want_2, "{name}, mode {mode}, turn 2");
            let prompt = answer["usage"]["prompt_tokens"].as_f64().unwrap();
            let computed = metric(&url, "baton_prefill_tokens_total") - computed;
            let moved = metric(&url, "baton_kv_transfer_tokens_total") - moved;
            seen.push((computed, moved));
            assert_no_leak(&[&p, &d]);
            if mode == "0" {
                assert_eq!((computed, moved), (prompt, prompt), "{name}: PD-Basic computes and moves it all");
            }
        }
        eprintln!("{name}: turn 2's (computed, moved) tokens in modes 0..=3: {seen:?}");
        let [(c0, m0), (c1, m1), (c2, m2), (c3, m3)] = seen[..] else { unreachable!() };
        assert!(c1 < c0 && m1 == m0, "{name}: mode 1 computes less, moves it all: {seen:?}");
        assert!(c2 == c1 && m2 < m1, "{name}: mode 2 moves only what the decode worker lacks: {seen:?}");
        assert!(c3 < c2 && m3 <= m2, "{name}: mode 3 computes only what follows the history: {seen:?}");
    }
}

/// A headless Chromium on a page, driven by `scripts/lib/headless.py` (the DevTools protocol
/// over a pipe): each [`Browser::eval`] is one JavaScript expression's value.
struct Browser {
    child: Child,
    stdin: std::process::ChildStdin,
    answers: mpsc::Receiver<String>,
}

impl Browser {
    /// Opens `url`, or None where there is no chromium outside CI (in CI its absence fails:
    /// `scripts/install-deps.sh` installs it).
    fn open(url: &str) -> Option<Browser> {
        let found = Command::new("sh").args(["-c", "command -v chromium"]).output().is_ok_and(|o| o.status.success());
        if !found {
            assert!(std::env::var_os("CI").is_none(), "no chromium in CI: scripts/install-deps.sh installs it");
            eprintln!("skipped: no chromium on PATH (scripts/install-deps.sh installs it)");
            return None;
        }
        let mut child = Command::new("python3")
            .arg(repo().join("scripts/lib/headless.py"))
            .arg(url)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, answers) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        Some(Browser { child, stdin, answers })
    }

    fn command(&mut self, line: &str) -> Value {
        use std::io::Write;
        writeln!(self.stdin, "{line}").unwrap();
        let answer = self.answers.recv_timeout(Duration::from_secs(30)).expect("the browser answers");
        serde_json::from_str(&answer).unwrap()
    }

    /// The value of `expression` in the page (null while it throws, e.g. before the page loaded).
    fn eval(&mut self, expression: &str) -> Value {
        self.command(&format!("eval {expression}"))["value"].clone()
    }

    /// Waits until `expression` is true in the page.
    fn wait_for(&mut self, expression: &str, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.eval(expression) != Value::Bool(true) {
            let page = self.eval("document.body && document.body.innerText");
            assert!(Instant::now() < deadline, "`{expression}` did not hold within {limit:?}; the page:\n{page}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        use std::io::Write;
        let _ = writeln!(self.stdin, "quit");
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The status page (#61) in a real browser against a conductor and two worker processes: it
/// draws both workers with their roles, and a request sent while it is open moves its counters.
/// The page's data is behind the API key; the page takes the key from its URL's fragment.
/// `BATON_DASHBOARD_SCREENSHOT=PATH` also writes a PNG of it (how `docs/dashboard.png` was made).
#[test]
fn the_status_page_in_a_browser_shows_the_workers_and_moves_with_a_request() {
    const KEY: &str = "dashboard-key";
    let dir = model("tiny-llama");
    let (_c, url) = conductor_with(&dir, "embedded", &["--api-key", KEY]);
    let p = worker(&dir, "prefill", &url, &[]);
    let d = worker(&dir, "decode", &url, &[]);
    wait_members(&url, 2, Duration::from_secs(10));
    // The probes deploy/k8s gives a kubelet, asked as it asks them: no key, no cluster proof.
    for (w, role) in [(&p, "prefill"), (&d, "decode")] {
        let live = http().get(format!("{}{}", w.url, baton_protocol::control::LIVE_PATH)).send().unwrap();
        assert_eq!(live.status(), 200, "{role} worker's liveness probe");
        let ready = http().get(format!("{}{}", w.url, baton_protocol::control::READY_PATH)).send().unwrap();
        assert_eq!(ready.status(), 200, "{role} worker's readiness probe");
        let v: Value = ready.json().unwrap();
        assert_eq!((v["status"].as_str(), v["role"].as_str()), (Some("ready"), Some(role)), "{v}");
    }

    let state = format!("{url}/dashboard/state");
    assert_eq!(http().get(&state).send().unwrap().status(), 401, "the page's data is behind the key");
    let v: Value = http().get(&state).bearer_auth(KEY).send().unwrap().json().unwrap();
    assert_eq!(v["workers"].as_array().map(Vec::len), Some(2), "{v}");
    let page = http().get(format!("{url}/dashboard")).send().unwrap();
    assert!(page.status().is_success() && page.text().unwrap().contains("/state"), "the page polls its state");

    let Some(mut browser) = Browser::open(&format!("{url}/dashboard#key={KEY}")) else { return };
    let rows = "document.querySelectorAll('#workers tr.worker')";
    browser.wait_for(&format!("{rows}.length === 2"), Duration::from_secs(60));
    let seen = browser.eval(&format!("JSON.stringify([...{rows}].map(r => [r.dataset.role, r.dataset.state]))"));
    let mut seen: Vec<(String, String)> = serde_json::from_str(seen.as_str().unwrap()).unwrap();
    seen.sort();
    let expected = [("decode", "ready"), ("prefill", "ready")].map(|(r, s)| (r.to_owned(), s.to_owned()));
    assert_eq!(seen, expected, "the page's worker rows");
    let ok = "Number(document.getElementById('requests-ok').textContent)";
    assert_eq!(browser.eval(ok), json!(0), "no request yet");
    let transfers = "[...document.querySelectorAll('#transfers tbody tr')]\
                     .reduce((n, r) => n + Number(r.children[1].textContent), 0)";
    assert_eq!(browser.eval(transfers), json!(0), "no KV moved yet");

    // A request while the page is open: the page's next polls show it, with no reload.
    let polls = browser.eval("Number(document.body.dataset.polls)").as_f64().unwrap();
    let answer = complete_with_key(&url, Some(KEY), "The dashboard shows", 4);
    assert!(!text(&answer).is_empty(), "{answer}");
    browser.wait_for(&format!("{ok} === 1"), Duration::from_secs(30));
    browser.wait_for(&format!("{transfers} >= 1"), Duration::from_secs(30));
    browser.wait_for("document.getElementById('ttft').textContent.includes('ms')", Duration::from_secs(30));
    let after = browser.eval("Number(document.body.dataset.polls)").as_f64().unwrap();
    assert!(after > polls, "the counters moved by polling ({polls} → {after} polls), not by a reload");
    if let Some(path) = std::env::var_os("BATON_DASHBOARD_SCREENSHOT") {
        let answer = browser.command(&format!("screenshot {} 1280 900", Path::new(&path).display()));
        assert!(answer.get("error").is_none(), "{answer}");
    }
}

/// The Grafana dashboard (`deploy/grafana/baton.json`, #61) queries only what a running
/// conductor exports: every metric each panel names is in the `/metrics` of a conductor with two
/// workers (`--elastic`, so the pools' load is there) after a request, with every label its
/// queries group or filter by. The one exception is a series born of an event a quiet cluster
/// never has (a role switch): it must at least be registered, under that name and those labels,
/// in the conductor's metrics.
#[test]
fn the_grafana_dashboard_queries_only_what_a_running_conductor_exports() {
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(repo().join("deploy/grafana/baton.json")).unwrap()).unwrap();
    let mut queries = Vec::new();
    fn exprs(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("expr" | "definition", Value::String(s)) => out.push(s.clone()),
                        _ => exprs(v, out),
                    }
                }
            }
            Value::Array(a) => a.iter().for_each(|v| exprs(v, out)),
            _ => {}
        }
    }
    exprs(&dashboard, &mut queries);
    assert!(queries.len() >= 20, "only {} queries found in the dashboard", queries.len());

    let dir = model("tiny-llama");
    let (_c, url) = conductor_with(&dir, "embedded", &["--elastic"]);
    let _p = worker(&dir, "prefill", &url, &[]);
    let _d = worker(&dir, "decode", &url, &[]);
    wait_members(&url, 2, Duration::from_secs(10));
    complete(&url, "Grafana draws", 4);
    let exported = http().get(format!("{url}/metrics")).send().unwrap().text().unwrap();
    // Each exported series' name, with the labels any of its samples carry.
    let mut series: std::collections::HashMap<String, Vec<String>> = std::collections::HashMap::new();
    for line in exported.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
        let name = line.split(['{', ' ']).next().unwrap().to_owned();
        let labels = series.entry(name).or_default();
        if let Some(inner) = line.split_once('{').and_then(|(_, r)| r.split_once('}')).map(|(l, _)| l) {
            for pair in inner.split("\",") {
                let key = pair.split('=').next().unwrap().trim_matches(',').to_owned();
                if !labels.contains(&key) {
                    labels.push(key);
                }
            }
        }
    }
    let registered = include_str!("../../baton-conductor/src/metrics.rs");
    let born_of_events = [("baton_role_switches_total", "&[\"from\", \"to\"]")];
    let mut missing = Vec::new();
    let mut checked = 0;
    for query in &queries {
        let names: Vec<&str> = query
            .match_indices("baton_")
            .map(|(i, _)| {
                let rest = &query[i..];
                &rest[..rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len())]
            })
            .collect();
        // The labels a query groups by or filters on.
        let mut labels: Vec<String> = Vec::new();
        for (i, _) in query.match_indices("by (") {
            let inner = &query[i + 4..];
            labels.extend(inner[..inner.find(')').unwrap()].split(',').map(|l| l.trim().to_owned()));
        }
        for (i, _) in query.match_indices('{') {
            let inner = &query[i + 1..];
            let inner = &inner[..inner.find('}').unwrap()];
            labels.extend(inner.split(',').filter_map(|m| m.split(['=', '!']).next()).map(|l| l.trim().to_owned()));
        }
        labels.retain(|l| !l.is_empty() && l != "le");
        for name in names {
            checked += 1;
            if let Some((_, label_list)) = born_of_events.iter().find(|(n, _)| *n == name) {
                if !registered.contains(&format!("\"{name}\"")) || !registered.contains(label_list) {
                    missing.push(format!("{name} (not registered as such in metrics.rs)"));
                }
                continue;
            }
            if !series.contains_key(name) {
                missing.push(name.to_owned());
            }
        }
        // Each label must be on at least one of the metrics the query names.
        for label in &labels {
            let on_some = series.iter().any(|(n, have)| query.contains(n.as_str()) && have.contains(label))
                || born_of_events.iter().any(|(n, l)| query.contains(n) && l.contains(&format!("\"{label}\"")));
            if !on_some {
                missing.push(format!("label `{label}` in `{query}`"));
            }
        }
    }
    assert!(checked >= 25, "only {checked} metric names found in the dashboard's queries");
    assert!(missing.is_empty(), "the dashboard queries what the conductor does not export: {missing:?}\n{exported}");
}

/// KV damaged on the wire of a TCP hand-off is never used (#63, item 3): the prefill worker's
/// KV port is reached through a relay that, once told, flips a byte in the middle of every
/// payload. The decode worker's pull fails its checksums, the request is computed again, the
/// answer equals `baton generate`'s, and the decode worker counts the damaged blocks.
#[test]
fn a_tcp_hand_off_damaged_on_the_wire_is_recomputed_and_counted() {
    let dir = model("tiny-llama");
    let (_c, url) = conductor_with(&dir, "embedded", &["--kv-transfer", "pull"]);
    let (control, kv) = (free_port(), free_port());
    one_way_relay(
        SocketAddr::from(([127, 0, 0, 2], control)),
        SocketAddr::from(([127, 0, 0, 1], control)),
        Arc::new(AtomicBool::new(false)),
    );
    let flip = Arc::new(AtomicBool::new(false));
    relay::flipping_relay(
        SocketAddr::from(([127, 0, 0, 2], kv)),
        SocketAddr::from(([127, 0, 0, 1], kv)),
        Arc::clone(&flip),
    );
    let (control_s, kv_s) = (control.to_string(), kv.to_string());
    let args =
        ["--name", "p", "--host", "127.0.0.1", "--port", &control_s, "--kv-port", &kv_s, "--advertise", "127.0.0.2"];
    let mut p = worker(&dir, "prefill", &url, &args);
    let d = worker(&dir, "decode", &url, &["--name", "d", "--transport", "tcp"]);
    wait_members(&url, 2, Duration::from_secs(10));
    let tcp = || metric(&url, "baton_kv_transfers_total{transport=\"tcp\"}");
    let corrupt = || metric(&url, "baton_kv_corrupt_blocks_total{worker=\"d\"}");
    assert_eq!(text(&complete(&url, LONG, 4)), generate(&dir, LONG, 4), "through the relay");
    assert_eq!((tcp(), corrupt()), (1.0, 0.0), "the undamaged hand-off");

    flip.store(true, Ordering::Relaxed);
    let prompt = "Once upon a time, in a quiet village by the sea, an old sailor mended his nets";
    assert_eq!(text(&complete(&url, prompt, 4)), generate(&dir, prompt, 4), "after damage on the wire");
    assert_eq!(tcp(), 1.0, "the damaged hand-off must not count as KV that arrived");
    assert!(corrupt() >= 1.0, "the damaged blocks were not counted");
    p.url = format!("http://127.0.0.1:{control}");
    assert_no_leak(&[&p, &d]);
}

/// Members are never starved by strangers on the KV port (#63, item 4: a flood of 300
/// reconnecting connections from 127.0.0.1, the decode worker's own address, made 20 of 20
/// hand-offs fail and recompute). Four flooders keep up to 300 connections to the prefill
/// worker's KV port open from 127.0.0.1, reconnecting as fast as they can, half idle and half
/// opening with a forged member ticket, and 8 idle and 8 forged connections stay open
/// throughout (the slots stay held whatever pace the churn keeps on a busy machine); meanwhile
/// ten requests are handed off over TCP, and every one arrives (`baton_kv_transfers_total{transport="tcp"}`: none was recomputed). The
/// flood ends with the requests, or at 120 s, or at 500,000 connections a flooder.
#[test]
fn a_flood_on_the_kv_port_from_the_decode_workers_address_costs_no_hand_off() {
    use std::io::Write;
    let dir = model("tiny-llama");
    let (_c, url) = conductor_with(&dir, "embedded", &["--kv-transfer", "pull"]);
    let kv = free_port();
    let kv_s = kv.to_string();
    let p = worker(&dir, "prefill", &url, &["--name", "p", "--kv-port", &kv_s]);
    let d = worker(&dir, "decode", &url, &["--name", "d", "--transport", "tcp"]);
    wait_members(&url, 2, Duration::from_secs(10));
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let target = SocketAddr::from(([127, 0, 0, 1], kv));
    let flooders: Vec<_> = (0..4u64)
        .map(|f| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                // The right magic and version, a proof of nothing: a stranger's ticket.
                let mut forged = [0x5Au8; 64];
                forged[..6].copy_from_slice(b"BTKM\x01\x00");
                let mut held = std::collections::VecDeque::new();
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) && n < 500_000 && started.elapsed() < Duration::from_secs(120) {
                    if let Ok(mut s) = std::net::TcpStream::connect_timeout(&target, Duration::from_secs(1)) {
                        if (n + f).is_multiple_of(2) {
                            let _ = s.write_all(&forged);
                        }
                        held.push_back(s);
                        n += 1;
                    }
                    if held.len() > 75 {
                        held.pop_front();
                    }
                }
                n
            })
        })
        .collect();
    // Besides the churn, connections that stay: idle ones first (they hold a server's slots
    // when slots go by address alone), then forged tickets (they hold the strangers' slots).
    let mut held = Vec::new();
    for forged in [false, true] {
        for _ in 0..8 {
            let mut s = std::net::TcpStream::connect(target).unwrap();
            if forged {
                s.write_all(b"BTKM\x01\x00").unwrap();
                s.write_all(&[0x5A; 58]).unwrap();
            }
            held.push(s);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut texts = Vec::new();
    for i in 0..10 {
        let prompt = format!("Request {i}: {LONG}");
        let v = complete(&url, &prompt, 3);
        assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
        texts.push(text(&v));
    }
    stop.store(true, Ordering::Relaxed);
    drop(held);
    let flood: u64 = flooders.into_iter().map(|t| t.join().unwrap()).sum();
    let arrived = metric(&url, "baton_kv_transfers_total{transport=\"tcp\"}");
    eprintln!("{flood} flood connections from 127.0.0.1; {arrived} of 10 hand-offs arrived over TCP");
    assert!(flood > 100, "the flood was too weak to mean anything: {flood}");
    assert_eq!(arrived, 10.0, "hand-offs failed under the flood and were recomputed");
    assert_no_leak(&[&p, &d]);
}
