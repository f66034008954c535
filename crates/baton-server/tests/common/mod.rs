//! What the server tests share: a fixture's path, `baton serve`'s builder on a real socket, and
//! the check that no worker holds KV after a scenario.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use baton_server::{Conductor, ServeConfig};

/// A reference checkpoint under `fixtures/models`.
pub(crate) fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models").join(name)
}

/// A conductor and its workers serving on a loopback port until dropped.
pub(crate) struct Server {
    pub(crate) url: String,
    pub(crate) conductor: Arc<Conductor>,
    pub(crate) _shutdown: tokio::sync::oneshot::Sender<()>,
}

/// Builds what `config` describes (as `baton serve` does) and serves it on `127.0.0.1:0`.
pub(crate) async fn start_with(config: &ServeConfig) -> Server {
    let conductor = baton_server::build(config).expect("builds");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(baton_server::serve(listener, conductor.clone(), async {
        let _ = rx.await;
    }));
    Server { url, conductor, _shutdown: tx }
}

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
