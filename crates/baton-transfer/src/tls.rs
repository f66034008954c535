//! TLS on the KV plane: rustls over the crate's blocking sockets.
//!
//! A connection of this crate is read by one thread and written by another (the prefill side's
//! connection thread reads READs while pushes write from the engine's side), and every socket
//! call is bounded by the socket's timeouts. `Session` keeps that shape: the rustls state sits
//! behind a lock shared by the handles of one connection, the socket is read *outside* the lock
//! (a reader waiting for bytes never stalls a writer), and what arrives is handed to rustls under
//! it. A writer encrypts and sends under the lock, in slices of `WRITE_SLICE` bytes, so a large
//! payload is never buffered whole.
//!
//! The cluster secret's proofs still run inside TLS: TLS hides and protects the bytes and checks
//! the server's certificate, the secret proves both sides belong to the cluster.

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// Plaintext encrypted and sent per lock hold (a writer holds the lock while the socket takes
/// the bytes; the reader only needs it to hand over what it received).
const WRITE_SLICE: usize = 256 << 10;

/// Bytes read from the socket per call.
const READ_CHUNK: usize = 64 << 10;

/// TLS for a worker's KV plane: its own certificate for the server side, the certificates it
/// trusts for the client side. Peers are checked by the address they are reached at, so a
/// worker's certificate must name the address it advertises (an IP SAN, or the host name).
#[derive(Clone)]
pub struct KvTls {
    /// The KV server's side.
    pub server: Arc<rustls::ServerConfig>,
    /// The KV client's side.
    pub client: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for KvTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KvTls")
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl KvTls {
    /// From PEM files: a certificate chain and its private key (what this worker presents), and
    /// the certificates to trust in peers (a CA, or a certificate the cluster shares).
    pub fn from_pem_files(cert: &Path, key: &Path, trust: &Path) -> Result<Self, String> {
        let mut server = server_config(cert, key)?;
        // No resumption: connections are few and long-lived, and a ticket would be a
        // post-handshake message on a connection whose reader waits for frames.
        server.send_tls13_tickets = 0;
        let mut roots = rustls::RootCertStore::empty();
        for c in certificates(trust)? {
            roots.add(c).map_err(|e| format!("{} holds a certificate that cannot be trusted: {e}", trust.display()))?;
        }
        let client = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("no TLS configuration: {e}"))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Self { server: Arc::new(server), client: Arc::new(client) })
    }
}

/// A TLS server's configuration from PEM files: a certificate chain and its private key
/// (PKCS#8, PKCS#1 or SEC1). TLS 1.2 and 1.3, rustls with *ring*, no client certificates. Every
/// Baton server that speaks TLS (the APIs and the KV plane) starts from this.
pub fn server_config(cert: &Path, key: &Path) -> Result<rustls::ServerConfig, String> {
    let chain = certificates(cert)?;
    let key =
        PrivateKeyDer::from_pem_file(key).map_err(|e| format!("reading the private key {}: {e}", key.display()))?;
    rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .and_then(|b| b.with_no_client_auth().with_single_cert(chain, key))
        .map_err(|e| format!("the certificate and key do not make a TLS configuration: {e}"))
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("reading the certificates {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{} holds no PEM certificate", path.display()));
    }
    Ok(certs)
}

struct State {
    conn: rustls::Connection,
    /// Bytes received and not yet taken by rustls.
    raw: Vec<u8>,
}

/// One TLS connection's state, shared by the handles on its socket (see the module docs).
#[derive(Clone)]
pub(crate) struct Session {
    state: Arc<Mutex<State>>,
    /// What a read takes from the socket, outside `state`'s lock (one reader a connection, so
    /// never contended), kept between reads.
    chunk: Arc<Mutex<Vec<u8>>>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Session")
    }
}

fn tls_error(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

impl Session {
    /// The client's side of a handshake with the server at `name`, over `sock`, done by
    /// `deadline` however slowly the peer answers.
    pub(crate) fn client(
        config: Arc<rustls::ClientConfig>,
        name: ServerName<'static>,
        sock: &TcpStream,
        deadline: Instant,
    ) -> io::Result<Self> {
        let conn = rustls::ClientConnection::new(config, name).map_err(tls_error)?;
        Self::handshake(rustls::Connection::Client(conn), sock, deadline)
    }

    /// The server's side of a handshake over `sock`, done by `deadline`.
    pub(crate) fn server(config: Arc<rustls::ServerConfig>, sock: &TcpStream, deadline: Instant) -> io::Result<Self> {
        let conn = rustls::ServerConnection::new(config).map_err(tls_error)?;
        Self::handshake(rustls::Connection::Server(conn), sock, deadline)
    }

    fn handshake(mut conn: rustls::Connection, sock: &TcpStream, deadline: Instant) -> io::Result<Self> {
        conn.set_buffer_limit(None);
        let mut s = sock;
        while conn.is_handshaking() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "the TLS handshake did not end in time"));
            }
            sock.set_read_timeout(Some(left))?;
            let r = conn.complete_io(&mut s);
            // An alert telling the peer why (a certificate it does not trust) goes out too.
            while conn.wants_write() {
                if conn.write_tls(&mut s).is_err() {
                    break;
                }
            }
            match r {
                Ok((0, 0)) if conn.is_handshaking() => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the peer closed during the TLS handshake",
                    ));
                }
                Ok(_) => {}
                Err(e) => return Err(e),
            }
        }
        let state = Arc::new(Mutex::new(State { conn, raw: Vec::new() }));
        Ok(Self { state, chunk: Arc::new(Mutex::new(vec![0; READ_CHUNK])) })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Decrypted bytes ready to read, after handing rustls what was received.
    pub(crate) fn buffered(&self) -> io::Result<usize> {
        let mut st = self.lock();
        feed(&mut st)?;
        Ok(st.conn.process_new_packets().map_err(tls_error)?.plaintext_bytes_to_read())
    }

    /// Reads plaintext into `buf`, reading `sock` (within its timeouts) while none is ready.
    pub(crate) fn read(&self, sock: &TcpStream, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let mut chunk = self.chunk.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            {
                let mut st = self.lock();
                match st.conn.reader().read(buf) {
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
                feed(&mut st)?;
                match st.conn.reader().read(buf) {
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
            }
            // Outside the lock: a writer on another thread goes on meanwhile.
            let n = (&mut &*sock).read(&mut chunk[..])?;
            let mut st = self.lock();
            if n == 0 {
                // End of stream: rustls tells a clean close (close_notify) from a cut one.
                st.conn.read_tls(&mut io::empty())?;
                st.conn.process_new_packets().map_err(tls_error)?;
                return match st.conn.reader().read(buf) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
                    r => r,
                };
            }
            st.raw.extend_from_slice(&chunk[..n]);
        }
    }

    /// Encrypts and sends up to [`WRITE_SLICE`] bytes of `bufs`; returns how many were taken.
    pub(crate) fn write_vectored(&self, sock: &TcpStream, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let mut st = self.lock();
        let mut taken = 0;
        for b in bufs {
            if taken >= WRITE_SLICE {
                break;
            }
            let n = b.len().min(WRITE_SLICE - taken);
            st.conn.writer().write_all(&b[..n])?;
            taken += n;
        }
        flush(&mut st, sock)?;
        Ok(taken)
    }

    /// Tells the peer this side sends nothing more (a TLS close_notify).
    pub(crate) fn close_notify(&self, sock: &TcpStream) {
        let mut st = self.lock();
        st.conn.send_close_notify();
        // The peer may be gone already.
        let _ = flush(&mut st, sock);
    }
}

/// Hands rustls the received bytes it has room for, and decrypts them.
fn feed(st: &mut State) -> io::Result<()> {
    while !st.raw.is_empty() {
        let State { conn, raw } = st;
        match conn.read_tls(&mut &raw[..]) {
            Ok(0) => break,
            Ok(n) => {
                raw.drain(..n);
            }
            // Full: the reader takes the plaintext first, then the rest follows.
            Err(_) if conn.process_new_packets().is_ok_and(|s| s.plaintext_bytes_to_read() > 0) => break,
            Err(e) => return Err(e),
        }
        let state = conn.process_new_packets().map_err(tls_error)?;
        if state.peer_has_closed() {
            break;
        }
    }
    Ok(())
}

/// Sends every encrypted byte rustls holds (the socket's write timeout bounds it).
fn flush(st: &mut State, sock: &TcpStream) -> io::Result<()> {
    let mut s = sock;
    while st.conn.wants_write() {
        st.conn.write_tls(&mut s)?;
    }
    Ok(())
}
