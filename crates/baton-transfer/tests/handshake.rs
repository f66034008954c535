//! CONNECT refusals and many transfers in flight on one connection (server and client in one
//! process; the two-process tests are in `two_process.rs`).

use std::sync::Arc;
use std::sync::mpsc::channel;
use std::time::Duration;

use baton_kv::{BlockId, KvDtype, KvGeometry, KvLayout, TensorDescriptor};
use baton_transfer::{
    ClientConfig, Compat, ErrorCode, KvClient, KvServer, PeerId, Region, ServerConfig, TransferError, TransferId,
    TransportKind,
};

fn geometry() -> KvGeometry {
    KvGeometry { dtype: KvDtype::F16, ..KvGeometry::new(2, 2, 4, 4) }
}

fn server() -> (KvServer, std::sync::mpsc::Receiver<baton_transfer::Release>) {
    let desc = TensorDescriptor::new(&geometry(), KvLayout::LayerMajor, 16);
    let region = Region::create(desc).expect("region");
    let bytes: Vec<u8> = (0..region.len()).map(|i| (i % 253) as u8).collect();
    region.write(0, &bytes).expect("fill");
    let (tx, rx) = channel();
    let server = KvServer::start(ServerConfig::new(PeerId(1), Compat::new("m", geometry()), "s3cret"), region, tx)
        .expect("server");
    (server, rx)
}

fn local() -> Arc<Region> {
    Arc::new(Region::create(TensorDescriptor::new(&geometry(), KvLayout::BlockMajor, 16)).expect("region"))
}

fn config(secret: &str, compat: Compat) -> ClientConfig {
    let mut c = ClientConfig::new(PeerId(2), compat, secret);
    c.io_timeout = Duration::from_secs(2);
    c
}

#[test]
fn a_peer_without_the_secret_is_refused() {
    let (server, _rx) = server();
    let err =
        KvClient::connect(server.addr(), config("guess", Compat::new("m", geometry())), local()).expect_err("refused");
    assert!(matches!(err, TransferError::AuthFailed(_)), "{err}");
}

#[test]
fn an_incompatible_peer_is_refused_with_the_reason() {
    let (server, _rx) = server();
    let other = Compat::new("m", KvGeometry { block_size: 8, ..geometry() });
    let local = Arc::new(Region::create(TensorDescriptor::new(&other.geometry, KvLayout::BlockMajor, 4)).expect("r"));
    let err = KvClient::connect(server.addr(), config("s3cret", other), local).expect_err("refused");
    match err {
        TransferError::Incompatible(m) => assert!(m.contains("block size 4 vs 8"), "{m}"),
        e => panic!("{e}"),
    }
    // A float32 peer and a float16 one (`--kv-dtype`) never exchange KV.
    let wide = Compat::new("m", KvGeometry { dtype: KvDtype::F32, ..geometry() });
    let local = Arc::new(Region::create(TensorDescriptor::new(&wide.geometry, KvLayout::BlockMajor, 4)).expect("r"));
    let err = KvClient::connect(server.addr(), config("s3cret", wide), local).expect_err("refused");
    assert!(matches!(err, TransferError::Incompatible(ref m) if m.contains("dtype F16 vs F32")), "{err}");
    let renamed = Compat::new("another-model", geometry());
    let err = KvClient::connect(server.addr(), config("s3cret", renamed), self::local()).expect_err("refused");
    assert!(matches!(err, TransferError::Incompatible(ref m) if m.contains("model")), "{err}");
}

#[test]
fn many_transfers_in_flight_on_one_connection() {
    let (server, rx) = server();
    for id in 1..=4u64 {
        let blocks = (0..3).map(|k| BlockId((id as u32 - 1) * 3 + k)).collect();
        server.offer(TransferId(id), blocks).expect("offer");
    }
    let dst = local();
    let mut c = config("s3cret", Compat::new("m", geometry()));
    c.transport = TransportKind::Tcp.into();
    let mut client = KvClient::connect(server.addr(), c, Arc::clone(&dst)).expect("connect");
    let remote = |id: u64| (0..3).map(|k| BlockId((id as u32 - 1) * 3 + k)).collect::<Vec<_>>();
    let local_of = |id: u64| (0..3).map(|k| BlockId(15 - ((id as u32 - 1) * 3 + k))).collect::<Vec<_>>();
    for id in 1..=4 {
        client.open(TransferId(id), &remote(id), &local_of(id)).expect("open");
    }
    for id in (1..=4).rev() {
        client.read(TransferId(id), &remote(id), &local_of(id)).expect("read");
    }
    // A read outside the lease is refused, and the connection stays usable.
    let err = client.read(TransferId(1), &[BlockId(12)], &[BlockId(0)]).expect_err("not leased");
    assert!(matches!(err, TransferError::Remote { code: ErrorCode::OutOfBounds, .. }), "{err}");
    for id in 1..=4 {
        client.complete(TransferId(id)).expect("complete");
    }
    let mut released: Vec<u64> = rx.try_iter().map(|r| r.id.0).collect();
    released.sort();
    assert_eq!(released, vec![1, 2, 3, 4]);
    // Byte-exact: compare with a local plan applied to the server's bytes.
    let src = server.region();
    for id in 1..=4 {
        let p = baton_transfer::plan(src.descriptor(), &remote(id), dst.descriptor(), &local_of(id)).expect("plan");
        for c in p.copies {
            let (mut a, mut b) = (vec![0u8; c.src.len], vec![0u8; c.dst.len]);
            src.read(c.src.offset, &mut a).expect("read");
            dst.read(c.dst.offset, &mut b).expect("read");
            assert_eq!(a, b);
        }
    }
    assert_eq!(server.live_leases(), 0);
}

/// Whether `local` blocks of `dst` hold exactly the server's `remote` blocks.
fn same_bytes(server: &KvServer, dst: &Region, remote: &[BlockId], local: &[BlockId]) -> bool {
    let src = server.region();
    let p = baton_transfer::plan(src.descriptor(), remote, dst.descriptor(), local).expect("plan");
    p.copies.iter().all(|c| {
        let (mut a, mut b) = (vec![0u8; c.src.len], vec![0u8; c.dst.len]);
        src.read(c.src.offset, &mut a).expect("read");
        dst.read(c.dst.offset, &mut b).expect("read");
        a == b
    })
}

fn push_client(server: &KvServer, transport: TransportKind, dst: &Arc<Region>) -> KvClient {
    let mut c = config("s3cret", Compat::new("m", geometry()));
    c.transport = transport.into();
    KvClient::connect(server.addr(), c, Arc::clone(dst)).expect("connect")
}

#[test]
fn pushes_of_offered_blocks_are_polled_together_and_completed() {
    for transport in [TransportKind::Tcp, TransportKind::Shm] {
        let (server, rx) = server();
        let server = Arc::new(server);
        let remote = |id: u64| (0..3).map(|k| BlockId((id as u32 - 1) * 3 + k)).collect::<Vec<_>>();
        let local_of = |id: u64| (0..3).map(|k| BlockId(15 - ((id as u32 - 1) * 3 + k))).collect::<Vec<_>>();
        for id in 1..=2 {
            server.offer(TransferId(id), remote(id)).expect("offer");
        }
        let dst = local();
        let mut client = push_client(&server, transport, &dst);
        // The prefill side starts pushing before the decode side registers: it waits.
        let pushers: Vec<_> = (1..=2u64)
            .map(|id| {
                let s = Arc::clone(&server);
                std::thread::spawn(move || s.push_offered(TransferId(id), 0..2, Duration::from_secs(5)))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(50));
        for id in [2, 1] {
            client.begin_push(TransferId(id), id, &local_of(id)).expect("register");
        }
        let mut done = Vec::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while done.len() < 2 {
            assert!(std::time::Instant::now() < deadline, "{transport:?}: pushes did not arrive");
            for id in client.poll_pushes(Duration::from_millis(10)).expect("poll") {
                client.finish_push(id, Duration::ZERO).expect("complete");
                done.push(id.0);
            }
        }
        for p in pushers {
            p.join().expect("pusher").expect("pushed");
        }
        done.sort();
        assert_eq!(done, vec![1, 2]);
        for id in 1..=2 {
            assert!(same_bytes(&server, &dst, &remote(id), &local_of(id)), "{transport:?}: push {id} bytes");
        }
        let mut released: Vec<u64> = rx.try_iter().map(|r| r.id.0).collect();
        released.sort();
        assert_eq!(released, vec![1, 2], "{transport:?}: COMPLETE ends the leases");
    }
}

#[test]
fn a_cancelled_push_writes_nothing_and_ends_the_lease() {
    for transport in [TransportKind::Tcp, TransportKind::Shm] {
        let (server, rx) = server();
        server.offer(TransferId(7), vec![BlockId(0), BlockId(1)]).expect("offer");
        let dst = local();
        let mut client = push_client(&server, transport, &dst);
        client.begin_push(TransferId(7), 1, &[BlockId(4), BlockId(5)]).expect("register");
        client.cancel_push(TransferId(7)).expect("cancel");
        // The reservation is gone: a push now fails and writes nothing.
        let err = server.push_offered(TransferId(7), 0..2, Duration::from_millis(100)).expect_err("no reservation");
        assert!(matches!(err, TransferError::Lease(_) | TransferError::Timeout { .. }), "{transport:?}: {err}");
        let mut zero = vec![0u8; dst.len()];
        dst.read(0, &mut zero).expect("read");
        assert!(zero.iter().all(|&b| b == 0), "{transport:?}: a cancelled push wrote into the reserved blocks");
        assert_eq!(rx.try_iter().map(|r| r.id.0).collect::<Vec<_>>(), vec![7], "{transport:?}");
        assert_eq!(server.live_leases(), 0);
        // The connection stays usable: cancelling again, or something never pushed, is fine.
        client.cancel_push(TransferId(7)).expect("idempotent");
        assert!(client.close(Duration::from_secs(2)), "the server closes its end too");
    }
}

#[test]
fn a_push_gives_up_when_its_lease_ends() {
    let (server, rx) = server();
    let server = Arc::new(server);
    server.offer(TransferId(3), vec![BlockId(2)]).expect("offer");
    let s = Arc::clone(&server);
    let started = std::time::Instant::now();
    let pusher = std::thread::spawn(move || s.push_offered(TransferId(3), 0..2, Duration::from_secs(30)));
    std::thread::sleep(Duration::from_millis(50));
    assert!(server.cancel(TransferId(3)));
    let err = pusher.join().expect("pusher").expect_err("no lease, no push");
    assert!(matches!(err, TransferError::Lease(_)), "{err}");
    assert!(started.elapsed() < Duration::from_secs(2), "the push noticed the lease end late");
    assert_eq!(rx.try_iter().count(), 1);
    // And a push with no lease at all fails at once.
    let err = server.push_offered(TransferId(99), 0..2, Duration::from_secs(30)).expect_err("unknown");
    assert!(matches!(err, TransferError::Lease(_)), "{err}");
}
