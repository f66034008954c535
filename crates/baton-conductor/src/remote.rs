//! A worker in another process, seen through its control API ([`baton_protocol::control`]).
//!
//! [`RemoteWorker`] implements [`Worker`] over HTTP: `submit` posts the request and turns the
//! NDJSON event lines of the answer into [`RequestEvent`]s. Dropping the receiver closes the
//! connection, which aborts the request on the worker. When the worker cannot be reached, its
//! stream breaks, or membership says it left ([`RemoteWorker::mark_gone`]), the request gets a
//! [`RequestEvent::Lost`], which the conductor may retry elsewhere. `subscribe_state` reads the
//! worker's state stream in the binary encoding of [`baton_protocol::state_codec`].

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tracing::Instrument;

use baton_cluster::{AUTH_HEADER, ClusterSecret, WorkerInfo, unix_millis};
use tokio::sync::{mpsc, watch};

use baton_protocol::control::{
    EXPORT_PATH, ExportBody, GENERATE_PATH, IMPORT_PATH, ImportBody, RELEASE_PATH, ROLE_PATH, ReleaseBody, RoleBody,
    STATE_PATH, STATS_PATH,
};
use baton_protocol::error::ApiError;
use baton_protocol::state_codec::{STATE_MEDIA_TYPE, StateFormat, StateReader};
use baton_protocol::wire::{Received, WorkerError};
use baton_protocol::{KvSource, RequestEvent, Role, StateUpdate, WorkRequest, Worker, WorkerStats};

/// How long to wait for a worker to accept a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an idle connection to a worker stays pooled: under the worker's keep-alive limit.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(15);
/// Bound on the small control calls (release, stats).
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// The waits before each try of a release: about as long in all as a worker's default lease
/// (`worker::DEFAULT_LEASE`, 30 s), after which there is nothing left to release.
const RELEASE_RETRIES: [Duration; 5] =
    [Duration::ZERO, Duration::from_secs(1), Duration::from_secs(3), Duration::from_secs(7), Duration::from_secs(15)];
/// How long a worker's generate stream may stay silent before the conductor gives up on it, by
/// default: the worker sends a keep-alive line every [`baton_protocol::control::KEEPALIVE`], so only a
/// frozen worker or a half-open connection stays silent this long.
pub const STREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(10);

/// A worker behind its control API.
pub struct RemoteWorker {
    info: WorkerInfo,
    /// Its role now: registered, then as switched (by this conductor, or seen in its reports).
    role: baton_protocol::worker::SharedRole,
    base: String,
    client: reqwest::Client,
    secret: ClusterSecret,
    in_flight: Arc<AtomicUsize>,
    gone: watch::Sender<bool>,
    /// The longest silence on a generate stream (its response headers included).
    idle_timeout: Duration,
    /// [`Worker::kv_kind`]: its registered KV summary, written out once (routing compares it).
    kv_kind: String,
}

impl std::fmt::Debug for RemoteWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteWorker").field("id", &self.info.id).field("url", &self.base).finish()
    }
}

impl RemoteWorker {
    /// A client for the worker `info` describes.
    pub fn new(info: WorkerInfo, secret: ClusterSecret) -> Result<Self, ApiError> {
        Self::with_ca(info, secret, None)
    }

    /// A client that, for a worker whose control API is `https://`, trusts the certificates
    /// of `ca_pem` (PEM) and none other.
    pub fn with_ca(info: WorkerInfo, secret: ClusterSecret, ca_pem: Option<&[u8]>) -> Result<Self, ApiError> {
        // Idle pooled connections are dropped before the worker's HTTP server closes them
        // (`HttpLimits::header_timeout`, 30 s): a call sent on a connection the server is
        // closing fails with "error sending request" and trips the worker's breaker.
        let mut builder = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .tcp_nodelay(true);
        if let Some(pem) = ca_pem {
            let certs = reqwest::Certificate::from_pem_bundle(pem)
                .map_err(|e| ApiError::Internal(format!("the CA file is not PEM certificates: {e}")))?;
            for cert in certs {
                builder = builder.add_root_certificate(cert);
            }
        }
        let client = builder.build().map_err(|e| ApiError::Internal(format!("HTTP client: {e}")))?;
        Ok(Self {
            role: baton_protocol::worker::SharedRole::new(info.role),
            base: info.control_url.trim_end_matches('/').to_owned(),
            kv_kind: info.kv.to_string(),
            info,
            client,
            secret,
            in_flight: Arc::new(AtomicUsize::new(0)),
            gone: watch::channel(false).0,
            idle_timeout: STREAM_IDLE_TIMEOUT,
        })
    }

    /// The same client, giving up on a generate stream silent for `timeout` (the worker is
    /// then lost for that request, which runs elsewhere if nothing was streamed yet).
    pub fn with_idle_timeout(mut self, timeout: Duration) -> Self {
        self.idle_timeout = timeout;
        self
    }

    /// Its registration.
    pub fn info(&self) -> &WorkerInfo {
        &self.info
    }

    /// The worker left the cluster: every request still streaming from it is lost.
    pub fn mark_gone(&self) {
        self.gone.send_replace(true);
    }

    fn signed(&self, method: reqwest::Method, path: &str, body: Vec<u8>) -> reqwest::RequestBuilder {
        let proof = self.secret.sign_request(method.as_str(), path, unix_millis(), &body);
        self.client
            .request(method, format!("{}{path}", self.base))
            .header(AUTH_HEADER, proof)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body)
    }
}

/// Resolves once `gone` is (or becomes) true.
async fn gone(mut gone: watch::Receiver<bool>) {
    let _ = gone.wait_for(|g| *g).await;
}

/// Decrements the in-flight count however a request ends.
struct Counted(Arc<AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[async_trait::async_trait]
impl Worker for RemoteWorker {
    fn name(&self) -> &str {
        self.info.id.as_str()
    }

    fn role(&self) -> Role {
        self.role.get()
    }

    async fn set_role(&self, role: Role, deadline: Duration) -> Result<(), String> {
        let body = serde_json::to_vec(&RoleBody { role }).map_err(|e| e.to_string())?;
        let request = self.signed(reqwest::Method::POST, ROLE_PATH, body).timeout(deadline);
        match request.send().await {
            Ok(r) if r.status().is_success() => {
                self.role.swap(role);
                Ok(())
            }
            Ok(r) => Err(format!("the worker refused: {}", r.status())),
            Err(e) => Err(chain(e)),
        }
    }

    fn note_role(&self, role: Role) {
        self.role.swap(role);
    }

    fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    fn submit(&self, req: WorkRequest) -> mpsc::UnboundedReceiver<RequestEvent> {
        let (tx, rx) = mpsc::unbounded_channel();
        let body = match serde_json::to_vec(&req) {
            Ok(b) => b,
            Err(e) => {
                let _ = tx.send(RequestEvent::Failed(WorkerError::Protocol(format!("encoding the request: {e}"))));
                return rx;
            }
        };
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        let counted = Counted(self.in_flight.clone());
        let request = self.signed(reqwest::Method::POST, GENERATE_PATH, body);
        let name = self.info.id.to_string();
        let gone_rx = self.gone.subscribe();
        let idle = self.idle_timeout;
        tokio::spawn(
            async move {
                let _counted = counted;
                tokio::select! {
                    lost = stream(request, &tx, idle) => {
                        if let Some(reason) = lost {
                            let _ = tx.send(RequestEvent::Lost { reason: format!("worker {name}: {reason}") });
                        }
                    }
                    () = gone(gone_rx) => {
                        let _ = tx.send(RequestEvent::Lost { reason: format!("worker {name} left the cluster") });
                    }
                    // The client went away: returning drops the response, closing the connection,
                    // which aborts the request on the worker.
                    () = tx.closed() => {}
                }
            }
            .instrument(tracing::Span::current()),
        );
        rx
    }

    fn release(&self, id: u64) {
        // Called from drops and error paths too: without a runtime there is no one to send it,
        // and the lease runs out on its own.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let (client, url, secret) = (self.client.clone(), format!("{}{RELEASE_PATH}", self.base), self.secret.clone());
        let name = self.info.id.to_string();
        runtime.spawn(async move {
            // A worker cut off (a partition, a stalled connection) hears it once it can be
            // reached again, as long as a lease could still hold the KV.
            for (attempt, wait) in RELEASE_RETRIES.iter().enumerate() {
                tokio::time::sleep(*wait).await;
                // Signed again each time: the worker refuses a replayed signature.
                let body = serde_json::to_vec(&ReleaseBody { id }).unwrap_or_default();
                let proof = secret.sign_request("POST", RELEASE_PATH, unix_millis(), &body);
                let request = client
                    .post(&url)
                    .header(AUTH_HEADER, proof)
                    .header(reqwest::header::CONTENT_TYPE, "application/json")
                    .body(body)
                    .timeout(CALL_TIMEOUT);
                match request.send().await {
                    Ok(r) if r.status().is_success() => return,
                    // The lease runs out on its own; this only frees the blocks sooner.
                    Ok(r) => return tracing::warn!(worker = name, status = %r.status(), "release refused"),
                    Err(e) => tracing::debug!(worker = name, attempt, error = %e, "release failed"),
                }
            }
            tracing::info!(worker = name, "release failed; the worker's lease ends it");
        });
    }

    async fn export_prefix(&self, lease: u64, tokens: &[u32], deadline: Duration) -> Option<KvSource> {
        let body = serde_json::to_vec(&ExportBody { lease, tokens: tokens.to_vec() }).ok()?;
        let request = self.signed(reqwest::Method::POST, EXPORT_PATH, body).timeout(deadline);
        let name = self.info.id.to_string();
        match request.send().await {
            Ok(r) if r.status().is_success() => r.json().await.ok(),
            Ok(r) if r.status() == reqwest::StatusCode::NOT_FOUND => None,
            Ok(r) => {
                tracing::warn!(worker = name, status = %r.status(), "export refused");
                None
            }
            Err(e) => {
                tracing::warn!(worker = name, error = chain(e), "export failed");
                None
            }
        }
    }

    async fn import_prefix(&self, id: u64, tokens: Vec<u32>, source: KvSource, deadline: Duration) -> Option<Received> {
        let body = serde_json::to_vec(&ImportBody { id, tokens, source }).ok()?;
        let request = self.signed(reqwest::Method::POST, IMPORT_PATH, body).timeout(deadline);
        match request.send().await {
            Ok(r) if r.status().is_success() => r.json().await.ok(),
            Ok(_) => None,
            Err(e) => {
                tracing::warn!(worker = %self.info.id, error = chain(e), "import failed");
                None
            }
        }
    }

    fn capacity_blocks(&self) -> usize {
        usize::try_from(self.info.capacity_blocks).unwrap_or(usize::MAX)
    }

    fn block_tokens(&self) -> usize {
        self.info.kv.block_tokens as usize
    }

    fn kv_addr(&self) -> Option<std::net::SocketAddr> {
        self.info.kv_addr.parse().ok()
    }

    fn kv_kind(&self) -> Option<&str> {
        Some(&self.kv_kind)
    }

    fn subscribe_state(&self) -> Option<mpsc::Receiver<StateUpdate>> {
        let (tx, rx) = mpsc::channel(64);
        let request = self.signed(reqwest::Method::GET, STATE_PATH, Vec::new());
        let name = self.info.id.to_string();
        let gone_rx = self.gone.subscribe();
        tokio::spawn(async move {
            tokio::select! {
                why = relay_state(request, &tx) => tracing::info!(worker = name, why, "the state stream ended"),
                () = gone(gone_rx) => {}
                () = tx.closed() => {}
            }
        });
        Some(rx)
    }

    async fn stats(&self) -> Option<WorkerStats> {
        let r = self.signed(reqwest::Method::GET, STATS_PATH, Vec::new()).timeout(CALL_TIMEOUT).send().await.ok()?;
        if !r.status().is_success() {
            return None;
        }
        r.json().await.ok()
    }
}

/// Posts a request and relays its event lines; returns why the worker was lost, if it was.
/// A reqwest error with its causes ("error sending request: connection refused"), without the
/// URL (500s must not show worker addresses; the worker's name is in the message).
fn chain(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut out = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}

async fn stream(
    request: reqwest::RequestBuilder,
    tx: &mpsc::UnboundedSender<RequestEvent>,
    idle: Duration,
) -> Option<String> {
    let silent = || format!("silent for {:.1} s (frozen, or a half-open connection)", idle.as_secs_f64());
    let mut response = match tokio::time::timeout(idle, request.send()).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return Some(format!("unreachable: {}", chain(e))),
        Err(_) => return Some(silent()),
    };
    if !response.status().is_success() {
        let status = response.status();
        let error = match response.json::<serde_json::Value>().await {
            Ok(body) => body["error"]["message"].as_str().unwrap_or("no message").to_owned(),
            Err(_) => "no readable body".to_owned(),
        };
        let e = if status.is_client_error() && status != reqwest::StatusCode::UNAUTHORIZED {
            WorkerError::InvalidRequest(error)
        } else {
            WorkerError::Protocol(format!("the worker answered {status}: {error}"))
        };
        let _ = tx.send(RequestEvent::Failed(e));
        return None;
    }
    let mut buf = Vec::new();
    loop {
        match tokio::time::timeout(idle, response.chunk()).await {
            Ok(Ok(Some(bytes))) => buf.extend_from_slice(&bytes),
            Ok(Ok(None)) => return Some("the event stream ended before the request finished".into()),
            Ok(Err(e)) => return Some(format!("the event stream broke: {}", chain(e))),
            Err(_) => return Some(silent()),
        }
        while let Some(end) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=end).collect();
            if line.len() == 1 {
                continue; // a keep-alive
            }
            let event: RequestEvent = match serde_json::from_slice(&line) {
                Ok(e) => e,
                Err(e) => return Some(format!("unreadable event: {e}")),
            };
            let last = event.is_last();
            if tx.send(event).is_err() || last {
                return None;
            }
        }
        if buf.len() > MAX_EVENT_LINE_BYTES {
            return Some(format!("an event line over {MAX_EVENT_LINE_BYTES} bytes"));
        }
    }
}

/// The longest event line read from a worker's generate stream (a token event is under a
/// kilobyte; the last one names the KV it keeps, a few bytes a block: a megabyte for a prompt of
/// millions of tokens): a peer cannot make the conductor buffer without bound.
const MAX_EVENT_LINE_BYTES: usize = 64 << 20;

/// Relays a worker's state stream until it ends; says why it ended. The request asks for the
/// binary encoding; the answer's `Content-Type` says which it got (NDJSON from a worker that
/// predates it). The reader buffers at most one update, of bounded size.
async fn relay_state(request: reqwest::RequestBuilder, tx: &mpsc::Sender<StateUpdate>) -> String {
    let request = request.header(reqwest::header::ACCEPT, STATE_MEDIA_TYPE);
    let mut response = match request.send().await {
        Ok(r) if r.status().is_success() => r,
        Ok(r) => return format!("the worker answered {}", r.status()),
        Err(e) => return format!("unreachable: {e}"),
    };
    let content_type = response.headers().get(reqwest::header::CONTENT_TYPE).and_then(|v| v.to_str().ok());
    let mut reader = StateReader::new(StateFormat::from_content_type(content_type));
    loop {
        match response.chunk().await {
            Ok(Some(bytes)) => reader.extend(&bytes),
            Ok(None) => return "closed by the worker".into(),
            Err(e) => return format!("broken: {e}"),
        }
        loop {
            match reader.next_update() {
                Ok(Some(update)) => {
                    if tx.send(update).await.is_err() {
                        return "the reader left".into();
                    }
                }
                Ok(None) => break,
                Err(e) => return format!("unreadable update: {e}"),
            }
        }
    }
}
