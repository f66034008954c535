//! The [`Registry`] trait every backend implements, the [`Lease`] a registration returns and the
//! [`MembershipWatch`] a watcher reads.

use std::future::Future;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::table::LeaseId;
use crate::types::{ClusterError, MembershipEvent, WorkerId, WorkerInfo};

/// Membership: workers register with a lease, watchers see them join and leave.
///
/// Implemented by [`EmbeddedRegistry`](crate::EmbeddedRegistry) (in the conductor),
/// [`RemoteRegistryClient`](crate::RemoteRegistryClient) (a worker talking to the conductor's
/// embedded registry over HTTP) and [`EtcdRegistry`](crate::EtcdRegistry); [`crate::connect`]
/// opens the one a `--registry` value names.
#[async_trait::async_trait]
pub trait Registry: Send + Sync {
    /// Joins the cluster. The returned [`Lease`] heartbeats in the background (every third of
    /// `ttl`) until it is dropped or passed to [`Registry::deregister`]; if it is dropped, the
    /// registration lapses after `ttl` and watchers see `Left(LeaseExpired)`, as for a crash.
    async fn register(&self, info: WorkerInfo, ttl: Duration) -> Result<Lease, ClusterError>;

    /// Leaves the cluster now; watchers see `Left(Deregistered)`.
    async fn deregister(&self, lease: Lease) -> Result<(), ClusterError>;

    /// The live members.
    async fn list(&self) -> Result<Vec<WorkerInfo>, ClusterError>;

    /// Membership events: first one `Joined` per current member, then changes in order.
    async fn watch(&self) -> Result<MembershipWatch, ClusterError>;
}

/// Whether a lease is still held.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseStatus {
    /// Heartbeats are being accepted (or have not failed for good yet).
    Alive,
    /// The registry no longer knows the lease (it expired, e.g. after a network partition, or
    /// was revoked). The worker is not a member any more and must register again.
    Lost(String),
}

/// A live registration. Dropping it stops the heartbeats (the registration then expires);
/// [`Registry::deregister`] ends it at once.
#[derive(Debug)]
pub struct Lease {
    worker: WorkerId,
    id: LeaseId,
    heartbeat: JoinHandle<()>,
    status: watch::Receiver<LeaseStatus>,
}

impl Lease {
    /// A lease whose heartbeat task is `heartbeat`, reporting through `status`.
    pub(crate) fn new(
        worker: WorkerId,
        id: LeaseId,
        heartbeat: JoinHandle<()>,
        status: watch::Receiver<LeaseStatus>,
    ) -> Self {
        Self { worker, id, heartbeat, status }
    }

    /// The registered worker.
    pub fn worker(&self) -> &WorkerId {
        &self.worker
    }

    /// The registry's id for this lease.
    pub fn id(&self) -> LeaseId {
        self.id
    }

    /// The lease's state now.
    pub fn status(&self) -> LeaseStatus {
        self.status.borrow().clone()
    }

    /// Resolves when the lease is lost, with the reason.
    pub async fn lost(&self) -> String {
        let mut status = self.status.clone();
        loop {
            if let LeaseStatus::Lost(reason) = &*status.borrow_and_update() {
                return reason.clone();
            }
            if status.changed().await.is_err() {
                return "the heartbeat task stopped".into();
            }
        }
    }

    /// Stops heartbeating (used by `deregister`, and by drop).
    pub(crate) fn stop(&self) {
        self.heartbeat.abort();
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.heartbeat.abort();
    }
}

/// The interval between heartbeats for a lease of `ttl`: a third of it, so two can be lost.
pub(crate) fn heartbeat_interval(ttl: Duration) -> Duration {
    (ttl / 3).max(Duration::from_millis(30))
}

/// Spawns the heartbeat loop of a request/response backend: calls `beat` every
/// [`heartbeat_interval`]; `UnknownLease` marks the lease lost and ends the loop, other errors
/// are retried (the registry's TTL decides whether the worker is still alive).
pub(crate) fn spawn_heartbeats<F, Fut>(ttl: Duration, beat: F) -> (JoinHandle<()>, watch::Receiver<LeaseStatus>)
where
    F: Fn() -> Fut + Send + 'static,
    Fut: Future<Output = Result<(), ClusterError>> + Send + 'static,
{
    let (tx, rx) = watch::channel(LeaseStatus::Alive);
    let interval = heartbeat_interval(ttl);
    let task = tokio::spawn(async move {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await; // the first tick is immediate; registration just renewed the lease
        loop {
            ticker.tick().await;
            match beat().await {
                Ok(()) => {}
                Err(e @ ClusterError::UnknownLease(_)) => {
                    tracing::warn!("lease lost: {e}");
                    let _ = tx.send(LeaseStatus::Lost(e.to_string()));
                    return;
                }
                Err(e) => tracing::warn!("heartbeat failed, retrying: {e}"),
            }
        }
    });
    (task, rx)
}

/// A stream of [`MembershipEvent`]s. Dropping it ends the watch (and any task behind it).
#[derive(Debug)]
pub struct MembershipWatch {
    events: mpsc::UnboundedReceiver<MembershipEvent>,
    task: Option<JoinHandle<()>>,
}

impl MembershipWatch {
    /// A watch fed by `events`, with the task that feeds it (aborted on drop), if any.
    pub(crate) fn new(events: mpsc::UnboundedReceiver<MembershipEvent>, task: Option<JoinHandle<()>>) -> Self {
        Self { events, task }
    }

    /// The next event; `None` when the registry has shut down.
    pub async fn recv(&mut self) -> Option<MembershipEvent> {
        self.events.recv().await
    }

    /// The next event if one is ready now.
    pub fn try_recv(&mut self) -> Option<MembershipEvent> {
        self.events.try_recv().ok()
    }
}

impl Drop for MembershipWatch {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}
