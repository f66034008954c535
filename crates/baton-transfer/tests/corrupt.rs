//! KV bytes damaged on the wire never land as KV (#63, item 3): a relay between a decode side
//! and a KV server flips one byte in the middle of every payload the server sends. Each DATA
//! and WRITE carries a CRC-32C per range, so the pull and the push fail with
//! `TransferError::Corrupt` naming the damaged blocks (the worker then recomputes them), while
//! the same transfers through the relay with nothing flipped arrive intact.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use baton_kv::{BlockId, KvLayout, TensorDescriptor};
use baton_transfer::{ClientConfig, Compat, KvClient, PeerId, Region, TransferError, TransferId};

mod common;
mod relay;
use common::{geometry, guarded_server as server};

fn relay_to(server: SocketAddr, flip: &Arc<AtomicBool>) -> SocketAddr {
    relay::flipping_relay(SocketAddr::from(([127, 0, 0, 1], 0)), server, Arc::clone(flip))
}

/// A block's bytes in its canonical order (the same in every layout).
fn block_bytes(region: &Region, block: BlockId) -> Vec<u8> {
    let mut out = Vec::new();
    for r in region.descriptor().byte_ranges(&[block]) {
        let mut b = vec![0u8; r.len];
        region.read(r.offset, &mut b).expect("read");
        out.extend(b);
    }
    out
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + 3) as u8).collect()
}

#[test]
fn a_pull_whose_bytes_are_damaged_on_the_wire_fails_as_corrupt() {
    let (server, _rx) = server();
    let bytes = server.region().len();
    server.region().write(0, &pattern(bytes)).expect("fill");
    let flip = Arc::new(AtomicBool::new(false));
    let relay = relay_to(server.addr(), &flip);
    let dst = Arc::new(Region::create(TensorDescriptor::new(&geometry(), KvLayout::BlockMajor, 16)).expect("r"));
    let config = ClientConfig::new(PeerId(2), Compat::new("m", geometry()), "s3cret");
    let (src, local) = ([BlockId(0), BlockId(1), BlockId(2)], [BlockId(5), BlockId(6), BlockId(7)]);

    server.offer(TransferId(1), src.to_vec()).expect("offer");
    let mut client = KvClient::connect(relay, config.clone(), Arc::clone(&dst)).expect("connect");
    client.pull(TransferId(1), &src, &local).expect("an undamaged pull through the relay");
    for (s, d) in src.iter().zip(&local) {
        assert_eq!(block_bytes(server.region(), *s), block_bytes(&dst, *d), "block {s:?} arrived as sent");
    }

    flip.store(true, Ordering::Relaxed);
    server.offer(TransferId(2), src.to_vec()).expect("offer");
    match client.pull(TransferId(2), &src, &local) {
        Err(TransferError::Corrupt { id, blocks, .. }) => {
            assert_eq!(id, TransferId(2));
            assert!((1..=3).contains(&blocks), "{blocks} damaged blocks");
        }
        other => panic!("a damaged pull must fail as corrupt, got {other:?}"),
    }
}

#[test]
fn a_push_whose_bytes_are_damaged_on_the_wire_fails_as_corrupt() {
    let (server, _rx) = server();
    let bytes = server.region().len();
    server.region().write(0, &pattern(bytes)).expect("fill");
    let server = Arc::new(server);
    let flip = Arc::new(AtomicBool::new(true));
    let relay = relay_to(server.addr(), &flip);
    let dst = Arc::new(Region::create(TensorDescriptor::new(&geometry(), KvLayout::BlockMajor, 16)).expect("r"));
    let config = ClientConfig::new(PeerId(2), Compat::new("m", geometry()), "s3cret");
    let mut client = KvClient::connect(relay, config, Arc::clone(&dst)).expect("connect");
    let (src, local) = ([BlockId(0), BlockId(1)], [BlockId(8), BlockId(9)]);
    client.begin_push(TransferId(3), 1, &local).expect("register");
    let pusher = {
        let server = Arc::clone(&server);
        std::thread::spawn(move || server.push(TransferId(3), &src, 0..2, Duration::from_secs(5)))
    };
    match client.finish_push(TransferId(3), Duration::from_secs(5)) {
        Err(TransferError::Corrupt { id, blocks, .. }) => {
            assert_eq!(id, TransferId(3));
            assert!((1..=2).contains(&blocks), "{blocks} damaged blocks");
        }
        other => panic!("a damaged push must fail as corrupt, got {other:?}"),
    }
    drop(client);
    let _ = pusher.join().expect("the pusher ends");
}
