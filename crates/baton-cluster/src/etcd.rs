//! [`EtcdRegistry`]: membership in etcd.
//!
//! A worker's registration is the key `/baton/<cluster>/workers/<id>`, put under an etcd lease
//! of the requested TTL (etcd rounds it up to whole seconds, and to its own minimum, 2 s by
//! default) and kept alive by a keep-alive stream. Watchers read the prefix, then watch it from
//! the next revision: a put is a join, a delete a departure. A delete caused by lease expiry and
//! one caused by a revoke look the same in etcd, so a clean deregistration first rewrites the
//! value with `leaving: true` and then revokes the lease; a delete not preceded by that mark is
//! reported as `LeaseExpired`.
//!
//! The cluster secret: the value is `{"payload": <WorkerInfo JSON>, "leaving": bool, "proof":
//! <HMAC>}` with the proof made over the key, the payload and the mark. Watchers and `list`
//! ignore (and log) records whose proof does not verify, so a worker without the secret never
//! becomes a member. Limitation: etcd itself does not check the proof, so anyone who can write
//! the prefix can still delete or overwrite keys (denial of service, not impersonation); protect
//! the prefix with etcd's own authentication (`etcd://USER:PASSWORD@HOST:PORT`) where that
//! matters.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchOptions,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};

use crate::auth::ClusterSecret;
use crate::config::EtcdConfig;
use crate::registry::{Lease, LeaseStatus, MembershipWatch, Registry, heartbeat_interval};
use crate::table::LeaseId;
use crate::types::{ClusterError, LeftReason, MembershipEvent, WorkerId, WorkerInfo};

/// Timeouts of the etcd backend.
#[derive(Clone, Copy, Debug)]
pub struct EtcdOptions {
    /// Limit on each unary etcd call (grant, put, get, txn, revoke, one keep-alive round trip).
    pub request_timeout: Duration,
    /// Limit on connecting to etcd.
    pub connect_timeout: Duration,
    /// Pause before a watch re-reads the prefix after its stream failed.
    pub retry_delay: Duration,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        Self {
            request_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(3),
            retry_delay: Duration::from_millis(500),
        }
    }
}

/// A [`Registry`] in etcd. Cheap to clone.
#[derive(Clone)]
pub struct EtcdRegistry {
    client: Client,
    prefix: String,
    secret: ClusterSecret,
    options: EtcdOptions,
}

impl std::fmt::Debug for EtcdRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdRegistry").field("prefix", &self.prefix).finish_non_exhaustive()
    }
}

impl From<etcd_client::Error> for ClusterError {
    fn from(e: etcd_client::Error) -> Self {
        ClusterError::Etcd(e.to_string())
    }
}

/// The stored value of a registration.
#[derive(Serialize, Deserialize)]
struct Record {
    payload: String,
    leaving: bool,
    proof: String,
}

impl EtcdRegistry {
    /// Connects to etcd with default timeouts.
    pub async fn connect(config: &EtcdConfig, secret: ClusterSecret) -> Result<Self, ClusterError> {
        Self::connect_with(config, secret, EtcdOptions::default()).await
    }

    /// Connects to etcd.
    pub async fn connect_with(
        config: &EtcdConfig,
        secret: ClusterSecret,
        options: EtcdOptions,
    ) -> Result<Self, ClusterError> {
        // No per-request timeout on the channel: it would also cut the watch and keep-alive
        // streams. Unary calls are wrapped in `timed`; HTTP/2 keep-alives notice a dead
        // connection under a stream.
        let mut connect = ConnectOptions::new()
            .with_connect_timeout(options.connect_timeout)
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
            .with_keep_alive_while_idle(true);
        if let Some((name, password)) = &config.user {
            connect = connect.with_user(name.clone(), password.clone());
        }
        let client =
            timed(options.connect_timeout, "connecting to etcd", Client::connect(&config.endpoints, Some(connect)))
                .await?;
        let prefix = format!("/baton/{}/workers/", config.cluster);
        Ok(Self { client, prefix, secret, options })
    }

    /// The key prefix this cluster's registrations live under.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn key(&self, id: &WorkerId) -> String {
        format!("{}{id}", self.prefix)
    }

    fn seal(&self, key: &str, payload: String, leaving: bool) -> Vec<u8> {
        let proof = self.secret.sign(&[b"etcd-worker", key.as_bytes(), payload.as_bytes(), &[u8::from(leaving)]]);
        serde_json::to_vec(&Record { payload, leaving, proof }).unwrap_or_default()
    }

    /// The registration stored at `key`, if its proof verifies and it names the key's worker.
    fn open(&self, key: &str, value: &[u8]) -> Option<(WorkerInfo, bool)> {
        let record: Record = serde_json::from_slice(value).ok()?;
        let parts: [&[u8]; 4] =
            [b"etcd-worker", key.as_bytes(), record.payload.as_bytes(), &[u8::from(record.leaving)]];
        if !self.secret.verify(&parts, &record.proof) {
            tracing::warn!(key, "ignoring a registration without a valid cluster secret proof");
            return None;
        }
        let info: WorkerInfo = serde_json::from_str(&record.payload).ok()?;
        (key.strip_prefix(&self.prefix) == Some(info.id.as_str())).then_some((info, record.leaving))
    }

    async fn timed<T>(
        &self,
        what: &str,
        call: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, ClusterError> {
        timed(self.options.request_timeout, what, call).await
    }

    /// Reads the prefix: valid registrations by key, and the revision read at.
    async fn read_all(&self) -> Result<(BTreeMap<String, (WorkerInfo, bool)>, i64), ClusterError> {
        let response = self
            .timed(
                "reading members",
                self.client.clone().get(self.prefix.as_str(), Some(GetOptions::new().with_prefix())),
            )
            .await?;
        let revision = response.header().map_or(0, |h| h.revision());
        let mut members = BTreeMap::new();
        for kv in response.kvs() {
            let Ok(key) = kv.key_str() else { continue };
            if let Some(entry) = self.open(key, kv.value()) {
                members.insert(key.to_owned(), entry);
            }
        }
        Ok((members, revision))
    }
}

async fn timed<T>(
    limit: Duration,
    what: &str,
    call: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, ClusterError> {
    match tokio::time::timeout(limit, call).await {
        Ok(result) => Ok(result?),
        Err(_) => Err(ClusterError::Timeout(format!("etcd did not answer within {limit:?} ({what})"))),
    }
}

#[async_trait::async_trait]
impl Registry for EtcdRegistry {
    async fn register(&self, info: WorkerInfo, ttl: Duration) -> Result<Lease, ClusterError> {
        if ttl.is_zero() {
            return Err(ClusterError::InvalidTtl("a lease TTL must be positive".into()));
        }
        let ttl_s = i64::try_from(ttl.as_millis().div_ceil(1000)).unwrap_or(i64::MAX);
        let mut client = self.client.clone();
        let grant = self.timed("granting a lease", client.lease_grant(ttl_s, None)).await?;
        let lease_id = grant.id();
        let worker = info.id.clone();
        let key = self.key(&worker);
        let payload = serde_json::to_string(&info).map_err(|e| ClusterError::Protocol(e.to_string()))?;
        let value = self.seal(&key, payload, false);
        let txn = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.as_str(), value, Some(PutOptions::new().with_lease(lease_id)))]);
        let put = self.timed("registering", client.txn(txn)).await;
        if !matches!(&put, Ok(r) if r.succeeded()) {
            let _ = self.timed("revoking an unused lease", client.lease_revoke(lease_id)).await;
            put?;
            return Err(ClusterError::DuplicateWorker(worker));
        }
        let granted = Duration::from_secs(u64::try_from(grant.ttl()).unwrap_or(1).max(1));
        let (task, status) = spawn_keep_alive(client, lease_id, granted, self.options.request_timeout);
        let id = LeaseId(u64::try_from(lease_id).map_err(|_| ClusterError::Protocol("negative etcd lease id".into()))?);
        Ok(Lease::new(worker, id, task, status))
    }

    async fn deregister(&self, lease: Lease) -> Result<(), ClusterError> {
        lease.stop();
        let worker = lease.worker().clone();
        let lease_id = i64::try_from(lease.id().0).map_err(|_| ClusterError::UnknownLease(worker.clone()))?;
        let key = self.key(&worker);
        let mut client = self.client.clone();
        let current = self.timed("reading the registration", client.get(key.as_str(), None)).await?;
        let Some(kv) = current.kvs().first().filter(|kv| kv.lease() == lease_id) else {
            return Err(ClusterError::UnknownLease(worker));
        };
        let Some((info, _)) = self.open(&key, kv.value()) else { return Err(ClusterError::UnknownLease(worker)) };
        let payload = serde_json::to_string(&info).map_err(|e| ClusterError::Protocol(e.to_string()))?;
        // Mark the record as leaving (only if it is still ours), then revoke: watchers see the
        // mark before the delete and report `Deregistered`.
        let mark = Txn::new().when([Compare::lease(key.as_str(), CompareOp::Equal, lease_id)]).and_then([TxnOp::put(
            key.as_str(),
            self.seal(&key, payload, true),
            Some(PutOptions::new().with_lease(lease_id)),
        )]);
        if !self.timed("marking the registration as leaving", client.txn(mark)).await?.succeeded() {
            return Err(ClusterError::UnknownLease(worker));
        }
        self.timed("revoking the lease", client.lease_revoke(lease_id)).await?;
        Ok(())
    }

    async fn list(&self) -> Result<Vec<WorkerInfo>, ClusterError> {
        let (members, _) = self.read_all().await?;
        Ok(members.into_values().filter(|(_, leaving)| !leaving).map(|(info, _)| info).collect())
    }

    async fn watch(&self) -> Result<MembershipWatch, ClusterError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut known = BTreeMap::new();
        // The first read happens here so that an unreachable etcd is the caller's error.
        let (members, revision) = self.read_all().await?;
        resync(&mut known, members, &tx);
        let this = self.clone();
        let task = tokio::spawn(async move {
            let mut revision = revision;
            loop {
                match this.follow(&mut known, revision, &tx).await {
                    Ok(()) => return, // the watcher went away
                    Err(e) => tracing::warn!("etcd watch interrupted, re-reading members: {e}"),
                }
                loop {
                    tokio::time::sleep(this.options.retry_delay).await;
                    match this.read_all().await {
                        Ok((members, rev)) => {
                            if !resync(&mut known, members, &tx) {
                                return;
                            }
                            revision = rev;
                            break;
                        }
                        Err(e) => tracing::warn!("re-reading members from etcd failed: {e}"),
                    }
                }
            }
        });
        Ok(MembershipWatch::new(rx, Some(task)))
    }
}

impl EtcdRegistry {
    /// Follows the prefix from `revision + 1`, applying events to `known`. Returns `Ok` when
    /// the watcher has gone, `Err` when the stream failed (the caller re-reads and resumes).
    async fn follow(
        &self,
        known: &mut BTreeMap<String, (WorkerInfo, bool)>,
        revision: i64,
        tx: &mpsc::UnboundedSender<MembershipEvent>,
    ) -> Result<(), ClusterError> {
        let options = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
        let mut stream =
            self.timed("starting a watch", self.client.clone().watch(self.prefix.as_str(), Some(options))).await?;
        loop {
            // No timeout: events may be rare; the connection's HTTP/2 keep-alive ends the stream
            // with an error if etcd goes away.
            let Some(response) = stream.message().await? else {
                return Err(ClusterError::Protocol("etcd closed the watch stream".into()));
            };
            if response.canceled() {
                return Err(ClusterError::Protocol(format!("etcd cancelled the watch: {}", response.cancel_reason())));
            }
            let mut events = Vec::new();
            for event in response.events() {
                let Some(kv) = event.kv() else { continue };
                let Ok(key) = kv.key_str() else { continue };
                match event.event_type() {
                    EventType::Put => {
                        let Some((info, leaving)) = self.open(key, kv.value()) else { continue };
                        match known.get_mut(key) {
                            Some(entry) if entry.0 == info => entry.1 |= leaving,
                            Some(entry) => {
                                // A new incarnation under the same key.
                                events.push(MembershipEvent::Left(entry.0.id.clone(), LeftReason::Deregistered));
                                if !leaving {
                                    events.push(MembershipEvent::Joined(info.clone()));
                                }
                                *entry = (info, leaving);
                            }
                            None if leaving => {}
                            None => {
                                events.push(MembershipEvent::Joined(info.clone()));
                                known.insert(key.to_owned(), (info, false));
                            }
                        }
                    }
                    EventType::Delete => {
                        if let Some((info, leaving)) = known.remove(key) {
                            let reason = if leaving { LeftReason::Deregistered } else { LeftReason::LeaseExpired };
                            events.push(MembershipEvent::Left(info.id, reason));
                        }
                    }
                }
            }
            if !events.into_iter().all(|e| tx.send(e).is_ok()) {
                return Ok(());
            }
        }
    }
}

/// Emits the events that turn `known` into `members`; false when the watcher has gone.
fn resync(
    known: &mut BTreeMap<String, (WorkerInfo, bool)>,
    members: BTreeMap<String, (WorkerInfo, bool)>,
    tx: &mpsc::UnboundedSender<MembershipEvent>,
) -> bool {
    let mut events = Vec::new();
    for (key, (info, leaving)) in known.iter() {
        let reason = match members.get(key) {
            Some((now, false)) if now == info => continue,
            Some((_, true)) => LeftReason::Deregistered,
            _ if *leaving => LeftReason::Deregistered,
            _ => LeftReason::LeaseExpired,
        };
        events.push(MembershipEvent::Left(info.id.clone(), reason));
    }
    for (key, (info, leaving)) in &members {
        if !leaving && known.get(key).map(|(i, _)| i) != Some(info) {
            events.push(MembershipEvent::Joined(info.clone()));
        }
    }
    *known = members.into_iter().filter(|(_, (_, leaving))| !leaving).collect();
    events.into_iter().all(|e| tx.send(e).is_ok())
}

/// Keeps `lease_id` alive every third of its TTL until aborted; reports a lost lease (etcd
/// answers TTL 0) through the status channel. Stream failures are retried: etcd's TTL decides.
fn spawn_keep_alive(
    client: Client,
    lease_id: i64,
    ttl: Duration,
    request_timeout: Duration,
) -> (tokio::task::JoinHandle<()>, watch::Receiver<LeaseStatus>) {
    let (status, rx) = watch::channel(LeaseStatus::Alive);
    let interval = heartbeat_interval(ttl);
    let limit = request_timeout.min(interval.max(Duration::from_millis(500)));
    let task = tokio::spawn(async move {
        let mut client = client;
        loop {
            tokio::time::sleep(interval).await;
            let (mut keeper, mut stream) =
                match timed(limit, "opening a keep-alive stream", client.lease_keep_alive(lease_id)).await {
                    Ok(pair) => pair,
                    Err(e) => {
                        tracing::warn!("etcd keep-alive failed, retrying: {e}");
                        continue;
                    }
                };
            loop {
                if let Err(e) = timed(limit, "sending a keep-alive", keeper.keep_alive()).await {
                    tracing::warn!("etcd keep-alive failed, retrying: {e}");
                    break;
                }
                match timed(limit, "awaiting a keep-alive answer", stream.message()).await {
                    Ok(Some(answer)) if answer.ttl() > 0 => {}
                    Ok(Some(_)) => {
                        let _ = status.send(LeaseStatus::Lost(format!("etcd lease {lease_id:x} expired")));
                        return;
                    }
                    Ok(None) => {
                        tracing::warn!("etcd closed the keep-alive stream, reopening");
                        break;
                    }
                    Err(e) => {
                        tracing::warn!("etcd keep-alive failed, retrying: {e}");
                        break;
                    }
                }
                tokio::time::sleep(interval).await;
            }
        }
    });
    (task, rx)
}
