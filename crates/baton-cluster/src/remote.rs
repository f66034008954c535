//! [`RemoteRegistryClient`]: a worker in another process talking to the conductor's embedded
//! registry over the `/cluster/*` routes ([`crate::router`]). Every request is signed with the
//! cluster secret and has a timeout. Watching polls `/cluster/members` and turns the
//! differences into events.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use reqwest::StatusCode;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

use crate::auth::{AUTH_HEADER, ClusterSecret};
use crate::embedded::MembersSnapshot;
use crate::http::{
    DEREGISTER_PATH, ErrorBody, HEARTBEAT_PATH, LeaseRequest, MEMBERS_PATH, REGISTER_PATH, RegisterRequest,
    RegisterResponse,
};
use crate::registry::{Lease, MembershipWatch, Registry, spawn_heartbeats};
use crate::types::{ClusterError, LeftReason, MembershipEvent, WorkerId, WorkerInfo, unix_millis};

/// Timeouts and the watch's polling period.
#[derive(Clone, Copy, Debug)]
pub struct RemoteOptions {
    /// Limit on each HTTP request, connection included.
    pub request_timeout: Duration,
    /// Limit on establishing a connection.
    pub connect_timeout: Duration,
    /// How often a watch polls the member list.
    pub poll_interval: Duration,
}

impl Default for RemoteOptions {
    fn default() -> Self {
        Self {
            request_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(2),
            poll_interval: Duration::from_millis(500),
        }
    }
}

/// A [`Registry`] backed by a conductor's embedded registry, reached over HTTP.
#[derive(Clone, Debug)]
pub struct RemoteRegistryClient {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    http: reqwest::Client,
    base_url: String,
    secret: ClusterSecret,
    options: RemoteOptions,
    /// Last timestamp signed, so that every request's is strictly newer (the replay guard).
    last_ts: AtomicU64,
}

impl RemoteRegistryClient {
    /// A client for the conductor at `base_url` (e.g. `http://10.0.0.1:8000`), default options.
    pub fn new(base_url: &str, secret: ClusterSecret) -> Result<Self, ClusterError> {
        Self::with_options(base_url, secret, RemoteOptions::default())
    }

    /// A client with explicit timeouts and polling period.
    pub fn with_options(base_url: &str, secret: ClusterSecret, options: RemoteOptions) -> Result<Self, ClusterError> {
        Self::with_tls(base_url, secret, options, None)
    }

    /// A client that, for an `https://` conductor, trusts the certificates of `ca_pem` (PEM)
    /// besides none other: a cluster's conductor has a certificate of the cluster's own.
    pub fn with_tls(
        base_url: &str,
        secret: ClusterSecret,
        options: RemoteOptions,
        ca_pem: Option<&[u8]>,
    ) -> Result<Self, ClusterError> {
        let mut builder =
            reqwest::Client::builder().timeout(options.request_timeout).connect_timeout(options.connect_timeout);
        if let Some(pem) = ca_pem {
            for cert in reqwest::Certificate::from_pem_bundle(pem)
                .map_err(|e| ClusterError::Transport(format!("the CA file is not PEM certificates: {e}")))?
            {
                builder = builder.add_root_certificate(cert);
            }
        }
        let http =
            builder.build().map_err(|e| ClusterError::Transport(format!("cannot build the HTTP client: {e}")))?;
        let base_url = base_url.trim_end_matches('/').to_owned();
        Ok(Self { inner: Arc::new(Inner { http, base_url, secret, options, last_ts: AtomicU64::new(0) }) })
    }
}

impl Inner {
    fn next_ts(&self) -> u64 {
        let now = unix_millis();
        let prev = self.last_ts.fetch_max(now, Ordering::SeqCst);
        if prev >= now {
            // Same millisecond (or the clock stepped back): take the next one.
            self.last_ts.fetch_add(1, Ordering::SeqCst) + 1
        } else {
            now
        }
    }

    /// POSTs `body` to `path` on behalf of `worker`.
    async fn post<B: Serialize>(
        &self,
        path: &str,
        worker: &WorkerId,
        body: &B,
    ) -> Result<reqwest::Response, ClusterError> {
        let body = serde_json::to_vec(body).map_err(|e| ClusterError::Protocol(e.to_string()))?;
        let auth = self.secret.sign_request("POST", path, self.next_ts(), &body);
        let response = self
            .http
            .post(format!("{}{path}", self.base_url))
            .header(AUTH_HEADER, auth)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body)
            .send()
            .await?;
        check(response, Some(worker)).await
    }

    async fn members(&self) -> Result<MembersSnapshot, ClusterError> {
        let auth = self.secret.sign_request("GET", MEMBERS_PATH, self.next_ts(), b"");
        let response =
            self.http.get(format!("{}{MEMBERS_PATH}", self.base_url)).header(AUTH_HEADER, auth).send().await?;
        json(check(response, None).await?).await
    }
}

async fn json<T: DeserializeOwned>(response: reqwest::Response) -> Result<T, ClusterError> {
    response.json().await.map_err(|e| ClusterError::Protocol(format!("unexpected answer from the registry: {e}")))
}

/// Maps an error status to a [`ClusterError`], keeping the server's message.
async fn check(response: reqwest::Response, worker: Option<&WorkerId>) -> Result<reqwest::Response, ClusterError> {
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let message = match response.json::<ErrorBody>().await {
        Ok(body) => body.error,
        Err(_) => status.to_string(),
    };
    Err(match (status, worker) {
        (StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN, _) => {
            ClusterError::Unauthorized(format!("{status}: {message}"))
        }
        (StatusCode::CONFLICT, Some(worker)) => ClusterError::DuplicateWorker(worker.clone()),
        (StatusCode::NOT_FOUND, Some(worker)) => ClusterError::UnknownLease(worker.clone()),
        _ => ClusterError::Protocol(format!("{status}: {message}")),
    })
}

#[async_trait::async_trait]
impl Registry for RemoteRegistryClient {
    async fn register(&self, info: WorkerInfo, ttl: Duration) -> Result<Lease, ClusterError> {
        let worker = info.id.clone();
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        let response = self.inner.post(REGISTER_PATH, &worker, &RegisterRequest { info, ttl_ms }).await?;
        let RegisterResponse { lease } = json(response).await?;
        let inner = Arc::clone(&self.inner);
        let beat_worker = worker.clone();
        let (task, status) = spawn_heartbeats(ttl, move || {
            let inner = Arc::clone(&inner);
            let worker = beat_worker.clone();
            async move {
                inner.post(HEARTBEAT_PATH, &worker, &LeaseRequest { worker: worker.clone(), lease }).await.map(drop)
            }
        });
        Ok(Lease::new(worker, lease, task, status))
    }

    async fn deregister(&self, lease: Lease) -> Result<(), ClusterError> {
        lease.stop();
        let worker = lease.worker().clone();
        self.inner
            .post(DEREGISTER_PATH, &worker, &LeaseRequest { worker: worker.clone(), lease: lease.id() })
            .await
            .map(drop)
    }

    async fn list(&self) -> Result<Vec<WorkerInfo>, ClusterError> {
        Ok(self.inner.members().await?.members)
    }

    async fn watch(&self) -> Result<MembershipWatch, ClusterError> {
        // The first poll happens here, so that an unreachable or refusing conductor is an error
        // to the caller rather than a silent, empty watch.
        let first = self.inner.members().await?;
        let (tx, rx) = mpsc::unbounded_channel();
        let mut known = BTreeMap::new();
        diff(&mut known, first, &tx);
        let inner = Arc::clone(&self.inner);
        let task = tokio::spawn(async move {
            let mut ticker = tokio::time::interval(inner.options.poll_interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticker.tick().await;
            loop {
                ticker.tick().await;
                match inner.members().await {
                    Ok(snapshot) => {
                        if !diff(&mut known, snapshot, &tx) {
                            return;
                        }
                    }
                    Err(e) => tracing::warn!("polling the registry's members failed, retrying: {e}"),
                }
            }
        });
        Ok(MembershipWatch::new(rx, Some(task)))
    }
}

/// Emits the events that turn `known` into `snapshot`'s members (departures first, with the
/// reason the registry logged, else `LeaseExpired`); false when the watcher has gone.
fn diff(
    known: &mut BTreeMap<WorkerId, WorkerInfo>,
    snapshot: MembersSnapshot,
    tx: &mpsc::UnboundedSender<MembershipEvent>,
) -> bool {
    let current: BTreeMap<WorkerId, WorkerInfo> = snapshot.members.into_iter().map(|i| (i.id.clone(), i)).collect();
    let mut events = Vec::new();
    for (id, info) in known.iter() {
        // Gone, or replaced by a new incarnation under the same id.
        if current.get(id) != Some(info) {
            let reason = snapshot
                .departed
                .iter()
                .rev()
                .find(|(gone, _)| gone == id)
                .map_or(LeftReason::LeaseExpired, |(_, reason)| *reason);
            events.push(MembershipEvent::Left(id.clone(), reason));
        }
    }
    for (id, info) in &current {
        if known.get(id) != Some(info) {
            events.push(MembershipEvent::Joined(info.clone()));
        }
    }
    *known = current;
    events.into_iter().all(|e| tx.send(e).is_ok())
}
