//! Unauthenticated peers cannot take the handshake slots from the members: a flood from one
//! address holds at most that address's share. (A file of its own: `flood.rs` counts its
//! process's threads.)

use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use baton_kv::{BlockId, KvLayout, TensorDescriptor};
use baton_transfer::{ClientConfig, Compat, KvClient, PeerId, Region, TransferId};

mod common;
use common::{geometry, guarded_server as server};

/// A connection to `server` from `ip` (any of 127.0.0.0/8 on Linux's loopback).
fn connect_from(ip: [u8; 4], server: std::net::SocketAddr) -> std::io::Result<TcpStream> {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    socket.bind(&std::net::SocketAddr::from((ip, 0)).into())?;
    socket.connect(&server.into())?;
    Ok(socket.into())
}

/// Unauthenticated peers cannot hold the handshake slots the members need (#37, item 5: 300
/// reconnecting connections made 14 of 14 hand-offs fail and recompute). A flood from one
/// address, reconnecting as fast as it can and sending nothing, holds at most that address's
/// share of the handshake slots; a member from another address connects and pulls every time.
#[test]
fn a_flood_from_one_address_leaves_handshake_slots_for_the_others() {
    let (server, rx) = server();
    let addr = server.addr();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flooders: Vec<_> = (0..4)
        .map(|_| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut held = std::collections::VecDeque::new();
                let mut reconnects = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Ok(s) = connect_from([127, 0, 0, 2], addr) {
                        held.push_back(s);
                        reconnects += 1;
                    }
                    if held.len() > 75 {
                        held.pop_front();
                    }
                }
                reconnects
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let dst = Arc::new(Region::create(TensorDescriptor::new(&geometry(), KvLayout::BlockMajor, 16)).expect("r"));
    let mut config = ClientConfig::new(PeerId(2), Compat::new("m", geometry()), "s3cret");
    config.transport = baton_transfer::TransportChoice::Tcp;
    for round in 0..10u64 {
        server.offer(TransferId(round), vec![BlockId(0), BlockId(1)]).expect("offer");
        let mut client = KvClient::connect(addr, config.clone(), Arc::clone(&dst))
            .unwrap_or_else(|e| panic!("round {round}: a member could not connect under the flood: {e}"));
        client.pull(TransferId(round), &[BlockId(0), BlockId(1)], &[BlockId(3), BlockId(4)]).expect("pull");
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).expect("released").id, TransferId(round));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let reconnects: u64 = flooders.into_iter().map(|t| t.join().expect("flooder")).sum();
    println!("{reconnects} flood connections while 10 members connected and pulled");
    assert!(reconnects > 100, "the flood was too weak to mean anything: {reconnects}");
}
