//! The official `openai` Python client against a real server: streaming chat, completions,
//! models, errors. The client is installed by `scripts/install-python-deps.sh` into `.venv`.

use std::path::Path;
use std::process::Command;

use baton_server::ServeConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_client_works_against_baton_serve() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let python = root.join(".venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run scripts/install-python-deps.sh (scripts/test.sh does)",
        python.display()
    );
    let config = ServeConfig::new(root.join("fixtures/models/tiny-llama"));
    let conductor = baton_server::build(&config).expect("builds");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(baton_server::serve(listener, conductor.clone(), std::future::pending()));
    let script = root.join("crates/baton-server/tests/python/openai_client.py");
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python).arg(script).arg(&url).arg("tiny-llama").output().expect("python runs")
    })
    .await
    .expect("joins");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the openai client failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("openai client: ok"), "{stdout}");
    for w in conductor.workers() {
        let s = w.stats().await.expect("stats");
        assert_eq!((s.running, s.leased, s.available_blocks), (0, 0, s.total_blocks), "{} holds KV", w.name());
    }
}
