//! The embedded registry: a [`MembershipTable`] owned by one tokio task inside the conductor,
//! behind a cloneable handle. The task applies commands in arrival order, expires leases at
//! their deadlines, and fans events out to watchers, so every watcher sees the same order.

use std::time::Duration;

use rand::RngCore;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::auth::{AuthFailure, ClusterSecret, ReplayGuard};
use crate::registry::{Lease, MembershipWatch, Registry, spawn_heartbeats};
use crate::table::{Command, LeaseId, MembershipTable};
use crate::types::{ClusterError, LeftReason, MembershipEvent, WorkerId, WorkerInfo};

/// How long a caller waits for the registry task to answer before giving up.
const TASK_TIMEOUT: Duration = Duration::from_secs(5);

/// What the `/cluster/members` route reports: the members and the reasons of recent departures.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MembersSnapshot {
    /// Live members, ordered by id.
    pub members: Vec<WorkerInfo>,
    /// Recent departures, oldest first (bounded), so a polling client can tell why one left.
    pub departed: Vec<(WorkerId, LeftReason)>,
}

enum Request {
    Apply(Command, oneshot::Sender<Result<Vec<MembershipEvent>, ClusterError>>),
    Snapshot(oneshot::Sender<MembersSnapshot>),
    Watch(mpsc::UnboundedSender<MembershipEvent>, oneshot::Sender<()>),
    CheckReplay { worker: WorkerId, ts: u64, now_ms: u64, reply: oneshot::Sender<Result<(), AuthFailure>> },
}

/// A handle on the conductor's embedded registry. Cheap to clone; the task stops when the last
/// handle (including those held by leases' heartbeat tasks and routers) is dropped.
#[derive(Clone, Debug)]
pub struct EmbeddedRegistry {
    requests: mpsc::Sender<Request>,
    secret: ClusterSecret,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Request")
    }
}

impl EmbeddedRegistry {
    /// Starts the registry task on the current tokio runtime. `secret` is what remote workers
    /// must prove they hold (see [`crate::router`]); in-process callers are trusted.
    pub fn start(secret: ClusterSecret) -> Self {
        let (requests, rx) = mpsc::channel(256);
        tokio::spawn(run(rx));
        Self { requests, secret }
    }

    /// The cluster secret remote workers must prove.
    pub(crate) fn secret(&self) -> &ClusterSecret {
        &self.secret
    }

    /// Members and recent departures.
    pub async fn snapshot(&self) -> Result<MembersSnapshot, ClusterError> {
        self.ask(Request::Snapshot).await
    }

    /// Applies one command (what the HTTP routes call after checking the proof).
    pub(crate) async fn apply(&self, command: Command) -> Result<Vec<MembershipEvent>, ClusterError> {
        self.ask(|reply| Request::Apply(command, reply)).await?
    }

    /// A fresh, unguessable lease id.
    pub(crate) fn new_lease_id() -> LeaseId {
        LeaseId(rand::rng().next_u64())
    }

    /// Refuses a replayed request from `worker` (see [`ReplayGuard`]).
    pub(crate) async fn check_replay(&self, worker: WorkerId, ts: u64, now_ms: u64) -> Result<(), ClusterError> {
        self.ask(|reply| Request::CheckReplay { worker, ts, now_ms, reply })
            .await?
            .map_err(|f| ClusterError::Unauthorized(f.message().into()))
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Request) -> Result<T, ClusterError> {
        let (tx, rx) = oneshot::channel();
        tokio::time::timeout(TASK_TIMEOUT, async {
            self.requests.send(make(tx)).await.map_err(|_| ClusterError::Closed)?;
            rx.await.map_err(|_| ClusterError::Closed)
        })
        .await
        .map_err(|_| ClusterError::Timeout("the embedded registry task did not answer within 5 s".into()))?
    }
}

#[async_trait::async_trait]
impl Registry for EmbeddedRegistry {
    async fn register(&self, info: WorkerInfo, ttl: Duration) -> Result<Lease, ClusterError> {
        let lease = Self::new_lease_id();
        let worker = info.id.clone();
        self.apply(Command::Register { info, ttl, lease }).await?;
        let this = self.clone();
        let beat_worker = worker.clone();
        let (task, status) = spawn_heartbeats(ttl, move || {
            let this = this.clone();
            let worker = beat_worker.clone();
            async move { this.apply(Command::Heartbeat { worker, lease }).await.map(drop) }
        });
        Ok(Lease::new(worker, lease, task, status))
    }

    async fn deregister(&self, lease: Lease) -> Result<(), ClusterError> {
        lease.stop();
        self.apply(Command::Deregister { worker: lease.worker().clone(), lease: lease.id() }).await.map(drop)
    }

    async fn list(&self) -> Result<Vec<WorkerInfo>, ClusterError> {
        Ok(self.snapshot().await?.members)
    }

    async fn watch(&self) -> Result<MembershipWatch, ClusterError> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.ask(|reply| Request::Watch(tx, reply)).await?;
        Ok(MembershipWatch::new(rx, None))
    }
}

/// The registry task: owns the table, the replay guard and the watchers.
async fn run(mut requests: mpsc::Receiver<Request>) {
    let epoch = Instant::now();
    let mut table = MembershipTable::new();
    let mut replay = ReplayGuard::default();
    let mut watchers: Vec<mpsc::UnboundedSender<MembershipEvent>> = Vec::new();
    loop {
        let deadline = table.next_deadline();
        let request = tokio::select! {
            request = requests.recv() => match request {
                Some(request) => request,
                None => return,
            },
            () = tokio::time::sleep_until(epoch + deadline.unwrap_or_default()), if deadline.is_some() => {
                let events = table.expire(epoch.elapsed());
                for event in &events {
                    if let MembershipEvent::Left(id, _) = event {
                        tracing::info!(worker = %id, "lease expired");
                    }
                }
                broadcast(&mut watchers, &events);
                continue;
            }
        };
        match request {
            Request::Apply(command, reply) => {
                let result = table.apply(command, epoch.elapsed());
                if let Ok(events) = &result {
                    broadcast(&mut watchers, events);
                }
                let _ = reply.send(result);
            }
            Request::Snapshot(reply) => {
                let _ = reply.send(MembersSnapshot { members: table.members(), departed: table.departed() });
            }
            Request::Watch(watcher, reply) => {
                let delivered = table.snapshot_events().into_iter().all(|e| watcher.send(e).is_ok());
                if delivered {
                    watchers.push(watcher);
                }
                let _ = reply.send(());
            }
            Request::CheckReplay { worker, ts, now_ms, reply } => {
                let _ = reply.send(replay.check(&worker, ts, now_ms));
            }
        }
    }
}

/// Sends `events` to every watcher, forgetting watchers that went away.
fn broadcast(watchers: &mut Vec<mpsc::UnboundedSender<MembershipEvent>>, events: &[MembershipEvent]) {
    if events.is_empty() {
        return;
    }
    watchers.retain(|w| events.iter().all(|e| w.send(e.clone()).is_ok()));
}
