//! The conductor's view of its workers: an exact KV index fed by each worker's state stream,
//! and the workers' own load reports.
//!
//! Every worker streams its pool's KV events and its load ([`StateUpdate`], over
//! [`Worker::subscribe_state`]: a channel in process, over the control API otherwise, in the
//! binary encoding of [`baton_protocol::state_codec`]),
//! starting with a snapshot of its whole index. [`ClusterView`] applies them to the global
//! prompt trees the routing policies read ([`GlobalPromptTrees`], shared with
//! [`crate::sched::SchedPolicy`]), keyed by the conductor's instance id of the worker. A gap in
//! a worker's event numbers (events lost) makes the follower subscribe again, which starts with
//! a snapshot: the index ends equal to the worker's pool. A worker that leaves, rejoins or
//! restarts leaves none of its old blocks: its instance is forgotten, and a new subscription
//! starts from its snapshot. Predictions (the policy's own "this prompt will be cached there")
//! cover only the window between routing a request and its events arriving.
//!
//! With [`KvIndexMode::Predicted`] the events are counted but not applied: the trees hold
//! predictions only (Dynamo's approximate mode), for comparison.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_kv::{BlockHash, InstanceId};
use baton_sched::GlobalPromptTrees;

use crate::Role;
use baton_protocol::wire::{LoadReport, StateUpdate};
use baton_protocol::worker::Worker;

/// Global prompt trees shared by the conductor (which feeds them) and its policy (which reads
/// and predicts into them).
pub type SharedTrees = Arc<Mutex<GlobalPromptTrees>>;

/// How long a routed prompt's blocks count as cached at its prefill worker before an event
/// confirms them (MemServe's TTL for global prompt trees).
pub const PREDICTED_TTL_US: u64 = 120_000_000;

/// What feeds the conductor's KV index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvIndexMode {
    /// The workers' KV events (and the conductor's predictions until they arrive).
    #[default]
    Exact,
    /// The conductor's predictions only.
    Predicted,
}

impl std::str::FromStr for KvIndexMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "exact" => Ok(Self::Exact),
            "predicted" => Ok(Self::Predicted),
            other => Err(format!("unknown KV index mode `{other}` (expected exact or predicted)")),
        }
    }
}

/// What the conductor knows of one worker's state.
#[derive(Debug, Clone, Default)]
struct Followed {
    instance: InstanceId,
    /// Which follower is current (a rejoin starts a new one; the old one stops).
    follower: u64,
    report: Option<LoadReport>,
    events: u64,
    resyncs: u64,
    /// Age of the last update when applied, seconds.
    lag_s: f64,
}

/// Figures of one worker's index for `/metrics`.
#[derive(Debug, Clone)]
pub struct IndexGauges {
    /// The worker.
    pub name: String,
    /// Confirmed blocks per tier (device, host, disk).
    pub blocks: [usize; 3],
    /// KV events applied.
    pub events: u64,
    /// Resynchronisations (snapshots after the first).
    pub resyncs: u64,
    /// Age of the last update when applied, seconds.
    pub lag_s: f64,
}

/// Why an update could not be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ViewError {
    /// Events were lost: the follower must resubscribe (a snapshot follows).
    #[error("a gap in the KV events: expected {expected}, got {got}")]
    Gap {
        /// The next number expected.
        expected: u64,
        /// The one that came.
        got: u64,
    },
    /// The worker is no longer followed by this follower.
    #[error("no longer followed")]
    Stale,
}

/// The workers' KV state and load, as their streams report them.
pub struct ClusterView {
    trees: SharedTrees,
    mode: KvIndexMode,
    workers: Mutex<HashMap<String, Followed>>,
    next_follower: AtomicU64,
}

impl std::fmt::Debug for ClusterView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterView").field("mode", &self.mode).finish_non_exhaustive()
    }
}

impl ClusterView {
    /// An empty view over `trees`.
    pub fn new(trees: SharedTrees, mode: KvIndexMode) -> Self {
        Self { trees, mode, workers: Mutex::new(HashMap::new()), next_follower: AtomicU64::new(1) }
    }

    /// The trees the view feeds.
    pub fn trees(&self) -> &SharedTrees {
        &self.trees
    }

    /// What feeds the index.
    pub fn mode(&self) -> KvIndexMode {
        self.mode
    }

    fn workers(&self) -> std::sync::MutexGuard<'_, HashMap<String, Followed>> {
        self.workers.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn tree_lock(&self) -> std::sync::MutexGuard<'_, GlobalPromptTrees> {
        self.trees.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Registers a follower of a worker (replacing any of the same name): its old blocks are
    /// forgotten. Returns the follower's number, which [`apply`](Self::apply) takes.
    /// [`follow`](Self::follow) does this; benchmarks and tests call it to apply by hand.
    pub fn enroll(&self, name: &str, instance: InstanceId) -> u64 {
        let follower = self.next_follower.fetch_add(1, Ordering::Relaxed);
        self.tree_lock().remove_instance(instance);
        self.workers().insert(name.to_owned(), Followed { instance, follower, ..Followed::default() });
        follower
    }

    /// Forgets a worker (it left): none of its blocks stay in the index.
    pub fn forget(&self, name: &str) {
        if let Some(f) = self.workers().remove(name) {
            self.tree_lock().remove_instance(f.instance);
        }
    }

    /// Whether a worker is followed.
    pub fn is_followed(&self, name: &str) -> bool {
        self.workers().contains_key(name)
    }

    /// A worker's last load report.
    pub fn report(&self, name: &str) -> Option<LoadReport> {
        self.workers().get(name).and_then(|f| f.report.clone())
    }

    /// The confirmed blocks the index holds for a worker, by hash.
    pub fn blocks(&self, name: &str) -> Option<Vec<(BlockHash, baton_kv::Tier)>> {
        let instance = self.workers().get(name)?.instance;
        Some(self.tree_lock().confirmed(instance))
    }

    /// Per-worker figures for `/metrics`.
    pub fn gauges(&self) -> Vec<IndexGauges> {
        let workers: Vec<(String, Followed)> = self.workers().iter().map(|(n, f)| (n.clone(), f.clone())).collect();
        let trees = self.tree_lock();
        let mut out: Vec<IndexGauges> = workers
            .into_iter()
            .map(|(name, f)| IndexGauges {
                blocks: trees.confirmed_by_tier(f.instance),
                name,
                events: f.events,
                resyncs: f.resyncs,
                lag_s: f.lag_s,
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// Applies one update of follower `follower` of worker `name`.
    pub fn apply(&self, name: &str, role: Role, follower: u64, update: StateUpdate) -> Result<(), ViewError> {
        let mut workers = self.workers();
        let f = workers.get_mut(name).filter(|f| f.follower == follower).ok_or(ViewError::Stale)?;
        let instance = f.instance;
        let now_ms = baton_cluster::unix_millis();
        match update {
            StateUpdate::Snapshot { next_seq, blocks, load, at_ms } => {
                if self.mode == KvIndexMode::Exact {
                    let blocks = blocks.iter().map(|b| (BlockHash(b.hash), b.tier.into()));
                    self.tree_lock().replace_instance(instance, role, next_seq, blocks);
                }
                f.report = Some(load);
                f.lag_s = now_ms.saturating_sub(at_ms) as f64 / 1e3;
            }
            StateUpdate::Delta { events, load, at_ms } => {
                if self.mode == KvIndexMode::Exact {
                    // One lock and one tree lookup for the whole delta.
                    let applied = self.tree_lock().apply_all(instance, events.iter().map(|e| (e.seq, e.change.into())));
                    if let Err(baton_kv::EventError::Gap { expected, got, .. }) = applied {
                        f.resyncs += 1;
                        return Err(ViewError::Gap { expected, got });
                    }
                }
                f.events += events.len() as u64;
                f.report = Some(load);
                f.lag_s = now_ms.saturating_sub(at_ms) as f64 / 1e3;
            }
        }
        Ok(())
    }

    /// Follows `worker`'s state stream until the worker is forgotten or replaced: applies its
    /// updates, subscribes again after a gap (for a snapshot) or a broken stream (with back-off).
    pub fn follow(self: &Arc<Self>, worker: Arc<dyn Worker>, instance: InstanceId) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(worker = worker.name(), "no async runtime: the worker's KV events are not followed");
            return;
        };
        let name = worker.name().to_owned();
        let follower = self.enroll(&name, instance);
        let view = Arc::clone(self);
        runtime.spawn(async move {
            let waits = || baton_protocol::retry::backoff(Duration::from_millis(100), Duration::from_secs(5));
            let mut backoff = waits();
            loop {
                let Some(mut updates) = worker.subscribe_state() else { return };
                let mut received = false;
                while let Some(update) = updates.recv().await {
                    received = true;
                    if let Some(role) = update.load().role
                        && role != worker.role()
                    {
                        worker.note_role(role);
                    }
                    match view.apply(&name, worker.role(), follower, update) {
                        Ok(()) => {}
                        Err(ViewError::Stale) => return,
                        Err(e @ ViewError::Gap { .. }) => {
                            tracing::warn!(worker = name, error = %e, "KV events lost; resynchronising from a snapshot");
                            break;
                        }
                    }
                }
                if view.workers().get(&name).is_none_or(|f| f.follower != follower) {
                    return;
                }
                if received {
                    backoff = waits(); // the stream worked: start the waits again
                }
                tokio::time::sleep(backoff.next().unwrap_or(Duration::from_secs(5))).await;
            }
        });
    }
}
