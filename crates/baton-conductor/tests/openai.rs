//! The official `openai` Python client against a real server: streaming chat, completions,
//! models, structured output, tool calls, errors — on the tiny fixture and on the real default
//! model (SmolLM2 135M Instruct), both through `baton serve`'s prefill→decode hand-off. The
//! client is installed by `scripts/install-python-deps.sh` into `.venv`; the default model is
//! fetched by `scripts/fetch-model.sh`.

use std::path::{Path, PathBuf};
use std::process::Command;

use baton_conductor::ServeConfig;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Serves `model` as `baton serve` does (one prefill and one decode worker) and runs
/// `tests/python/openai_client.py` against it; then no worker may hold KV.
async fn run_client(model: PathBuf, model_id: &str) {
    let root = root();
    let python = root.join(".venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run scripts/install-python-deps.sh (scripts/test.sh does)",
        python.display()
    );
    let config = ServeConfig { model_id: Some(model_id.to_owned()), ..ServeConfig::new(model) };
    let conductor = baton_conductor::build(&config).expect("builds");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(baton_conductor::serve(listener, conductor.clone(), std::future::pending()));
    let script = root.join("crates/baton-conductor/tests/python/openai_client.py");
    let id = model_id.to_owned();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python).arg(script).arg(&url).arg(id).output().expect("python runs")
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_client_works_against_baton_serve() {
    run_client(root().join("fixtures/models/tiny-llama"), "tiny-llama").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_client_gets_structured_output_and_tool_calls_from_the_default_model() {
    let path = baton_model::known_model_path(&root(), "smollm2-135m-instruct").expect("a known model");
    assert!(path.is_file(), "{} is missing: run `scripts/fetch-model.sh` first", path.display());
    run_client(path, "smollm2-135m-instruct").await;
}
