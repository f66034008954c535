//! Shared test helpers: worker infos, waiting for events with a deadline, and a real etcd
//! server on free loopback ports.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use baton_cluster::{KvSummary, MembershipEvent, MembershipWatch, Role, WorkerId, WorkerInfo};

/// A worker description for tests.
pub fn info(id: &str, role: Role) -> WorkerInfo {
    WorkerInfo {
        id: WorkerId::new(id).unwrap(),
        role,
        control_url: format!("http://127.0.0.1:1/{id}"),
        kv_addr: "127.0.0.1:2".into(),
        model: "tiny".into(),
        kv: KvSummary { num_layers: 2, num_kv_heads: 2, head_dim: 8, block_tokens: 16, dtype: "f32".into() },
        capacity_blocks: 64,
        started_at_ms: baton_cluster::unix_millis(),
    }
}

pub fn wid(id: &str) -> WorkerId {
    WorkerId::new(id).unwrap()
}

/// The next event, or a panic naming `what` after `limit`.
pub async fn next_event(watch: &mut MembershipWatch, limit: Duration, what: &str) -> MembershipEvent {
    match tokio::time::timeout(limit, watch.recv()).await {
        Ok(Some(event)) => event,
        Ok(None) => panic!("watch ended while waiting for {what}"),
        Err(_) => panic!("no membership event within {limit:?} while waiting for {what}"),
    }
}

/// Asserts that no event arrives within `quiet`.
pub async fn assert_quiet(watch: &mut MembershipWatch, quiet: Duration) {
    if let Ok(event) = tokio::time::timeout(quiet, watch.recv()).await {
        panic!("unexpected membership event {event:?}");
    }
}

/// The id of a `Joined` event.
pub fn joined(event: &MembershipEvent) -> &str {
    match event {
        MembershipEvent::Joined(info) => info.id.as_str(),
        other => panic!("expected Joined, got {other:?}"),
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A real etcd on free loopback ports with a temporary data directory; killed on drop.
pub struct TestEtcd {
    child: Child,
    data_dir: PathBuf,
    /// `host:port` of the client endpoint.
    pub endpoint: String,
}

impl TestEtcd {
    /// Starts etcd and waits (up to 15 s) until it answers. Fails the test, naming
    /// `scripts/install-deps.sh`, when etcd is not installed.
    pub fn start() -> Self {
        Self::start_on(free_port())
    }

    /// [`start`](Self::start) on the client port `client_port` (a port a test chose earlier,
    /// for a process told to use it before etcd was up).
    pub fn start_on(client_port: u16) -> Self {
        let binary = std::env::var("BATON_ETCD").unwrap_or_else(|_| "etcd".into());
        let peer_port = free_port();
        let data_dir = std::env::temp_dir().join(format!("baton-etcd-{}-{client_port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&data_dir);
        let client_url = format!("http://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let log = std::fs::File::create(std::env::temp_dir().join(format!("baton-etcd-{client_port}.log"))).unwrap();
        let child = Command::new(&binary)
            .arg("--name")
            .arg("baton-test")
            .arg("--data-dir")
            .arg(&data_dir)
            .arg("--listen-client-urls")
            .arg(&client_url)
            .arg("--advertise-client-urls")
            .arg(&client_url)
            .arg("--listen-peer-urls")
            .arg(&peer_url)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer_url)
            .arg("--initial-cluster")
            .arg(format!("baton-test={peer_url}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn();
        let child = match child {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "`{binary}` is not installed: run scripts/install-deps.sh (it installs etcd-server), \
                 or point BATON_ETCD at an etcd binary"
            ),
            Err(e) => panic!("cannot start `{binary}`: {e}"),
        };
        let mut etcd = Self { child, data_dir, endpoint: format!("127.0.0.1:{client_port}") };
        etcd.wait_ready(Duration::from_secs(15));
        etcd
    }

    fn wait_ready(&mut self, limit: Duration) {
        let start = Instant::now();
        let health = "/health";
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("etcd exited during start-up ({status}); see its log in {}", std::env::temp_dir().display());
            }
            if let Ok(body) = http_get(&self.endpoint, health)
                && (body.contains("\"health\":\"true\"") || body.contains("\"health\": \"true\""))
            {
                return;
            }
            assert!(start.elapsed() < limit, "etcd did not become healthy within {limit:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A minimal blocking HTTP/1.0 GET, with timeouts.
fn http_get(addr: &str, path: &str) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_millis(200))?;
    stream.set_read_timeout(Some(Duration::from_millis(500)))?;
    stream.set_write_timeout(Some(Duration::from_millis(500)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut body = String::new();
    stream.read_to_string(&mut body)?;
    Ok(body)
}

impl Drop for TestEtcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.data_dir);
    }
}
