//! TLS on the KV plane: pulls and pushes over TLS move the same bytes as without it and none of
//! them in clear (a relay between the two sides records the wire), and a peer that does not
//! trust the server's certificate, or does not speak TLS, is refused with a reason, never hung.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc::channel;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_kv::{BlockId, KvDtype, KvGeometry, KvLayout, TensorDescriptor};
use baton_transfer::{
    ClientConfig, Compat, KvClient, KvServer, KvTls, PeerId, Region, ServerConfig, TransferError, TransferId,
    TransportKind,
};

fn geometry() -> KvGeometry {
    KvGeometry { dtype: KvDtype::F16, ..KvGeometry::new(2, 2, 4, 4) }
}

/// The server's bytes: a run 0, 1, …, 250 repeated, easy to spot on a wire.
fn pattern(i: usize) -> u8 {
    (i % 251) as u8
}

/// A self-signed certificate for 127.0.0.1 in a directory of its own; returns the TLS of a
/// worker that presents it and trusts it (as a cluster sharing one certificate does).
fn tls(name: &str) -> KvTls {
    let dir = std::env::temp_dir().join(format!("baton-kv-tls-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("test setup");
    let made =
        rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned(), "localhost".to_owned()]).expect("test setup");
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert, made.cert.pem()).expect("test setup");
    std::fs::write(&key, made.key_pair.serialize_pem()).expect("test setup");
    KvTls::from_pem_files(&cert, &key, &cert).expect("a TLS configuration")
}

fn server(tls: Option<&KvTls>) -> KvServer {
    let desc = TensorDescriptor::new(&geometry(), KvLayout::LayerMajor, 16);
    let region = Region::create(desc).expect("region");
    let bytes: Vec<u8> = (0..region.len()).map(pattern).collect();
    region.write(0, &bytes).expect("fill");
    let (tx, rx) = channel();
    // Releases are not looked at here; keep the receiver alive with the server.
    std::mem::forget(rx);
    let config = ServerConfig {
        tls: tls.map(|t| Arc::clone(&t.server)),
        handshake_timeout: Duration::from_secs(2),
        ..ServerConfig::new(PeerId(1), Compat::new("m", geometry()), "s3cret")
    };
    KvServer::start(config, region, tx).expect("server")
}

fn client_config(tls: Option<&KvTls>) -> ClientConfig {
    ClientConfig {
        transport: TransportKind::Tcp.into(),
        io_timeout: Duration::from_secs(2),
        tls: tls.map(|t| Arc::clone(&t.client)),
        ..ClientConfig::new(PeerId(2), Compat::new("m", geometry()), "s3cret")
    }
}

fn local() -> Arc<Region> {
    Arc::new(Region::create(TensorDescriptor::new(&geometry(), KvLayout::BlockMajor, 16)).expect("region"))
}

/// A TCP relay to `to` that records every byte going from `to` back to the client.
fn relay(to: SocketAddr) -> (SocketAddr, Arc<Mutex<Vec<u8>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("test setup");
    let addr = listener.local_addr().expect("test setup");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = Arc::clone(&seen);
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            let Ok(upstream) = TcpStream::connect(to) else { return };
            let (mut c_in, mut u_out) =
                (client.try_clone().expect("test setup"), upstream.try_clone().expect("test setup"));
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut c_in, &mut u_out);
                let _ = u_out.shutdown(std::net::Shutdown::Write);
            });
            let record = Arc::clone(&record);
            std::thread::spawn(move || {
                let (mut u_in, mut c_out) = (upstream, client);
                let mut buf = [0u8; 16 << 10];
                loop {
                    match u_in.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            record.lock().expect("test setup").extend_from_slice(&buf[..n]);
                            if c_out.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                    }
                }
                let _ = c_out.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    (addr, seen)
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

/// Pulls blocks 0..4 and pushes blocks 4..8 through a recording relay; returns what the relay
/// saw coming from the server.
fn pull_and_push(tls: Option<&KvTls>) -> Vec<u8> {
    let server = Arc::new(server(tls));
    let (addr, seen) = relay(server.addr());
    let dst = local();
    let mut client = KvClient::connect(addr, client_config(tls), Arc::clone(&dst)).expect("connect");
    let remote: Vec<BlockId> = (0..4).map(BlockId).collect();
    let mine: Vec<BlockId> = (8..12).map(BlockId).collect();
    server.offer(TransferId(1), remote.clone()).expect("offer");
    client.pull(TransferId(1), &remote, &mine).expect("pull");
    assert!(same_bytes(&server, &dst, &remote, &mine), "pulled bytes differ");

    // A push: the server's writes come from another thread than its connection's reader.
    let pushed: Vec<BlockId> = (4..8).map(BlockId).collect();
    let into: Vec<BlockId> = (12..16).map(BlockId).collect();
    server.offer(TransferId(2), pushed.clone()).expect("offer");
    let pusher = {
        let s = Arc::clone(&server);
        std::thread::spawn(move || s.push_offered(TransferId(2), 0..2, Duration::from_secs(5)))
    };
    client.begin_push(TransferId(2), 1, &into).expect("register");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        assert!(Instant::now() < deadline, "the push did not arrive");
        if client.poll_pushes(Duration::from_millis(10)).expect("poll").contains(&TransferId(2)) {
            break;
        }
    }
    client.finish_push(TransferId(2), Duration::ZERO).expect("complete");
    pusher.join().expect("test setup").expect("pushed");
    assert!(same_bytes(&server, &dst, &pushed, &into), "pushed bytes differ");
    assert_eq!(server.live_leases(), 0);
    seen.lock().expect("test setup").clone()
}

/// Whether `wire` holds 64 consecutive bytes of the server's pattern.
fn shows_kv(wire: &[u8]) -> bool {
    let run: Vec<u8> = (100..164).map(pattern).collect();
    wire.windows(run.len()).any(|w| w == run.as_slice())
}

#[test]
fn pulls_and_pushes_over_tls_move_the_same_bytes_and_none_in_clear() {
    let clear = pull_and_push(None);
    assert!(shows_kv(&clear), "without TLS the relay sees the KV bytes ({} bytes seen)", clear.len());
    let tls = tls("both");
    let hidden = pull_and_push(Some(&tls));
    assert!(hidden.len() > 4 * 1024, "the transfers went through the relay ({} bytes)", hidden.len());
    assert!(!shows_kv(&hidden), "TLS leaves KV bytes readable on the wire");
}

#[test]
fn a_peer_that_does_not_trust_the_certificate_or_speak_tls_is_refused() {
    let tls = tls("server");
    let server = server(Some(&tls));
    // A client trusting another certificate (its own): refused, and told why.
    let stranger = self::tls("stranger");
    let err = KvClient::connect(server.addr(), client_config(Some(&stranger)), local()).expect_err("untrusted");
    assert!(matches!(&err, TransferError::Tls(m) if m.contains("certificate")), "{err}");
    // A client without TLS: its CONNECT is no TLS hello; it gets an error, within its timeout.
    let start = Instant::now();
    let err = KvClient::connect(server.addr(), client_config(None), local()).expect_err("plaintext");
    assert!(start.elapsed() < Duration::from_secs(5), "a plaintext client waited {:?}", start.elapsed());
    eprintln!("plaintext client: {err}");
    // A TLS client against a server without TLS: refused too.
    let plain = self::server(None);
    let err = KvClient::connect(plain.addr(), client_config(Some(&tls)), local()).expect_err("no TLS there");
    assert!(matches!(err, TransferError::Tls(_)), "{err}");
    // The TLS server still serves a client that trusts it.
    let mut client = KvClient::connect(server.addr(), client_config(Some(&tls)), local()).expect("trusted");
    server.offer(TransferId(7), vec![BlockId(3)]).expect("offer");
    client.pull(TransferId(7), &[BlockId(3)], &[BlockId(0)]).expect("pull");
}
