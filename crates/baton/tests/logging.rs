//! `baton serve --log-format json` on a fixture model: one request's `x-request-id` comes back
//! as a response header and names the JSON log lines of the conductor, the prefill worker, the
//! decode worker and the KV transfer; a request without one gets a generated id.

#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

#[test]
fn json_logs_carry_the_request_id_through_conductor_workers_and_transfer() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-llama");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args([
            "serve",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--log-format",
            "json",
            "--port",
            &port.to_string(),
            "--model",
        ])
        .arg(&model)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::blocking::Client::new();
    let mut up = false;
    for _ in 0..600 {
        if http.get(format!("{base}/health")).send().is_ok_and(|r| r.status().is_success()) {
            up = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(up, "baton serve did not come up");
    let body = json!({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0});
    let given =
        http.post(format!("{base}/v1/completions")).header("x-request-id", "trace-me-4242").json(&body).send().unwrap();
    assert_eq!(given.status(), 200);
    assert_eq!(given.headers()["x-request-id"], "trace-me-4242");
    let without = http.post(format!("{base}/v1/completions")).json(&body).send().unwrap();
    let generated = without.headers()["x-request-id"].to_str().unwrap().to_owned();
    assert!(generated.len() >= 16 && generated != "trace-me-4242", "{generated}");
    // Errors and other routes carry one too.
    let bad = http.post(format!("{base}/v1/completions")).header("x-request-id", "bad-1").body("{").send().unwrap();
    assert_eq!((bad.status().as_u16(), bad.headers()["x-request-id"].to_str().unwrap()), (400, "bad-1"));
    assert!(http.get(format!("{base}/v1/models")).send().unwrap().headers().contains_key("x-request-id"));
    child.kill().unwrap();
    let mut logs = String::new();
    child.stderr.take().unwrap().read_to_string(&mut logs).unwrap();
    let _ = child.wait();
    let lines: Vec<Value> = logs.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    // (`baton serve` prints its start-up banner as plain text; every log line is JSON.)
    let text_logs = logs.lines().filter(|l| !l.starts_with('{') && (l.contains(" INFO ") || l.contains(" WARN ")));
    assert_eq!(text_logs.count(), 0, "text log lines:\n{logs}");
    assert!(!lines.is_empty(), "no JSON log lines:\n{logs}");
    let ours: Vec<&Value> = lines.iter().filter(|l| l.to_string().contains("trace-me-4242")).collect();
    let message = |m: &str| ours.iter().any(|l| l["fields"]["message"] == m);
    assert!(message("request accepted") && message("request finished"), "conductor lines missing:\n{logs}");
    let on = |role: &str| ours.iter().any(|l| l["fields"]["message"] == "work submitted" && l["span"]["role"] == role);
    assert!(on("prefill") && on("decode"), "worker lines missing:\n{logs}");
    assert!(message("KV transfer starting") && message("received KV"), "transfer lines missing:\n{logs}");
    let engine = |m: &str, role: &str| ours.iter().any(|l| l["fields"]["message"] == m && l["span"]["role"] == role);
    assert!(engine("KV offered for the hand-off", "prefill"), "the prefill engine's lines lack the id:\n{logs}");
    assert!(engine("finished", "prefill") && engine("finished", "decode"), "engine lines missing:\n{logs}");
    assert!(logs.contains(&generated), "the generated id is not logged:\n{logs}");
}
