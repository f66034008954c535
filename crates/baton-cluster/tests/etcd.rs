//! The etcd backend against a real etcd process on loopback ports (see `common::TestEtcd`).

#![cfg(feature = "etcd")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use baton_cluster::{
    ClusterError, ClusterSecret, EtcdConfig, EtcdRegistry, LeftReason, MembershipEvent, Registry, RegistryConfig, Role,
};
use common::{TestEtcd, assert_quiet, info, joined, next_event, wid};

const WAIT: Duration = Duration::from_secs(5);

async fn registry(etcd: &TestEtcd, secret: &str) -> EtcdRegistry {
    let config: RegistryConfig = format!("etcd://{}/test", etcd.endpoint).parse().unwrap();
    let RegistryConfig::Etcd(config) = config else { panic!("etcd config") };
    EtcdRegistry::connect(&config, ClusterSecret::new(secret).unwrap()).await.unwrap()
}

#[tokio::test]
async fn etcd_join_and_leave_are_seen_in_order() {
    let etcd = TestEtcd::start();
    let conductor = registry(&etcd, "s").await;
    let worker = registry(&etcd, "s").await;
    let mut watch = conductor.watch().await.unwrap();

    let p0 = worker.register(info("p0", Role::Prefill), Duration::from_secs(2)).await.unwrap();
    let d0 = worker.register(info("d0", Role::Decode), Duration::from_secs(2)).await.unwrap();
    assert_eq!(joined(&next_event(&mut watch, WAIT, "p0 joins").await), "p0");
    assert_eq!(joined(&next_event(&mut watch, WAIT, "d0 joins").await), "d0");

    let mut late = conductor.watch().await.unwrap();
    let mut first: Vec<String> = Vec::new();
    for _ in 0..2 {
        first.push(joined(&next_event(&mut late, WAIT, "snapshot").await).to_owned());
    }
    first.sort();
    assert_eq!(first, ["d0", "p0"]);

    let dup = worker.register(info("p0", Role::Prefill), Duration::from_secs(2)).await;
    assert!(matches!(dup, Err(ClusterError::DuplicateWorker(_))), "{dup:?}");

    // Keep-alives hold both past the TTL.
    assert_quiet(&mut watch, Duration::from_secs(3)).await;

    worker.deregister(p0).await.unwrap();
    for w in [&mut watch, &mut late] {
        assert_eq!(next_event(w, WAIT, "p0 leaves").await, MembershipEvent::Left(wid("p0"), LeftReason::Deregistered));
    }
    let members: Vec<_> = conductor.list().await.unwrap().into_iter().map(|i| i.id).collect();
    assert_eq!(members, [wid("d0")]);
    worker.deregister(d0).await.unwrap();
    assert_eq!(
        next_event(&mut watch, WAIT, "d0 leaves").await,
        MembershipEvent::Left(wid("d0"), LeftReason::Deregistered)
    );
}

#[tokio::test]
async fn etcd_dead_worker_expires_and_strangers_are_ignored() {
    let etcd = TestEtcd::start();
    let conductor = registry(&etcd, "s").await;
    let worker = registry(&etcd, "s").await;
    let stranger = registry(&etcd, "not-the-secret").await;
    let mut watch = conductor.watch().await.unwrap();

    // A worker without the secret can write to etcd, but never becomes a member.
    let _evil = stranger.register(info("evil", Role::Prefill), Duration::from_secs(2)).await.unwrap();
    let dead = worker.register(info("dead", Role::Decode), Duration::from_secs(1)).await.unwrap();
    assert_eq!(joined(&next_event(&mut watch, WAIT, "dead joins").await), "dead");
    let members: Vec<_> = conductor.list().await.unwrap().into_iter().map(|i| i.id).collect();
    assert_eq!(members, [wid("dead")]);
    let mut fresh = conductor.watch().await.unwrap();
    assert_eq!(joined(&fresh.try_recv().expect("snapshot")), "dead");
    assert!(fresh.try_recv().is_none(), "the stranger is not a member");

    // Heartbeats stop (the process died): etcd's lease runs out (its minimum TTL is 2 s).
    let start = Instant::now();
    drop(dead);
    let event = next_event(&mut watch, Duration::from_secs(6), "the dead worker's expiry").await;
    assert_eq!(event, MembershipEvent::Left(wid("dead"), LeftReason::LeaseExpired));
    assert!(start.elapsed() < Duration::from_secs(5), "noticed after {:?}", start.elapsed());
    assert!(conductor.list().await.unwrap().is_empty());
}

#[tokio::test]
async fn unreachable_etcd_is_a_timely_error() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let start = Instant::now();
    let result =
        EtcdRegistry::connect(&EtcdConfig::new([format!("127.0.0.1:{port}")]), ClusterSecret::new("s").unwrap()).await;
    // etcd-client connects lazily on some versions; either connecting or the first call fails.
    let err = match result {
        Err(e) => e,
        Ok(r) => r.list().await.unwrap_err(),
    };
    assert!(matches!(err, ClusterError::Etcd(_) | ClusterError::Timeout(_)), "{err:?}");
    assert!(start.elapsed() < Duration::from_secs(10));
}
