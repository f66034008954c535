//! Unauthenticated peers cannot take the handshake slots from the members: a flood from one
//! address holds at most that address's share of the strangers' slots, and none of the
//! members', even from a member's own address. (A file of its own: `flood.rs` counts its
//! process's threads.)

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use baton_kv::{BlockId, KvLayout, TensorDescriptor};
use baton_transfer::{ClientConfig, Compat, KvClient, PeerId, Region, TransferId};

mod common;
use common::{geometry, guarded_server as server};

/// A connection to `server` from `ip` (any of 127.0.0.0/8 on Linux's loopback).
fn connect_from(ip: [u8; 4], server: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    socket.bind(&SocketAddr::from((ip, 0)).into())?;
    socket.connect(&server.into())?;
    Ok(socket.into())
}

/// A stranger's ticket: the right magic and version, a proof of nothing (written out by hand,
/// so the flood is the same against a server that knows no tickets).
fn forged_ticket() -> [u8; 64] {
    let mut t = [0x5A; 64];
    t[..6].copy_from_slice(b"BTKM\x01\x00");
    t
}

/// Four threads connecting to `addr` from `ip` as fast as they can, each keeping its latest 75
/// connections open (300 in all); thread `f` opens each connection with a forged ticket when
/// `forges(f)`, the others send nothing. They stop at `stop`, after 30 s, or at 200,000
/// connections each; each returns how many it made.
fn flood(ip: [u8; 4], addr: SocketAddr, stop: &Arc<AtomicBool>, forges: fn(u64) -> bool) -> Vec<JoinHandle<u64>> {
    let started = Instant::now();
    (0..4)
        .map(|f| {
            let stop = Arc::clone(stop);
            std::thread::spawn(move || {
                let mut held = std::collections::VecDeque::new();
                let mut reconnects = 0u64;
                while !stop.load(Ordering::Relaxed)
                    && reconnects < 200_000
                    && started.elapsed() < Duration::from_secs(30)
                {
                    if let Ok(mut s) = connect_from(ip, addr) {
                        if forges(f) {
                            let _ = s.write_all(&forged_ticket());
                        }
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
        .collect()
}

/// Stops a flood and says how many connections it made.
fn stop_flood(stop: &AtomicBool, flooders: Vec<JoinHandle<u64>>) -> u64 {
    stop.store(true, Ordering::Relaxed);
    flooders.into_iter().map(|t| t.join().expect("flooder")).sum()
}

fn member_config() -> ClientConfig {
    let mut config = ClientConfig::new(PeerId(2), Compat::new("m", geometry()), "s3cret");
    config.transport = baton_transfer::TransportChoice::Tcp;
    config
}

fn destination() -> Arc<Region> {
    Arc::new(Region::create(TensorDescriptor::new(&geometry(), KvLayout::BlockMajor, 16)).expect("r"))
}

/// Unauthenticated peers cannot hold the handshake slots the members need (#37, item 5: 300
/// reconnecting connections made 14 of 14 hand-offs fail and recompute). A flood from one
/// address, reconnecting as fast as it can and sending nothing, holds at most that address's
/// share of the handshake slots; a member from another address connects and pulls every time.
#[test]
fn a_flood_from_one_address_leaves_handshake_slots_for_the_others() {
    let (server, rx) = server();
    let addr = server.addr();
    let stop = Arc::new(AtomicBool::new(false));
    let flooders = flood([127, 0, 0, 2], addr, &stop, |_| false);
    std::thread::sleep(Duration::from_millis(200));
    let dst = destination();
    for round in 0..10u64 {
        server.offer(TransferId(round), vec![BlockId(0), BlockId(1)]).expect("offer");
        let mut client = KvClient::connect(addr, member_config(), Arc::clone(&dst))
            .unwrap_or_else(|e| panic!("round {round}: a member could not connect under the flood: {e}"));
        client.pull(TransferId(round), &[BlockId(0), BlockId(1)], &[BlockId(3), BlockId(4)]).expect("pull");
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).expect("released").id, TransferId(round));
    }
    let reconnects = stop_flood(&stop, flooders);
    println!("{reconnects} flood connections while 10 members connected and pulled");
    assert!(reconnects > 100, "the flood was too weak to mean anything: {reconnects}");
}

/// Members are never starved by strangers sharing their address (#63, item 4: 300 reconnecting
/// connections from 127.0.0.1, the decode worker's own address, made 20 of 20 hand-offs fail
/// and recompute; per-address slots protect only other addresses). Four flooders on 127.0.0.1
/// keep up to 300 connections open, reconnecting as fast as they can: three send nothing, one
/// opens each connection with a forged ticket (a stranger's, which then holds a stranger slot
/// until the handshake deadline, 5 s as in a worker); 8 idle and 8 forged connections stay open
/// throughout (so the slots are held whatever pace the churn keeps on a busy machine); a
/// member on 127.0.0.1 connects and pulls every time.
#[test]
fn a_flood_from_the_members_own_address_leaves_the_members_their_slots() {
    let (server, rx) = common::guarded_server_with(Duration::from_secs(5));
    let addr = server.addr();
    let stop = Arc::new(AtomicBool::new(false));
    let flooders = flood([127, 0, 0, 1], addr, &stop, |f| f == 0);
    // Besides the churn, connections that stay: idle ones first (they hold a server's slots
    // when slots go by address alone), then forged tickets (they hold the strangers' slots).
    let mut held = Vec::new();
    for forged in [false, true] {
        for _ in 0..8 {
            let mut s = connect_from([127, 0, 0, 1], addr).expect("connect");
            if forged {
                s.write_all(&forged_ticket()).expect("write");
            }
            held.push(s);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let dst = destination();
    let mut failed = Vec::new();
    for round in 0..20u64 {
        server.offer(TransferId(round), vec![BlockId(0), BlockId(1)]).expect("offer");
        let pulled = KvClient::connect(addr, member_config(), Arc::clone(&dst))
            .and_then(|mut c| c.pull(TransferId(round), &[BlockId(0), BlockId(1)], &[BlockId(3), BlockId(4)]));
        match pulled {
            Ok(_) => assert_eq!(rx.recv_timeout(Duration::from_secs(5)).expect("released").id, TransferId(round)),
            Err(e) => {
                failed.push(format!("round {round}: {e}"));
                server.cancel(TransferId(round));
            }
        }
    }
    drop(held);
    let reconnects = stop_flood(&stop, flooders);
    println!("{reconnects} flood connections from 127.0.0.1 while 20 members from 127.0.0.1 connected and pulled");
    assert!(failed.is_empty(), "{} of 20 hand-offs failed under the flood: {failed:?}", failed.len());
    assert!(reconnects > 100, "the flood was too weak to mean anything: {reconnects}");
}
