//! What the server tests share: a fixture's path, `baton serve`'s builder on a real socket, and
//! the check that no worker holds KV after a scenario.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use baton_conductor::{Conductor, ServeConfig};

/// A reference checkpoint under `fixtures/models`.
pub(crate) fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models").join(name)
}

/// A conductor and its workers serving on a loopback port until dropped.
pub(crate) struct Server {
    pub(crate) url: String,
    #[allow(dead_code)] // Not every test file looks into the conductor.
    pub(crate) conductor: Arc<Conductor>,
    pub(crate) _shutdown: tokio::sync::oneshot::Sender<()>,
}

/// Builds what `config` describes (as `baton serve` does) and serves it on `127.0.0.1:0`.
pub(crate) async fn start_with(config: &ServeConfig) -> Server {
    let conductor = baton_conductor::build(config).expect("builds");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(baton_conductor::serve(listener, conductor.clone(), async {
        let _ = rx.await;
    }));
    Server { url, conductor, _shutdown: tx }
}

#[allow(dead_code)] // Not every test file checks the workers' KV.
impl Server {
    /// Waits (up to 5 s) until no worker runs anything or holds any KV; panics otherwise.
    pub(crate) async fn assert_no_kv_held(&self) {
        for _ in 0..200 {
            let mut clean = true;
            for w in self.conductor.workers() {
                clean &= w.stats().await.expect("stats").is_quiet();
            }
            if clean {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        for w in self.conductor.workers() {
            eprintln!("{}: {:?}", w.name(), w.stats().await);
        }
        panic!("a worker still holds KV");
    }
}

/// Bytes the workers behind the server at `url` copied into or out of their device arenas in
/// `direction` (`device_to_host`, `host_to_device`, `device_to_device`), summed over workers.
#[allow(dead_code)] // Not every test file reads the copy meters.
pub(crate) async fn copy_bytes(url: &str, direction: &str) -> f64 {
    let metrics = reqwest::get(format!("{url}/metrics")).await.expect("scrapes").text().await.expect("text");
    let prefix = format!("baton_kv_copy_bytes_total{{direction=\"{direction}\"");
    metrics.lines().filter(|l| l.starts_with(&prefix)).filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok()).sum()
}

/// `prompt` run alone on one engine with `config`, greedy, ignoring EOS: the reference output
/// (prompt ids, text).
#[allow(dead_code)] // Not every test file compares with the engine alone.
pub(crate) fn engine_alone(
    model: &str,
    config: baton_engine::EngineConfig,
    prompt: &str,
    max_tokens: usize,
) -> (Vec<u32>, String) {
    use baton_engine::{Engine, GenerationRequest, RequestId, StopParams};
    let ckpt = baton_model::Checkpoint::open(&fixture(model)).expect("loads");
    let ids = ckpt.tokenizer.encode(prompt, true).expect("encodes");
    let mut e = Engine::new(Arc::new(ckpt.model), Some(Arc::new(ckpt.tokenizer)), config).expect("engine");
    e.add_request(GenerationRequest {
        stop: StopParams { max_tokens, ignore_eos: true, stop_strings: vec![] },
        ..GenerationRequest::new(RequestId(0), ids.clone())
    })
    .expect("valid");
    let done = e.run_to_completion().expect("runs").remove(0);
    (ids, done.text)
}

/// Reads a streamed response's server-sent events one chunk at a time.
#[allow(dead_code)] // Not every test file streams.
pub(crate) struct SseReader {
    response: reqwest::Response,
    buf: String,
}

#[allow(dead_code)]
impl SseReader {
    /// A reader of `response`, which must be a 200.
    pub(crate) fn new(response: reqwest::Response) -> Self {
        assert_eq!(response.status().as_u16(), 200);
        Self { response, buf: String::new() }
    }

    /// The next chunk (checked not to be an error), or `None` at `[DONE]`; panics if the stream
    /// ends without it.
    pub(crate) async fn next(&mut self) -> Option<serde_json::Value> {
        loop {
            if let Some(end) = self.buf.find("\n\n") {
                let event: String = self.buf.drain(..end + 2).collect();
                let Some(data) = event.trim().strip_prefix("data: ") else { continue };
                if data == "[DONE]" {
                    return None;
                }
                let v: serde_json::Value = serde_json::from_str(data).expect("chunk is JSON");
                assert!(v.get("error").is_none(), "streamed error: {v}");
                return Some(v);
            }
            let bytes = self.response.chunk().await.expect("reads").expect("the stream ended without [DONE]");
            self.buf.push_str(std::str::from_utf8(&bytes).expect("utf-8"));
        }
    }
}

/// Every chunk of a streamed response, up to `[DONE]`.
#[allow(dead_code)] // Not every test file streams.
pub(crate) async fn sse_chunks(response: reqwest::Response) -> Vec<serde_json::Value> {
    let mut reader = SseReader::new(response);
    let mut chunks = Vec::new();
    while let Some(v) = reader.next().await {
        chunks.push(v);
    }
    chunks
}
