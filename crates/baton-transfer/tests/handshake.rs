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
    c.transport = TransportKind::Tcp;
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
