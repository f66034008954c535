//! The HTTP shell every Baton server runs in: the conductor's OpenAI API, a worker's control
//! API and the embedded registry.
//!
//! `axum::serve` has no deadlines: a client that sends its headers or its body one byte every
//! few seconds, or opens a connection and sends nothing, holds a task and a socket for ever.
//! [`serve`] runs each connection with hyper's HTTP/1.1 server directly, bounded by
//! [`HttpLimits`]:
//!
//! - **headers** must arrive within [`HttpLimits::header_timeout`]; hyper restarts that timer
//!   whenever it waits for a request, so it is also how long a kept-alive connection may sit idle;
//! - **bodies** are read whole (every endpoint takes a JSON body) within
//!   [`HttpLimits::body_timeout`] and up to [`HttpLimits::max_body_bytes`] (else 408 / 413);
//! - **header size** and **count** are capped (431), and at most [`HttpLimits::max_connections`]
//!   connections are served at once (the rest wait in the kernel's accept queue);
//! - **one peer** (an IP address) holds at most [`HttpLimits::max_connections_per_peer`] of
//!   them: its next connection is closed at once, so one client cannot lock the others out;
//! - **a silent connection** (connected, nothing sent) is closed after
//!   [`HttpLimits::first_byte_timeout`], well before the header deadline.
//!
//! Every error a client can get is an OpenAI-style JSON body, the framework's own (405, 413,
//! 415, 422, a broken chunked body) included: [`json_errors`] rewrites any error response that is
//! not JSON. The errors hyper answers itself before any handler runs — a request line or header
//! block it cannot parse (a negative or doubled `Content-Length`), a URI or header block past its
//! buffer — are bare status lines; `JsonBareErrors`, between hyper and the socket, rewrites
//! those into the same JSON.
//!
//! Streams (server-sent events) have no deadline here: a generation ends on its own, and a client
//! that goes away closes it.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
pub use tokio_rustls::TlsAcceptor;

/// The bounds [`serve`] holds every connection to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Time a client has to send a request's headers, which is also the longest a kept-alive
    /// connection may sit idle between two requests.
    pub header_timeout: Duration,
    /// Time a client has to send a request's body, from the end of its headers.
    pub body_timeout: Duration,
    /// Largest request body (413 beyond).
    pub max_body_bytes: usize,
    /// Largest header block, names and values summed (431 beyond).
    pub max_header_bytes: usize,
    /// Most headers in one request (431 beyond).
    pub max_headers: usize,
    /// Connections served at once.
    pub max_connections: usize,
    /// Connections served at once from one IP address (a client past it has its next
    /// connection closed at once).
    pub max_connections_per_peer: usize,
    /// Time a new connection has to send its first byte (a TLS hello or a request line).
    pub first_byte_timeout: Duration,
}

impl Default for HttpLimits {
    /// Generous for any real client: 30 s for headers (and idle keep-alive), 60 s for a body of
    /// at most 8 MiB, 64 KiB and 100 headers, 4,096 connections, a quarter of them from one
    /// address (a load balancer in front is one address), 5 s for a new connection's first byte.
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(60),
            max_body_bytes: 8 << 20,
            max_header_bytes: 64 << 10,
            max_headers: 100,
            max_connections: 4096,
            max_connections_per_peer: 1024,
            first_byte_timeout: Duration::from_secs(5),
        }
    }
}

impl HttpLimits {
    /// The limits of a worker's control API: the defaults, except that one address may hold
    /// every connection. Its clients are conductors, each one address with a stream open for
    /// every request it runs there (thousands under load), each request signed.
    pub fn control() -> Self {
        let d = Self::default();
        Self { max_connections_per_peer: d.max_connections, ..d }
    }
}

/// TLS for a server: a certificate chain and its private key, PEM files (`--tls-cert`,
/// `--tls-key`). TLS 1.2 and 1.3, rustls with *ring*; no client certificates.
pub fn tls_acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor, String> {
    Ok(TlsAcceptor::from(Arc::new(baton_transfer::tls::server_config(cert, key)?)))
}

/// Serves `app` on `listener` within `limits` (over TLS with `tls`) until `shutdown` resolves;
/// then stops accepting connections and lets the requests in flight (streams included) finish,
/// for at most `drain`. A TLS handshake must end within the header deadline.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    tls: Option<TlsAcceptor>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    drain: Duration,
) -> std::io::Result<()> {
    let app = bounded(app, limits);
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let peers = PeerSlots::new(limits.max_connections_per_peer);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        // hyper answers a bare 431 past its buffer; below it, `bounded` answers in JSON.
        .max_buf_size(limits.max_header_bytes.saturating_mul(4).max(16 << 10))
        .max_headers(limits.max_headers.saturating_mul(4).max(16));
    tokio::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => slot.expect("the semaphore is never closed"),
            () = &mut shutdown => break,
        };
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors or a connection reset while queued: not fatal.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Some(peer_slot) = peers.take(peer.ip()) else {
            // Closed at once: this address already holds its share of the connections.
            tracing::debug!(%peer, "too many connections from one address; closing");
            continue;
        };
        if let Err(e) = tcp.set_nodelay(true) {
            // Streamed events are small writes; without it Nagle holds each one ~40 ms.
            tracing::warn!("cannot set TCP_NODELAY: {e}");
        }
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let (http1, watcher, tls) = (http1.clone(), graceful.watcher(), tls.clone());
        tokio::spawn(async move {
            let (_slot, _peer_slot) = (slot, peer_slot);
            // A connection that sends nothing holds a slot for nothing: it gets a short deadline
            // for its first byte (then hyper's header deadline for the rest of its request).
            let first_byte = tokio::time::timeout(limits.first_byte_timeout, tcp.peek(&mut [0u8; 1])).await;
            if !matches!(first_byte, Ok(Ok(n)) if n > 0) {
                return;
            }
            let ended = match tls {
                None => watcher.watch(http1.serve_connection(TokioIo::new(JsonBareErrors::new(tcp)), service)).await,
                Some(tls) => match tokio::time::timeout(limits.header_timeout, tls.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let io = TokioIo::new(JsonBareErrors::new(stream));
                        watcher.watch(http1.serve_connection(io, service)).await
                    }
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "TLS handshake failed");
                        return;
                    }
                    Err(_) => return,
                },
            };
            if let Err(e) = ended {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    tracing::info!("shutting down: no new connections; draining the requests in flight");
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(drain) => {
            tracing::warn!(?drain, "the drain deadline passed; stopping with requests in flight");
        }
    }
    Ok(())
}

/// A connection as hyper sees it, rewriting the error responses hyper writes itself (before
/// any handler runs: a request it cannot parse, a URI or header block past its buffer) from a
/// bare status line into an OpenAI-style JSON body. Every response of ours that is an error
/// carries `content-type` ([`json_errors`] sees to it); a head of status 400 or more without
/// one is hyper's. Reports no vectored writes, so hyper hands a response's head in one buffer.
struct JsonBareErrors<S> {
    inner: S,
    /// A rewritten response still to be written, and how much of it has been.
    pending: Vec<u8>,
    sent: usize,
}

impl<S> JsonBareErrors<S> {
    fn new(inner: S) -> Self {
        Self { inner, pending: Vec::new(), sent: 0 }
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> JsonBareErrors<S> {
    /// Writes what is pending of a rewritten response.
    fn drive(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        while self.sent < self.pending.len() {
            match std::pin::Pin::new(&mut self.inner).poll_write(cx, &self.pending[self.sent..]) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => self.sent += n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
        self.pending.clear();
        self.sent = 0;
        Poll::Ready(Ok(()))
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for JsonBareErrors<S> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for JsonBareErrors<S> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        use std::task::Poll;
        let this = self.get_mut();
        match this.drive(cx) {
            Poll::Ready(Ok(())) => {}
            other => return other.map(|r| r.map(|()| 0)),
        }
        if let Some(json) = bare_error_as_json(buf) {
            this.pending = json;
            // Taken whole; what the socket does not take now goes on the next write or flush.
            if let Poll::Ready(Err(e)) = this.drive(cx) {
                return Poll::Ready(Err(e));
            }
            return Poll::Ready(Ok(buf.len()));
        }
        std::pin::Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        std::task::ready!(this.drive(cx))?;
        std::pin::Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        std::task::ready!(this.drive(cx))?;
        std::pin::Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

/// The JSON response for a response head hyper wrote itself (status 400 or more, no
/// `content-type`), or `None` for any other bytes.
fn bare_error_as_json(buf: &[u8]) -> Option<Vec<u8>> {
    let rest = buf.strip_prefix(b"HTTP/1.1 ")?;
    let code: u16 = std::str::from_utf8(rest.get(..3)?).ok()?.parse().ok()?;
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
    if code < 400 || head.lines().any(|l| l.starts_with("content-type:")) {
        return None;
    }
    let status = StatusCode::from_u16(code).ok()?;
    let message = match code {
        400 => "the request is not valid HTTP/1.1 (a malformed request line or header, or an invalid Content-Length)",
        414 => "the request's URI is too long",
        431 => "the request's header block is too large",
        _ => status.canonical_reason().unwrap_or("error"),
    };
    let body = json!({"error": {"message": message, "type": error_kind(status), "param": null, "code": code}});
    let body = serde_json::to_vec(&body).ok()?;
    let mut out = format!(
        "HTTP/1.1 {code} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        status.canonical_reason().unwrap_or(""),
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    Some(out)
}

/// Connections held per peer address, each released by its [`PeerSlot`]'s `Drop`.
#[derive(Clone)]
struct PeerSlots {
    held: Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>,
    max: usize,
}

/// One connection's share of its peer's allowance.
struct PeerSlot {
    slots: PeerSlots,
    peer: std::net::IpAddr,
}

impl PeerSlots {
    fn new(max: usize) -> Self {
        Self { held: Arc::default(), max: max.max(1) }
    }

    /// A slot for one more connection from `peer`, if it holds fewer than the maximum.
    fn take(&self, peer: std::net::IpAddr) -> Option<PeerSlot> {
        let mut held = self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = held.entry(peer).or_insert(0);
        if *n >= self.max {
            return None;
        }
        *n += 1;
        Some(PeerSlot { slots: self.clone(), peer })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut held = self.slots.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = held.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.peer);
            }
        }
    }
}

/// `app` with the request bounds of `limits` and JSON error bodies.
pub fn bounded(app: Router, limits: HttpLimits) -> Router {
    app.layer(axum::extract::DefaultBodyLimit::disable())
        .layer(axum::middleware::from_fn(move |request: Request, next: Next| read_bounded(request, next, limits)))
        .layer(axum::middleware::from_fn(json_errors))
}

/// Checks the headers and reads the whole body within the limits, then passes the request on.
async fn read_bounded(request: Request, next: Next, limits: HttpLimits) -> Response {
    let headers = request.headers();
    let header_bytes: usize = headers.iter().map(|(k, v)| k.as_str().len() + v.len()).sum();
    if headers.len() > limits.max_headers || header_bytes > limits.max_header_bytes {
        return error(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            format!(
                "the request's headers are too large ({} headers, {header_bytes} bytes; at most {} and {} bytes)",
                headers.len(),
                limits.max_headers,
                limits.max_header_bytes
            ),
        );
    }
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limits.max_body_bytes as u64) {
        return too_large(limits);
    }
    let (parts, body) = request.into_parts();
    let bytes = match tokio::time::timeout(limits.body_timeout, axum::body::to_bytes(body, limits.max_body_bytes)).await
    {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(e)) if is_length_limit(&e) => return too_large(limits),
        Ok(Err(e)) => return error(StatusCode::BAD_REQUEST, format!("reading the request body failed: {e}")),
        Err(_) => {
            return error(
                StatusCode::REQUEST_TIMEOUT,
                format!("the request body did not arrive within {} s", limits.body_timeout.as_secs()),
            );
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes))).await
}

fn is_length_limit(e: &axum::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if s.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        source = s.source();
    }
    false
}

fn too_large(limits: HttpLimits) -> Response {
    error(StatusCode::PAYLOAD_TOO_LARGE, format!("the request body is larger than {} bytes", limits.max_body_bytes))
}

/// Rewrites an error response whose body is not JSON (the framework's 405, 413, 415, 422 and
/// the like, plain text or empty) into an OpenAI-style error, keeping its status and headers.
pub async fn json_errors(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let text = match axum::body::to_bytes(body, 4096).await {
        Ok(b) => String::from_utf8_lossy(&b).trim().to_owned(),
        Err(_) => String::new(),
    };
    let message = if text.is_empty() { status.canonical_reason().unwrap_or("error").to_owned() } else { text };
    let fresh = error(status, message);
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Response::from_parts(parts, fresh.into_body())
}

/// An OpenAI-style error response for any status: `{"error": {"message", "type", "param",
/// "code"}}`.
pub fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let body = json!({"error": {"message": message.into(), "type": error_kind(status), "param": null,
        "code": status.as_u16()}});
    (status, axum::Json(body)).into_response()
}

/// OpenAI's `error.type` for an HTTP status.
fn error_kind(status: StatusCode) -> &'static str {
    match status {
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => "authentication_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        StatusCode::SERVICE_UNAVAILABLE => "service_unavailable",
        s if s.is_server_error() => "server_error",
        _ => "invalid_request_error",
    }
}
