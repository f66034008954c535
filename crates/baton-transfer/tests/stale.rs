//! A late write of an aborted push never lands in blocks reserved since (generations).
//!
//! The prefill side here is a scripted peer speaking the protocol by hand, so the late frame
//! arrives exactly when the bug would bite: after the decode side withdrew the push, reused its
//! blocks under the same transfer id, and wrote new contents into them.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use baton_kv::{BlockId, ByteRange, KvDtype, KvGeometry, KvLayout, KvPart, TensorDescriptor};
use baton_transfer::auth::{self, Side};
use baton_transfer::frame::{HEADER_LEN, Header};
use baton_transfer::{ClientConfig, Compat, EndpointInfo, Frame, KvClient, PeerId, Region, TransferId, TransferMode};

const SECRET: &str = "s3cret";

fn geometry() -> KvGeometry {
    KvGeometry { dtype: KvDtype::F16, ..KvGeometry::new(2, 2, 4, 4) }
}

fn recv(s: &mut TcpStream) -> Frame {
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h).expect("header");
    let header = Header::decode(&h).expect("decode header");
    let mut meta = vec![0u8; header.meta_len];
    s.read_exact(&mut meta).expect("meta");
    Frame::decode(&header, &meta).expect("decode")
}

/// The checksums of a WRITE of 64 bytes of `byte`.
fn sums(byte: u8) -> Vec<u32> {
    baton_transfer::frame::range_sums(&[&[byte; 64]])
}

fn send(s: &mut TcpStream, frame: &Frame, payload: &[u8]) {
    s.write_all(&frame.encode()).expect("send");
    s.write_all(payload).expect("payload");
}

/// The peer's side of the handshake: answers CONNECT and AUTH as a KV server would.
fn accept(s: &mut TcpStream) {
    let mut ticket = [0u8; auth::TICKET_LEN];
    s.read_exact(&mut ticket).expect("the member ticket");
    assert!(matches!(auth::check_ticket(SECRET.as_bytes(), &ticket), auth::TicketCheck::Valid { .. }));
    let Frame::Connect { nonce: client_nonce, .. } = recv(s) else { panic!("expected CONNECT") };
    let server_nonce = auth::nonce();
    let proof = auth::proof(SECRET.as_bytes(), Side::Server, &client_nonce, &server_nonce);
    send(s, &Frame::Challenge { nonce: server_nonce, proof }, &[]);
    assert!(matches!(recv(s), Frame::Auth { .. }));
    let compat = Compat::new("m", geometry());
    let descriptor = TensorDescriptor::new(&geometry(), KvLayout::LayerMajor, 16);
    let info = EndpointInfo {
        peer: PeerId(1),
        compat_hash: compat.hash(),
        compat,
        region_len: (descriptor.num_elems() * 2) as u64,
        descriptor,
        reach: baton_transfer::Reach::default(),
    };
    send(s, &Frame::Accept { info }, &[]);
}

#[test]
fn a_late_write_of_an_aborted_push_is_refused_and_the_reused_blocks_keep_their_contents() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let local = Arc::new(Region::create(TensorDescriptor::new(&geometry(), KvLayout::BlockMajor, 16)).expect("region"));
    let blocks = [BlockId(3)];
    // The bytes of block 3's first slab on the decode side.
    let desc = local.descriptor();
    let slab = ByteRange { offset: desc.offset(0, KvPart::Key, 3, 0, 0) * 2, len: 64 };
    let (go_on, wait) = std::sync::mpsc::channel::<()>();
    let id = TransferId(42);

    let peer = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        accept(&mut s);
        // The client's data connections (for reads, unused by a push) are accepted and kept.
        std::thread::spawn(move || {
            let mut data = Vec::new();
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { break };
                accept(&mut stream);
                data.push(stream);
            }
        });
        // The first push registers (generation 1) and is withdrawn before anything is written.
        let Frame::Transfer { id: got, mode: TransferMode::Push, generation: 1, .. } = recv(&mut s) else {
            panic!("expected the first registration")
        };
        send(&mut s, &Frame::TransferOk { id: got }, &[]);
        assert!(matches!(recv(&mut s), Frame::Complete { .. }));
        send(&mut s, &Frame::CompleteAck { id: got }, &[]);
        // The same request registers the same blocks again (generation 2).
        let Frame::Transfer { generation: 2, .. } = recv(&mut s) else { panic!("expected the second registration") };
        send(&mut s, &Frame::TransferOk { id: got }, &[]);
        // A write of the first push arrives late: it must be refused.
        send(
            &mut s,
            &Frame::Write { id: got, generation: 1, ranges: vec![slab], payload_len: 64, sums: sums(0xAA) },
            &[0xAA; 64],
        );
        send(
            &mut s,
            &Frame::Pushed {
                id: got,
                generation: 1,
                layers_done: 2,
                done: true,
                trailer: Vec::new(),
                via: baton_transfer::TransportKind::Tcp,
            },
            &[],
        );
        wait.recv().expect("go on");
        // Then the live push writes and finishes.
        send(
            &mut s,
            &Frame::Write { id: got, generation: 2, ranges: vec![slab], payload_len: 64, sums: sums(0xBB) },
            &[0xBB; 64],
        );
        send(
            &mut s,
            &Frame::Pushed {
                id: got,
                generation: 2,
                layers_done: 2,
                done: true,
                trailer: Vec::new(),
                via: baton_transfer::TransportKind::Tcp,
            },
            &[],
        );
        assert!(matches!(recv(&mut s), Frame::Complete { .. }));
        send(&mut s, &Frame::CompleteAck { id: got }, &[]);
        s
    });

    let mut config = ClientConfig::new(PeerId(2), Compat::new("m", geometry()), SECRET);
    config.io_timeout = Duration::from_secs(5);
    config.transport = baton_transfer::TransportChoice::Tcp;
    let mut client = KvClient::connect(addr, config, Arc::clone(&local)).expect("connect");
    client.begin_push(id, 1, &blocks).expect("first registration");
    client.cancel_push(id).expect("withdrawn");
    client.begin_push(id, 2, &blocks).expect("second registration");
    // The decode side wrote its new contents meanwhile (nothing of the live push is in yet).
    local.write(slab.offset, &[0x11; 64]).expect("write");

    // The stale WRITE and PUSHED come first: refused, the connection stays usable, the push is
    // not reported done by them, and the new contents are intact.
    for _ in 0..50 {
        assert!(
            client.poll_pushes(Duration::from_millis(100)).expect("poll").is_empty(),
            "a stale PUSHED ended the push"
        );
        if client.stale_writes() == 1 {
            break;
        }
    }
    assert_eq!(client.stale_writes(), 1, "the stale write was not seen");
    assert_eq!(client.pushed_layers(id), Some(0));
    let mut now = [0u8; 64];
    local.read(slab.offset, &mut now).expect("read");
    assert_eq!(now, [0x11; 64], "a stale write landed in the reused block");
    go_on.send(()).expect("peer");
    let mut seen = Vec::new();
    for _ in 0..50 {
        seen = client.poll_pushes(Duration::from_millis(100)).expect("poll");
        if !seen.is_empty() {
            break;
        }
    }
    assert_eq!(client.stale_writes(), 1);
    assert_eq!(seen, vec![id]);
    let stats = client.finish_push(id, Duration::from_secs(5)).expect("complete");
    assert_eq!(stats.bytes, 64, "only the live push's bytes count");
    let mut now = [0u8; 64];
    local.read(slab.offset, &mut now).expect("read");
    assert_eq!(now, [0xBB; 64], "the live push's write landed");
    drop(peer.join().expect("peer"));
}

/// A server that closes the connection (it restarted, or its host went down cleanly) is seen
/// gone by an idle client at once, without a transfer to fail first: its owner then drops it
/// and the next transfer connects afresh.
#[test]
fn a_client_sees_a_server_that_closed_its_connection_gone() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let local = Arc::new(Region::create(TensorDescriptor::new(&geometry(), KvLayout::BlockMajor, 16)).expect("region"));
    let (close, closing) = std::sync::mpsc::channel::<()>();
    let peer = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        accept(&mut s);
        // Data connections, if any, accepted and kept until the control one closes.
        let mut data = Vec::new();
        listener.set_nonblocking(true).expect("nonblocking");
        while closing.try_recv().is_err() {
            if let Ok((mut stream, _)) = listener.accept() {
                stream.set_nonblocking(false).expect("blocking");
                accept(&mut stream);
                data.push(stream);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        drop(s);
        data
    });
    let mut config = ClientConfig::new(PeerId(2), Compat::new("m", geometry()), SECRET);
    config.io_timeout = Duration::from_secs(5);
    config.transport = baton_transfer::TransportChoice::Tcp;
    let client = KvClient::connect(addr, config, local).expect("connect");
    assert!(!client.peer_gone(), "a live server");
    close.send(()).expect("close");
    let _data = peer.join().expect("peer");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !client.peer_gone() {
        assert!(std::time::Instant::now() < deadline, "the closed connection went unseen");
        std::thread::sleep(Duration::from_millis(5));
    }
}
