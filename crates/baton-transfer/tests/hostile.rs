//! The KV server against hostile or broken peers, before they authenticate: a peer trickling its
//! handshake a byte at a time is cut off at the handshake deadline; a CONNECT declaring megabytes
//! of metadata is refused before anything is allocated for it; a flood of idle connections holds
//! a bounded number of threads (`tests/flood.rs`, a process of its own to count its threads).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use baton_transfer::frame::{HEADER_LEN, MAGIC, VERSION};

mod common;
use common::guarded_server as server;

/// Reads until the server closes the connection; `false` if it still holds it after `limit`
/// (a bound on a hang, far beyond the server's 300 ms handshake deadline).
fn closed_by_server(stream: &mut TcpStream, limit: Duration) -> bool {
    stream.set_read_timeout(Some(limit)).expect("timeout");
    let mut buf = [0u8; 256];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {} // an ERROR frame before the close
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return false;
            }
            Err(_) => return true, // reset
        }
    }
}

fn header(kind: u8, meta_len: u32) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4..6].copy_from_slice(&VERSION.to_le_bytes());
    h[6] = kind;
    h[8..12].copy_from_slice(&meta_len.to_le_bytes());
    h
}

#[test]
fn a_peer_trickling_its_handshake_is_cut_off_at_the_deadline() {
    let (server, _rx) = server();
    let mut stream = TcpStream::connect(server.addr()).expect("connect");
    let mut writer = stream.try_clone().expect("clone");
    // One byte every 100 ms: each read is quick, the handshake never ends (a per-read timeout
    // alone would hold the connection, and its thread, forever).
    let trickle = std::thread::spawn(move || {
        for b in header(1, 300).iter().cycle().take(200) {
            if writer.write_all(&[*b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    assert!(closed_by_server(&mut stream, Duration::from_secs(10)), "the trickling peer was not cut off");
    trickle.join().expect("joins");
}

#[test]
fn a_connect_declaring_megabytes_of_metadata_is_refused_unread() {
    let (server, _rx) = server();
    let mut stream = TcpStream::connect(server.addr()).expect("connect");
    // 16 MiB declared (the protocol's cap after authentication); nothing follows.
    stream.write_all(&header(1, 16 << 20)).expect("write");
    assert!(closed_by_server(&mut stream, Duration::from_secs(10)), "the server waited for 16 MiB");
}
