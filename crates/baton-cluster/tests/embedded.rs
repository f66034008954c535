//! The embedded registry in-process, and over its HTTP routes with the remote client, on real
//! loopback sockets.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use baton_cluster::Registry;
use baton_cluster::{
    ClusterError, ClusterSecret, EmbeddedRegistry, LeftReason, MembershipEvent, RegistryConfig, RemoteOptions,
    RemoteRegistryClient, Role,
};
use common::{assert_quiet, info, joined, next_event, wid};

const WAIT: Duration = Duration::from_secs(5);

fn secret(s: &str) -> ClusterSecret {
    ClusterSecret::new(s).unwrap()
}

/// Serves `registry`'s routes on 127.0.0.1:0.
async fn serve(registry: EmbeddedRegistry) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, baton_cluster::router(registry)).await });
    addr
}

fn fast_client(addr: SocketAddr, secret: ClusterSecret) -> RemoteRegistryClient {
    let options = RemoteOptions { poll_interval: Duration::from_millis(100), ..RemoteOptions::default() };
    RemoteRegistryClient::with_options(&format!("http://{addr}"), secret, options).unwrap()
}

#[tokio::test]
async fn join_and_leave_are_seen_in_order() {
    let registry = EmbeddedRegistry::start(secret("s"));
    let mut watch = registry.watch().await.unwrap();
    let p0 = registry.register(info("p0", Role::Prefill), Duration::from_secs(5)).await.unwrap();
    let d0 = registry.register(info("d0", Role::Decode), Duration::from_secs(5)).await.unwrap();
    assert_eq!(joined(&next_event(&mut watch, WAIT, "p0 joins").await), "p0");
    assert_eq!(joined(&next_event(&mut watch, WAIT, "d0 joins").await), "d0");

    // A late watcher gets the current members first.
    let mut late = registry.watch().await.unwrap();
    let mut first: Vec<String> = Vec::new();
    for _ in 0..2 {
        first.push(joined(&next_event(&mut late, WAIT, "snapshot").await).to_owned());
    }
    first.sort();
    assert_eq!(first, ["d0", "p0"]);

    let again = registry.register(info("p0", Role::Prefill), Duration::from_secs(5)).await;
    assert!(matches!(again, Err(ClusterError::DuplicateWorker(_))), "{again:?}");

    registry.deregister(p0).await.unwrap();
    for w in [&mut watch, &mut late] {
        assert_eq!(next_event(w, WAIT, "p0 leaves").await, MembershipEvent::Left(wid("p0"), LeftReason::Deregistered));
    }
    let members: Vec<_> = registry.list().await.unwrap().into_iter().map(|i| i.id).collect();
    assert_eq!(members, [wid("d0")]);
    registry.deregister(d0).await.unwrap();
    assert_eq!(
        next_event(&mut watch, WAIT, "d0 leaves").await,
        MembershipEvent::Left(wid("d0"), LeftReason::Deregistered)
    );
}

#[tokio::test]
async fn a_silent_worker_expires_within_its_ttl() {
    let registry = EmbeddedRegistry::start(secret("s"));
    let mut watch = registry.watch().await.unwrap();
    let ttl = Duration::from_secs(1);
    let alive = registry.register(info("alive", Role::Decode), ttl).await.unwrap();
    let dead = registry.register(info("dead", Role::Prefill), ttl).await.unwrap();
    next_event(&mut watch, WAIT, "alive joins").await;
    next_event(&mut watch, WAIT, "dead joins").await;

    let start = Instant::now();
    drop(dead); // heartbeats stop, as when the process dies
    let event = next_event(&mut watch, Duration::from_secs(3), "the dead worker's expiry").await;
    assert_eq!(event, MembershipEvent::Left(wid("dead"), LeftReason::LeaseExpired));
    let took = start.elapsed();
    assert!(took <= ttl + Duration::from_millis(500), "noticed after {took:?}");

    // The heartbeating worker outlives several TTLs.
    assert_quiet(&mut watch, 2 * ttl).await;
    assert_eq!(registry.list().await.unwrap().len(), 1);
    assert_eq!(alive.status(), baton_cluster::LeaseStatus::Alive);
}

#[tokio::test]
async fn remote_workers_join_heartbeat_and_leave_over_http() {
    let registry = EmbeddedRegistry::start(secret("cluster-secret"));
    let addr = serve(registry.clone()).await;
    let mut conductor = registry.watch().await.unwrap();

    // A worker process: `--registry http://HOST:PORT`.
    let config: RegistryConfig = format!("http://{addr}").parse().unwrap();
    assert!(matches!(config, RegistryConfig::Remote { .. }));
    let worker = baton_cluster::connect(&config, secret("cluster-secret")).await.unwrap();
    let observer = fast_client(addr, secret("cluster-secret"));
    let mut remote_watch = observer.watch().await.unwrap();

    let ttl = Duration::from_secs(1);
    let p0 = worker.register(info("p0", Role::Prefill), ttl).await.unwrap();
    let d0 = worker.register(info("d0", Role::Decode), ttl).await.unwrap();
    assert_eq!(joined(&next_event(&mut conductor, WAIT, "p0 joins").await), "p0");
    assert_eq!(joined(&next_event(&mut conductor, WAIT, "d0 joins").await), "d0");
    let mut seen: Vec<String> = Vec::new();
    for _ in 0..2 {
        seen.push(joined(&next_event(&mut remote_watch, WAIT, "remote watch: joins").await).to_owned());
    }
    seen.sort();
    assert_eq!(seen, ["d0", "p0"]);

    let dup = worker.register(info("p0", Role::Prefill), ttl).await;
    assert!(matches!(dup, Err(ClusterError::DuplicateWorker(_))), "{dup:?}");

    // Heartbeats over HTTP keep both alive past twice the TTL.
    assert_quiet(&mut conductor, 2 * ttl + Duration::from_millis(500)).await;
    assert_eq!(worker.list().await.unwrap().len(), 2);

    worker.deregister(p0).await.unwrap();
    let left = MembershipEvent::Left(wid("p0"), LeftReason::Deregistered);
    assert_eq!(next_event(&mut conductor, WAIT, "p0 deregisters").await, left);
    assert_eq!(next_event(&mut remote_watch, WAIT, "remote watch: p0 deregisters").await, left);

    drop(d0);
    let expired = MembershipEvent::Left(wid("d0"), LeftReason::LeaseExpired);
    assert_eq!(next_event(&mut conductor, Duration::from_secs(3), "d0 expires").await, expired);
    assert_eq!(next_event(&mut remote_watch, Duration::from_secs(3), "remote watch: d0 expires").await, expired);
    assert!(worker.list().await.unwrap().is_empty());
}

#[tokio::test]
async fn a_worker_without_the_secret_is_refused() {
    let registry = EmbeddedRegistry::start(secret("right"));
    let addr = serve(registry.clone()).await;
    let mut conductor = registry.watch().await.unwrap();

    let intruder = fast_client(addr, secret("wrong"));
    let err = intruder.register(info("evil", Role::Prefill), Duration::from_secs(1)).await.unwrap_err();
    assert!(matches!(err, ClusterError::Unauthorized(_)), "{err:?}");
    assert!(err.to_string().contains("wrong cluster secret"), "{err}");
    assert!(matches!(intruder.list().await, Err(ClusterError::Unauthorized(_))));
    assert!(matches!(intruder.watch().await, Err(ClusterError::Unauthorized(_))));

    // Without any proof: 401; with a proof made with another secret: 403.
    let http = reqwest::Client::builder().timeout(WAIT).build().unwrap();
    let body =
        serde_json::to_vec(&baton_cluster::RegisterRequest { info: info("bare", Role::Decode), ttl_ms: 1000 }).unwrap();
    let bare = http.post(format!("http://{addr}/cluster/register")).body(body).send().await.unwrap();
    assert_eq!(bare.status(), reqwest::StatusCode::UNAUTHORIZED);
    let members = http.get(format!("http://{addr}/cluster/members")).send().await.unwrap();
    assert_eq!(members.status(), reqwest::StatusCode::UNAUTHORIZED);
    let forged = http
        .get(format!("http://{addr}/cluster/members"))
        .header(
            "x-baton-cluster-auth",
            format!("t={},n=0123456789abcdef,sig={}", baton_cluster::unix_millis(), "00".repeat(32)),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(forged.status(), reqwest::StatusCode::FORBIDDEN);

    assert_quiet(&mut conductor, Duration::from_millis(300)).await;
    assert!(registry.list().await.unwrap().is_empty());
}

#[tokio::test]
async fn an_unreachable_conductor_is_a_timely_error() {
    // A port nobody listens on: connection refused, well within the client's timeouts.
    let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let client = fast_client(addr, secret("s"));
    let start = Instant::now();
    let err = client.register(info("w", Role::Decode), Duration::from_secs(1)).await.unwrap_err();
    assert!(matches!(err, ClusterError::Transport(_) | ClusterError::Timeout(_)), "{err:?}");
    assert!(start.elapsed() < Duration::from_secs(6));
}
