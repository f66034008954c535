//! A flood of 200 idle and garbage connections to a KV server holds a bounded number of threads
//! (at most its handshake cap; the rest are closed at accept), and once the flood's handshakes
//! time out a real peer connects and pulls. In a process of its own, to count its threads.

use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use baton_kv::{BlockId, KvLayout, TensorDescriptor};
use baton_transfer::{ClientConfig, Compat, KvClient, PeerId, Region, TransferId};

mod common;
use common::{geometry, guarded_server as server};

/// Threads of this process (Linux).
fn threads() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status.lines().find_map(|l| l.strip_prefix("Threads:")).and_then(|n| n.trim().parse().ok()).expect("Threads:")
}

#[test]
fn a_flood_of_idle_and_garbage_connections_holds_few_threads_and_the_server_still_serves() {
    let (server, rx) = server();
    let before = threads();
    let mut flood = Vec::new();
    for i in 0..200 {
        let Ok(mut s) = TcpStream::connect(server.addr()) else { continue };
        if i % 2 == 1 {
            let _ = s.write_all(b"GET / HTTP/1.1\r\nHost: kv\r\n\r\n"); // garbage
        }
        flood.push(s);
    }
    std::thread::sleep(Duration::from_millis(100));
    let during = threads();
    println!("threads: {before} before the flood, {during} during it (200 connections)");
    assert!(during <= before + 8, "{during} threads for 200 unauthenticated connections (cap 8 + 0)");
    // The flood's handshakes time out (300 ms); then a real peer connects and pulls.
    std::thread::sleep(Duration::from_millis(500));
    drop(flood);
    let dst = Arc::new(Region::create(TensorDescriptor::new(&geometry(), KvLayout::BlockMajor, 16)).expect("r"));
    server.offer(TransferId(7), vec![BlockId(0), BlockId(1)]).expect("offer");
    let mut config = ClientConfig::new(PeerId(2), Compat::new("m", geometry()), "s3cret");
    config.transport = baton_transfer::TransportChoice::Tcp;
    let mut client = None;
    for _ in 0..50 {
        // (A connection may still find the handshake slots full while the flood drains.)
        match KvClient::connect(server.addr(), config.clone(), Arc::clone(&dst)) {
            Ok(c) => {
                client = Some(c);
                break;
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
    let mut client = client.expect("a real peer connects after the flood");
    client.pull(TransferId(7), &[BlockId(0), BlockId(1)], &[BlockId(3), BlockId(4)]).expect("pull");
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)).expect("released").id, TransferId(7));
    println!("threads after: {}", threads());
}
