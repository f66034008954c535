//! The conductor: the OpenAI-compatible HTTP API in front of the workers, and each request's
//! life across them.
//!
//! A request is validated into a [`ValidRequest`], routed by the [`RoutePolicy`], then run:
//! colocated, it goes to one worker; disaggregated, the prefill worker computes the prompt and
//! the first token and keeps the KV under a lease, the conductor streams that token, the decode
//! worker reserves blocks of its own and pulls the KV into them (or, in push mode, the prefill
//! worker writes it into them: `baton_worker::handoff`), the prefill worker is told to release
//! whatever it still holds, and the decode worker streams the rest. A client that disconnects
//! drops the response stream, which drops the worker's event receiver, which aborts the request
//! (and any transfer of its KV in flight) and frees its KV. Each choice's life across the workers
//! is a state machine without I/O (`life.rs`); this module drives it
//! (`ChoiceHost::run`) and is its host.
//!
//! Workers are local ([`crate::WorkerHandle`]) or remote ([`crate::remote::RemoteWorker`]), and
//! may join and leave at any time ([`Conductor::add_worker`], [`crate::deploy::follow`]). A request
//! whose worker is lost before anything was streamed to the client is routed again; one whose
//! decode worker is lost after the prefill's first token has its decode half handed to another
//! decode worker; and one whose worker is lost mid-stream is migrated: another worker continues
//! from the prompt and the tokens streamed so far (recomputing their KV), and the client's stream
//! goes on without a gap or a duplicate.
//!
//! Failure is seen at once, not at the registry's TTL: a worker that is lost on a request (its
//! connection refused or broken, its thread gone, no answer in time) trips a circuit breaker
//! and leaves routing; a probe asks it for its stats with a growing back-off and puts it back
//! when it answers. A worker that rejoins the cluster starts with a closed breaker.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use baton_engine::RequestId;
use baton_kv::InstanceId;
use baton_sched::{CostProfile, GlobalPromptTrees, WorkerLoad};
use serde_json::json;
use tokio::sync::mpsc;
use tracing::Instrument;

use crate::elastic::Elastic;
use crate::life::{self, Choice, FetchLease, Life, Settings, Waiting};
use crate::loads::WorkerFigures;
use crate::metrics::{Metrics, Outcome, WorkerGauges};
use crate::openai::{Endpoint, ValidRequest, Validator};
use crate::response::{Piece, full_response, sse_response};
use crate::routing::{
    Decision, Fallback, Plan, RoutePolicy, RouteRequest, SnapshotConfig, cluster_snapshot, decode_has_room,
    lone_role_fallback, ready_trees,
};
use crate::view::{ClusterView, KvIndexMode, PREDICTED_TTL_US};
use baton_protocol::error::ApiError;
use baton_protocol::wire::{KvSource, PdCaching};
use baton_protocol::{KvTransfer, RequestEvent, WorkRequest, Worker};

/// How long a request's worker may stay silent before the conductor asks whether it is alive
/// (the default of [`Conductor::with_worker_silence`]). A request queued behind others on a
/// busy worker sends nothing until its turn: silence alone is not death.
pub const WORKER_SILENCE: Duration = Duration::from_secs(30);
/// The longest a request waits on a worker that answers probes but sends the request nothing:
/// past it the request is failed (and goes on elsewhere if it can), never left to hang.
const WORKER_SILENCE_MAX: Duration = Duration::from_secs(600);
/// First wait before probing a worker whose breaker tripped; it doubles up to `PROBE_MAX`,
/// jittered.
const PROBE_FIRST: Duration = Duration::from_millis(250);
/// Longest wait between probes of a tripped worker.
const PROBE_MAX: Duration = Duration::from_secs(5);
/// How long a worker may take to answer a role switch.
/// How long one replay of the admission queue serves its waiters' predictions: a waiter
/// predicts again each second, and the requests that left meanwhile only bring its start
/// forward, so a replay a quarter of a second old errs a little on the safe side.
const REPLAY_FRESH: Duration = Duration::from_millis(250);

/// Requests that must have finished their decode before the admission queue predicts waits
/// from the time they held decode room: before, a request waits and its deadline decides.
const HOLD_SAMPLES: u32 = 4;

const SWITCH_DEADLINE: Duration = Duration::from_secs(5);

mod api;
mod choice;
mod ledger;
mod queue;

pub use api::REQUEST_ID_HEADER;
use api::{first_request_id, request_id_of};
use choice::ChoiceHost;
pub(crate) use ledger::Tracked;
use ledger::{Binding, Loads};
use queue::{AdmissionQueue, Prediction};
pub use queue::{DEFAULT_MAX_QUEUE_WAIT, MAX_QUEUED};

type Workers = Vec<Arc<dyn Worker>>;
type Route = life::Route<Arc<dyn Worker>>;
type PlannedFetch = life::PlannedFetch<Arc<dyn Worker>>;

/// Shared state of the conductor's handlers.
pub struct Conductor {
    validator: Validator,
    /// The workers' KV index and load reports, fed by their state streams.
    view: Arc<ClusterView>,
    /// Tokenizer workers: validation (tokenising, rendering chat templates) runs on blocking
    /// threads, at most this many at once, never on the async runtime's threads.
    tokenizers: Arc<tokio::sync::Semaphore>,
    workers: RwLock<Workers>,
    policy: Box<dyn RoutePolicy>,
    /// How the policy's snapshot is built (the policy's answer, asked once).
    snapshot_config: SnapshotConfig,
    metrics: Metrics,
    api_key: Option<String>,
    /// Whether `/metrics` and `/health` want the API key too (the OpenAI routes always do).
    protect_metrics: bool,
    /// The next request id (from a random start: `first_request_id`).
    next_id: AtomicU64,
    /// KV bytes a token for the transfer counter: `Some` for emulated workers, whose KV stands
    /// for a real model's; `None` counts the bytes the workers moved.
    kv_bytes_per_token: Option<usize>,
    /// What each worker is doing, as far as this conductor routed it.
    loads: Mutex<Loads>,
    /// Time zero of the snapshots' clocks.
    epoch: Instant,
    /// How KV moves from prefill to decode workers.
    kv_transfer: KvTransfer,
    /// Where past requests' KV is kept.
    pd_caching: PdCaching,
    /// Workers out of routing after a failure, by name, with the generation of their breaker.
    tripped: Mutex<HashMap<String, u64>>,
    next_trip: AtomicU64,
    /// Elastic prefill/decode: the role switching controller, when on.
    elastic: Option<Mutex<Elastic>>,
    /// Wakes the elastic loop (a request was routed).
    elastic_wake: Arc<tokio::sync::Notify>,
    /// Whether the elastic loop runs (one per conductor, however often `router` is called).
    elastic_running: AtomicBool,
    /// How long a request's worker may be silent before it is probed ([`WORKER_SILENCE`]).
    worker_silence: Duration,
    /// Requests waiting for decode room before they start.
    queue: Arc<AdmissionQueue>,
    /// How long a request may wait there (`None`: no limit).
    max_queue_wait: Option<Duration>,
}

/// No decode worker has room for a request's KV now: it may wait for room in the admission
/// queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NoRoom;

/// Why a request was not routed.
#[derive(Debug)]
enum Refused {
    /// No decode worker has room for it now.
    NoRoom,
    /// Refused for good (an error for the client).
    Api(ApiError),
}

impl From<ApiError> for Refused {
    fn from(e: ApiError) -> Self {
        Self::Api(e)
    }
}

impl From<NoRoom> for Refused {
    fn from(_: NoRoom) -> Self {
        Self::NoRoom
    }
}

impl From<Refused> for ApiError {
    fn from(r: Refused) -> Self {
        match r {
            Refused::NoRoom => no_room(1),
            Refused::Api(e) => e,
        }
    }
}

/// The 429 of a request no decode worker has room for, retried after `retry_after_s`.
fn no_room(retry_after_s: u64) -> ApiError {
    ApiError::Overloaded {
        message: "no decode worker has room for the request's KV now; retry later".into(),
        retry_after_s: retry_after_s.max(1),
    }
}

impl std::fmt::Debug for Conductor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conductor").field("workers", &self.workers()).finish_non_exhaustive()
    }
}

impl Conductor {
    /// A conductor over `workers`; `kv_bytes_per_token` counts handed-over KV at that many bytes
    /// a token (emulated workers), else at the bytes the workers report they moved.
    pub fn new(
        validator: Validator,
        workers: Workers,
        policy: Box<dyn RoutePolicy>,
        api_key: Option<String>,
        kv_bytes_per_token: Option<usize>,
    ) -> Self {
        let tokenizers = std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get);
        let trees = Arc::new(Mutex::new(GlobalPromptTrees::new(PREDICTED_TTL_US)));
        Self {
            snapshot_config: policy.snapshot_config(),
            view: Arc::new(ClusterView::new(trees, KvIndexMode::Exact)),
            validator,
            tokenizers: Arc::new(tokio::sync::Semaphore::new(tokenizers)),
            workers: RwLock::new(workers),
            policy,
            metrics: Metrics::default(),
            api_key,
            protect_metrics: false,
            next_id: AtomicU64::new(first_request_id()),
            kv_bytes_per_token,
            loads: Mutex::new(Loads::default()),
            epoch: Instant::now(),
            kv_transfer: KvTransfer::default(),
            pd_caching: PdCaching::default(),
            tripped: Mutex::new(HashMap::new()),
            next_trip: AtomicU64::new(0),
            elastic: None,
            elastic_wake: Arc::new(tokio::sync::Notify::new()),
            elastic_running: AtomicBool::new(false),
            worker_silence: WORKER_SILENCE,
            queue: Arc::new(AdmissionQueue::default()),
            max_queue_wait: Some(DEFAULT_MAX_QUEUE_WAIT),
        }
    }

    /// How long a request may wait for decode room before it starts (`None`: as long as it
    /// takes, as vLLM queues); one predicted to wait longer is refused at once (429 with
    /// `Retry-After`), one still waiting when it passes is refused then, before its stream
    /// starts. Default [`DEFAULT_MAX_QUEUE_WAIT`].
    #[must_use]
    pub fn with_max_queue_wait(mut self, wait: Option<Duration>) -> Self {
        self.max_queue_wait = wait;
        self
    }

    /// How long a request's worker may send nothing before the conductor probes it (its stats,
    /// answered between engine steps): a worker that answers is busy and the request keeps
    /// waiting; one that does not is lost, and the request goes on elsewhere.
    #[must_use]
    pub fn with_worker_silence(mut self, silence: Duration) -> Self {
        self.worker_silence = silence.max(Duration::from_millis(10));
        self
    }

    /// Switches workers' roles as `elastic` decides (`--elastic`; `None`: never), looking every
    /// [`Elastic::interval`] and after each routed request; starts with [`Self::router`].
    #[must_use]
    pub fn with_elastic(mut self, elastic: Option<Elastic>) -> Self {
        self.elastic = elastic.map(Mutex::new);
        self
    }

    /// Runs the elastic loop until the conductor is dropped (nothing when elastic is off).
    fn run_elastic(self: &Arc<Self>) {
        let Some(interval) =
            self.elastic.as_ref().map(|e| e.lock().unwrap_or_else(std::sync::PoisonError::into_inner).interval())
        else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("no async runtime: elastic role switching is off");
            return;
        };
        if self.elastic_running.swap(true, Ordering::SeqCst) {
            return;
        }
        let (conductor, wake) = (Arc::downgrade(self), Arc::clone(&self.elastic_wake));
        runtime.spawn(async move {
            loop {
                tokio::select! {
                    () = tokio::time::sleep(interval) => {}
                    () = wake.notified() => {}
                }
                let Some(c) = conductor.upgrade() else { return };
                c.rebalance().await;
            }
        });
    }

    /// One look of the elastic loop: carries out the switch the controller asks for, if any.
    async fn rebalance(&self) {
        let Some(elastic) = &self.elastic else { return };
        let switch = {
            let mut elastic = elastic.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let (workers, loads, now) = self.snapshot(&[], elastic.cost());
            // Rebalancing reads no prompt tree.
            let (trees, cost) = (GlobalPromptTrees::new(0), elastic.cost().clone());
            let snapshot = baton_sched::ClusterSnapshot::from_workers(now, &loads, &trees, &cost).with_kv_fetch(false);
            elastic.decide(&snapshot).map(|s| (workers, s))
        };
        let Some((workers, switch)) = switch else { return };
        let worker = &workers[switch.worker];
        match worker.set_role(switch.to, SWITCH_DEADLINE).await {
            Ok(()) => {
                tracing::info!(
                    worker = worker.name(),
                    from = switch.from.as_str(),
                    to = switch.to.as_str(),
                    "elastic: role switched"
                );
                self.metrics.role_switch(switch.from.as_str(), switch.to.as_str());
            }
            Err(e) => {
                tracing::warn!(worker = worker.name(), error = e, "elastic: the role switch failed");
                self.metrics.role_switch_failed();
                elastic.lock().unwrap_or_else(std::sync::PoisonError::into_inner).switch_failed();
            }
        }
    }

    /// Feeds the KV index the policies read from the workers' events (`Exact`, the default) or
    /// from the conductor's predictions only. Call before the first worker is followed.
    #[must_use]
    pub fn with_kv_index(mut self, mode: KvIndexMode) -> Self {
        self.view = Arc::new(ClusterView::new(Arc::clone(self.view.trees()), mode));
        self
    }

    /// The workers' KV index and load reports.
    pub fn view(&self) -> &Arc<ClusterView> {
        &self.view
    }

    /// Starts following the state stream of every worker not followed yet (workers handed to
    /// [`Conductor::new`] are followed once a runtime runs: from [`Conductor::router`]).
    fn follow_workers(&self) {
        for w in self.workers() {
            if !self.view.is_followed(w.name()) {
                let instance = InstanceId(self.loads().id(w.name()));
                self.view.follow(w, instance);
            }
        }
    }

    /// Requires the API key (when there is one) on `/metrics` and `/health` too: a choice,
    /// since Prometheus scrapers and Kubernetes probes must then send it.
    #[must_use]
    pub fn with_protect_metrics(mut self, protect: bool) -> Self {
        self.protect_metrics = protect;
        self
    }

    /// Hands KV from prefill to decode workers in `mode` (pull by default).
    #[must_use]
    pub fn with_kv_transfer(mut self, mode: KvTransfer) -> Self {
        self.kv_transfer = mode;
        self
    }

    /// Keeps past requests' KV as `mode` says (the routing policy's decode affinity is set
    /// where the policy is built, from the same flag).
    #[must_use]
    pub fn with_pd_caching(mut self, mode: PdCaching) -> Self {
        self.pd_caching = mode;
        self
    }

    /// How KV moves from prefill to decode workers.
    pub fn kv_transfer(&self) -> KvTransfer {
        self.kv_transfer
    }

    /// Microseconds since the conductor started: the clock of its snapshots.
    pub fn now_us(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// The workers now.
    pub fn workers(&self) -> Workers {
        self.workers.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    fn tripped(&self) -> std::sync::MutexGuard<'_, HashMap<String, u64>> {
        self.tripped.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether `name` is out of routing after a failure.
    pub fn is_tripped(&self, name: &str) -> bool {
        self.tripped().contains_key(name)
    }

    /// Takes `worker` out of routing after it failed (`reason`), and starts probing it: it is
    /// routed to again once it answers a stats call, or forgotten when it leaves the cluster or
    /// is replaced by a worker of the same name.
    fn trip(self: &Arc<Self>, worker: &Arc<dyn Worker>, reason: &str) {
        let name = worker.name().to_owned();
        let generation = self.next_trip.fetch_add(1, Ordering::Relaxed);
        {
            let mut tripped = self.tripped();
            if tripped.contains_key(&name) {
                return;
            }
            tripped.insert(name.clone(), generation);
        }
        self.metrics.breaker_trips.inc();
        tracing::warn!(worker = name, reason, "worker failed; out of routing until it answers a probe");
        let conductor = Arc::downgrade(self);
        let worker = worker.clone();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        runtime.spawn(async move {
            let mut waits = baton_protocol::retry::backoff(PROBE_FIRST, PROBE_MAX);
            loop {
                tokio::time::sleep(waits.next().unwrap_or(PROBE_MAX)).await;
                let Some(c) = conductor.upgrade() else { return };
                if c.tripped().get(&name) != Some(&generation) {
                    return; // replaced, or put back already
                }
                if !c.workers().iter().any(|w| w.name() == name) {
                    c.tripped().remove(&name);
                    return; // left the cluster
                }
                if worker.stats().await.is_some() {
                    if c.tripped().get(&name) == Some(&generation) {
                        c.tripped().remove(&name);
                    }
                    tracing::info!(worker = name, "worker answers again; back in routing");
                    return;
                }
            }
        });
    }

    /// Adds a worker (it joined the cluster). A worker of the same name is replaced, and its
    /// breaker is closed: a restarted worker is routed to at once.
    pub fn add_worker(&self, worker: Arc<dyn Worker>) {
        self.tripped().remove(worker.name());
        let mut workers = self.workers.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        workers.retain(|w| w.name() != worker.name());
        tracing::info!(worker = worker.name(), role = worker.role().as_str(), "worker joined");
        workers.push(Arc::clone(&worker));
        drop(workers);
        // A rejoining worker starts over: its old blocks leave the index, its snapshot refills it.
        let instance = InstanceId(self.loads().id(worker.name()));
        self.view.follow(worker, instance);
    }

    /// Removes a worker (it left the cluster); requests already on it keep their handle.
    pub fn remove_worker(&self, name: &str) -> Option<Arc<dyn Worker>> {
        let mut workers = self.workers.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        let i = workers.iter().position(|w| w.name() == name)?;
        tracing::info!(worker = name, "worker left");
        self.view.forget(name);
        Some(workers.remove(i))
    }

    /// The model id clients name.
    pub fn model_id(&self) -> &str {
        &self.validator.model_id
    }

    /// The workers a policy may pick (all but `excluded` and those whose breaker tripped), in
    /// the order of their instance ids (the snapshot's order: a decision's positions name them),
    /// their figures from the ledger with queued prompts costed by `cost`, and the time.
    fn snapshot(&self, excluded: &[String], cost: &CostProfile) -> (Workers, Vec<WorkerLoad>, u64) {
        let tripped = self.tripped().clone();
        let mut workers: Workers = self
            .workers()
            .into_iter()
            .filter(|w| !excluded.iter().any(|e| e == w.name()) && !tripped.contains_key(w.name()))
            .collect();
        let now = self.now_us();
        let mut loads = self.loads();
        workers.sort_by_key(|w| loads.id(w.name()));
        // Each KV kind a group, numbered as first met: the policies pair and fetch within one.
        let mut kinds: Vec<&str> = Vec::new();
        let mut groups: Vec<Option<u32>> = Vec::with_capacity(workers.len());
        for kind in workers.iter().map(|w| w.kv_kind()) {
            groups.push(kind.map(|kind| match kinds.iter().position(|k| *k == kind) {
                Some(g) => g as u32,
                None => {
                    kinds.push(kind);
                    (kinds.len() - 1) as u32
                }
            }));
        }
        let figures = workers
            .iter()
            .zip(groups)
            .map(|(w, kv_group)| {
                let name = w.name();
                WorkerFigures {
                    instance: loads.id(name),
                    role: w.role(),
                    in_flight: w.in_flight(),
                    prefilling: loads.prefill.get(name).map(|t| t.values().copied().collect()).unwrap_or_default(),
                    decoding: loads.decode.get(name).map(|t| t.values().copied().collect()).unwrap_or_default(),
                    bound: loads.bound_to(name),
                    capacity_blocks: w.capacity_blocks(),
                    block_tokens: w.block_tokens(),
                    report: self.view.report(name),
                    kv_group,
                }
                .load(cost, now)
            })
            .collect();
        drop(loads);
        (workers, figures, now)
    }

    /// Routes a request among the workers not `excluded`.
    ///
    /// With `admit` (a request not yet started), whatever the policy, a disaggregated decision
    /// whose decode worker has no room for the request's context is refused (429) before any
    /// prefill is spent ([`decode_has_room`]); a request that has started (its decode half handed
    /// on) is not refused: the decode worker queues it, or recomputes.
    fn route(&self, valid: &ValidRequest, excluded: &[String], admit: bool) -> Result<Route, ApiError> {
        self.plan(valid, excluded, admit).map(|(route, _)| route).map_err(ApiError::from)
    }

    /// [`Self::route`], with the fetch of a cached prefix from another worker that the policy
    /// planned for the prompt's worker, if any; [`Refused::NoRoom`] where no decode worker has
    /// room for the request now (the policy's [`Decision::NoRoom`], or, with `admit`, the
    /// room check of its decode worker).
    fn plan(
        &self,
        valid: &ValidRequest,
        excluded: &[String],
        admit: bool,
    ) -> Result<(Route, Option<PlannedFetch>), Refused> {
        let config = &self.snapshot_config;
        let (workers, loads, now) = self.snapshot(excluded, &config.cost);
        let session = valid.session.as_deref().map(crate::routing::session_id);
        let request = RouteRequest { prompt: &valid.prompt_ids, max_tokens: valid.stop.max_tokens, session };
        // The decision over the snapshot: the lone-role fallback first, then the policy, and
        // whether the decode worker it chose has room (its plan's prediction is applied after).
        let decide = |trees: &GlobalPromptTrees| {
            let snapshot = cluster_snapshot(now, &loads, trees, config);
            if let Some(w) = lone_role_fallback(&snapshot) {
                return (Err(w), None);
            }
            let mut plan = self.policy.plan(&snapshot, &request);
            let room = match plan.decision {
                Decision::Disaggregated { decode, .. } => {
                    decode_has_room(&snapshot.instances[decode], valid.prompt_ids.len())
                }
                _ => true,
            };
            let predict = plan.predict.take();
            (Ok((plan, room)), predict)
        };
        let decided = if config.prompt_trees {
            // The policy reads the trees: they hold still for the decision, and take what it
            // predicts after it.
            let mut trees = self.view.trees().lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            ready_trees(&mut trees, now, &loads);
            let (decided, predict) = decide(&trees);
            if let Some(p) = &predict {
                trees.apply_predict(p, now);
            }
            decided
        } else {
            decide(&GlobalPromptTrees::new(0)).0
        };
        let (plan, room): (Plan, bool) = match decided {
            Ok(decided) => decided,
            Err((w, Fallback::LoneRole)) => {
                // A role has no live worker (its last one died, hung or left): the others run
                // requests whole until it is back, rather than refusing them all.
                tracing::debug!(worker = workers[w].name(), "a role has no live worker; running the request whole");
                return Ok((Route::Colocated(workers[w].clone()), None));
            }
            Err((w, Fallback::KvMismatch)) => {
                // No prefill worker's KV can go to a decode worker: a decode worker runs the
                // request whole rather than recompute a prompt the prefill worker computed.
                self.metrics.kv_incompatible.inc();
                tracing::debug!(
                    worker = workers[w].name(),
                    "no prefill worker shares a decode worker's KV type; running the request whole"
                );
                return Ok((Route::Colocated(workers[w].clone()), None));
            }
        };
        let route = match plan.decision {
            Decision::Colocated(w) => Ok(Route::Colocated(workers[w].clone())),
            Decision::Disaggregated { .. } if admit && !room => Err(Refused::NoRoom),
            // A request under way is not refused for room (see `route`): the decode worker with
            // the most room runs it on, queued there until it has room.
            Decision::NoRoom if !admit => match crate::routing::most_room_decoder(&loads) {
                Some(w) => Ok(Route::Colocated(workers[w].clone())),
                None => Err(Refused::NoRoom),
            },
            Decision::NoRoom => Err(Refused::NoRoom),
            Decision::Disaggregated { prefill, decode }
                if !baton_protocol::kv_exchangeable(&*workers[prefill], &*workers[decode]) =>
            {
                // Their KV servers would refuse each other (the snapshot's KV groups keep every
                // policy from such a pair; a custom one may not): the decode worker runs the
                // request whole rather than recompute the prompt after the prefill worker
                // computed it.
                self.metrics.kv_incompatible.inc();
                tracing::debug!(
                    prefill = workers[prefill].name(),
                    decode = workers[decode].name(),
                    "the workers' KV caches differ; running the request whole on the decode worker"
                );
                Ok(Route::Colocated(workers[decode].clone()))
            }
            Decision::Disaggregated { prefill, decode } => {
                Ok(Route::Disaggregated { prefill: workers[prefill].clone(), decode: workers[decode].clone() })
            }
            Decision::Reject { reason } => Err(ApiError::Overloaded { message: reason, retry_after_s: 1 }.into()),
            Decision::NoWorkers => Err(ApiError::Unavailable("no worker is available".into()).into()),
        };
        // A cached prefix is fetched only from a worker whose KV the prompt's worker can take.
        let fetch = plan
            .fetch
            .map(|f| PlannedFetch { from: workers[f.from].clone(), tokens: f.tokens.min(valid.prompt_ids.len()) })
            .filter(|f| match &route {
                Ok(Route::Colocated(w) | Route::Disaggregated { prefill: w, .. }) => {
                    baton_protocol::kv_exchangeable(&*f.from, &**w)
                }
                Err(_) => false,
            });
        if let Ok(r) = &route {
            let (prefill, decode) = match r {
                Route::Colocated(w) => (w.name(), w.name()),
                Route::Disaggregated { prefill, decode } => (prefill.name(), decode.name()),
            };
            let fetch_from = fetch.as_ref().map(|f| f.from.name());
            tracing::debug!(prefill, decode, fetch_from, fetch_tokens = fetch.as_ref().map(|f| f.tokens), "routed");
        }
        route.map(|r| (r, fetch))
    }

    /// Starts a request that has not started: routes it and claims its decode room, or, when no
    /// decode worker has room for it now, waits for room in the admission queue (first come,
    /// first served: only the head tries to start) as long as its predicted wait is within
    /// [`Self::with_max_queue_wait`]'s limit. Refused with a 400 when its prompt and answer need
    /// more KV than any decode worker has ([`Self::fits_a_decoder`]); with a 429 and
    /// `Retry-After` when its KV (all choices') fits no decode worker, when its predicted wait
    /// is over the limit (at arrival or as it waits),
    /// when the queue is full, or when the limit passes while it waits; nothing of it has been
    /// sent to a worker or to the client then. A client that goes away drops this future, and
    /// with it the request's place in the queue.
    async fn admit(
        self: &Arc<Self>,
        valid: &ValidRequest,
        id: RequestId,
    ) -> Result<(Route, Option<PlannedFetch>, Option<Binding>), ApiError> {
        /// How often a waiting request's wait is predicted again.
        const REPREDICT: Duration = Duration::from_secs(1);
        let tokens = valid.prompt_ids.len() * valid.n;
        self.fits_a_decoder(valid)?;
        let arrived = Instant::now();
        let mut ticket: Option<queue::Ticket> = None;
        let mut predicted_at: Option<Instant> = None;
        loop {
            let turn = ticket.as_ref().map_or_else(|| self.queue.is_empty(), queue::Ticket::is_head);
            if turn {
                match self.start(valid, id, tokens) {
                    // The ticket drops here: the next in the queue may try.
                    Ok(started) => return Ok(started),
                    Err(Refused::Api(e)) => return Err(e),
                    Err(Refused::NoRoom) => {}
                }
            }
            let waited = arrived.elapsed();
            if predicted_at.is_none_or(|at| at.elapsed() >= REPREDICT) {
                predicted_at = Some(Instant::now());
                match self.predict_wait(ticket.as_ref(), tokens) {
                    Prediction::Never => {
                        return Err(ApiError::Overloaded {
                            message: format!(
                                "the request's KV ({tokens} tokens) does not fit any decode worker's pool, even \
                                 empty; shorten the prompt, or add decode workers with more KV blocks"
                            ),
                            retry_after_s: 60,
                        });
                    }
                    Prediction::After(us) => {
                        if self.max_queue_wait.is_some_and(|limit| waited + Duration::from_micros(us) > limit) {
                            tracing::debug!(
                                predicted_s = us as f64 / 1e6,
                                waited_s = waited.as_secs_f64(),
                                hold_s = self.loads().hold_time.get().unwrap_or(0) as f64 / 1e6,
                                queued = self.queue.len(),
                                tokens,
                                "refused: predicted wait over the limit"
                            );
                            return Err(no_room(us.div_ceil(1_000_000)));
                        }
                    }
                    Prediction::Unknown => {}
                }
            }
            let left = self.max_queue_wait.map(|limit| limit.saturating_sub(waited));
            if left == Some(Duration::ZERO) {
                let retry = match self.predict_wait(ticket.as_ref(), tokens) {
                    Prediction::After(us) => us.div_ceil(1_000_000),
                    _ => 1,
                };
                return Err(no_room(retry));
            }
            let ticket = match &ticket {
                Some(t) => t,
                None => ticket.insert(self.queue.join(tokens).map_err(|queue::Full| ApiError::Overloaded {
                    message: format!("{MAX_QUEUED} requests are waiting already; retry later"),
                    retry_after_s: 1,
                })?),
            };
            // Wake to try (as the head), to predict again, or at the limit.
            let wait = left.unwrap_or(REPREDICT).min(REPREDICT);
            self.queue.changed(ticket, wait).await;
        }
    }

    /// Refuses (400) a request whose prompt and answer together need more KV than any worker
    /// that decodes has blocks, as each engine would: refused here, before its stream starts,
    /// rather than by the decode worker after the prefill's first token was streamed (#63: a
    /// 1,096-token request on 64-block workers failed after its 200). Capped at the model's
    /// context, as the engines cap it.
    fn fits_a_decoder(&self, valid: &ValidRequest) -> Result<(), ApiError> {
        let longest = (valid.prompt_ids.len() + valid.stop.max_tokens).min(self.validator.max_context);
        let decoders: Vec<(usize, usize)> = self
            .workers()
            .iter()
            .filter(|w| w.role() != crate::Role::Prefill && w.capacity_blocks() > 0)
            .map(|w| (w.capacity_blocks(), w.block_tokens().max(1)))
            .collect();
        if decoders.is_empty() || decoders.iter().any(|&(blocks, bs)| longest.div_ceil(bs) <= blocks) {
            return Ok(());
        }
        let (blocks, bs) = decoders.iter().copied().max_by_key(|&(b, bs)| b * bs).unwrap_or((0, 1));
        Err(ApiError::param(
            "max_tokens",
            format!(
                "prompt plus max_tokens ({longest} tokens) needs more KV blocks than any worker has \
                 ({blocks} of {bs} tokens)"
            ),
        ))
    }

    /// Routes a request and claims its decode room: [`Self::plan`], then [`Self::bind`].
    fn start(
        self: &Arc<Self>,
        valid: &ValidRequest,
        id: RequestId,
        tokens: usize,
    ) -> Result<(Route, Option<PlannedFetch>, Option<Binding>), Refused> {
        let (route, fetch) = self.plan(valid, &[], true)?;
        let binding = match &route {
            Route::Disaggregated { decode, .. } => Some(self.bind(decode.as_ref(), id, tokens)?),
            Route::Colocated(_) => None,
        };
        Ok((route, fetch, binding))
    }

    /// How long a request needing `tokens` of decode room is predicted to wait for it, behind
    /// the requests ahead of `ticket` (all those waiting, for `None`: an arrival), over the
    /// decode workers in routing (see [`queue::predict_starts`]). A waiter reads its prediction
    /// from the queue's last replay while it is fresh ([`REPLAY_FRESH`]); otherwise the whole
    /// queue is replayed once, for every waiter.
    fn predict_wait(&self, ticket: Option<&queue::Ticket>, tokens: usize) -> Prediction {
        if let Some(p) = ticket.and_then(|t| self.queue.replayed(t, REPLAY_FRESH)) {
            return p;
        }
        let entries = self.queue.entries();
        let tripped: Vec<String> = self.tripped().keys().cloned().collect();
        let workers: Workers = self
            .workers()
            .into_iter()
            .filter(|w| w.role() != crate::Role::Prefill && !tripped.iter().any(|t| t == w.name()))
            .collect();
        let loads = self.loads();
        // A wait is predicted (and a request refused on it) only once a few holds were
        // measured: one request's hold says little of the next's.
        let hold = loads.hold_time.get_after(HOLD_SAMPLES);
        let pools: Vec<queue::DecodePool> = workers
            .iter()
            .map(|w| loads.decode_pool(w.name(), w.capacity_blocks() * w.block_tokens(), hold.unwrap_or(0)))
            .collect();
        drop(loads);
        // The queue, with an arrival at its end.
        let mut needs: Vec<usize> = entries.iter().map(|&(_, n)| n).collect();
        if ticket.is_none() {
            needs.push(tokens);
        }
        let mut starts = queue::predict_starts(self.now_us(), &pools, &needs, hold);
        let mine = match ticket {
            None => starts.pop(),
            Some(t) => entries.iter().position(|&(id, _)| id == t.id()).map(|i| starts[i]),
        };
        self.queue.keep_replay(entries.into_iter().map(|(id, _)| id).collect(), starts);
        mine.unwrap_or(Prediction::Unknown)
    }

    /// Requests waiting in the admission queue now.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Validates a body into a request on a tokenizer worker (a blocking thread): tokenising a
    /// long prompt or rendering a chat template must not stall the runtime's other requests.
    async fn validate(&self, endpoint: Endpoint, body: Bytes) -> Result<ValidRequest, ApiError> {
        let permit = Arc::clone(&self.tokenizers)
            .acquire_owned()
            .await
            .map_err(|_| ApiError::Unavailable("the conductor is shutting down".into()))?;
        let validator = self.validator.clone();
        let span = tracing::Span::current();
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let _entered = span.entered();
            match endpoint {
                Endpoint::Completions => validator.completion(&body),
                Endpoint::Chat => validator.chat(&body),
            }
        })
        .await
        .unwrap_or_else(|e| Err(ApiError::Internal(format!("validating the request failed: {e}"))))
    }

    async fn handle(self: Arc<Self>, endpoint: Endpoint, headers: HeaderMap, body: Bytes) -> Response {
        let request_id = request_id_of(&headers);
        // The request's span: the conductor's logs, and (through `WorkRequest::request_id`) the
        // workers' and the KV transfer's, carry both ids (Baton's once the request is valid).
        let span = tracing::info_span!("request", request_id = %request_id, request = tracing::field::Empty);
        self.clone().handle_in(endpoint, &headers, body, request_id).instrument(span).await
    }

    async fn handle_in(
        self: Arc<Self>,
        endpoint: Endpoint,
        headers: &HeaderMap,
        body: Bytes,
        request_id: String,
    ) -> Response {
        let result = match self.authorize(headers) {
            Ok(()) => self.validate(endpoint, body).await,
            Err(e) => Err(e),
        };
        let valid = match result {
            Ok(mut v) => {
                if let Some(key) = headers.get("x-session-id").and_then(|h| h.to_str().ok()).filter(|k| !k.is_empty()) {
                    v.session = Some(key.to_owned());
                }
                v
            }
            Err(e) => {
                self.metrics.outcome(Outcome::Invalid);
                tracing::info!(status = e.status().as_u16(), error = %e.body(), "request refused");
                return e.into_response();
            }
        };
        // One id per choice (workers and transfers need distinct ones); the first names the
        // response.
        let id = RequestId(self.next_id.fetch_add(valid.n as u64, Ordering::Relaxed));
        // The elastic loop looks at the pools on each arrival, before the request may wait for
        // decode room: a queue building up is what it should see.
        if self.elastic.is_some() {
            self.elastic_wake.notify_one();
        }
        let admitted = self.admit(&valid, id).await;
        let (route, fetch, binding) = match admitted {
            Ok(r) => r,
            Err(e) => {
                // Counted here, once: a route refused later in the request's life is counted
                // by the run that asked, at its end.
                self.metrics.outcome(Outcome::of_error(&e));
                tracing::info!(status = e.status().as_u16(), "request not routed");
                return e.into_response();
            }
        };
        tracing::Span::current().record("request", id.0);
        tracing::info!(
            endpoint = ?endpoint,
            prompt_tokens = valid.prompt_ids.len(),
            max_tokens = valid.stop.max_tokens,
            stream = valid.stream,
            "request accepted"
        );
        let (tx, rx) = mpsc::unbounded_channel();
        let stream = valid.stream;
        let (prefilled, first_prefilled) = tokio::sync::oneshot::channel();
        let choice = |index: usize| Choice {
            valid: valid.clone(),
            id: RequestId(id.0 + index as u64),
            index,
            request_id: request_id.clone(),
        };
        let host = |index: usize, prefilled: Option<tokio::sync::oneshot::Sender<()>>| ChoiceHost {
            conductor: self.clone(),
            out: tx.clone(),
            index,
            prefilled,
        };
        if valid.n > 1 {
            // The other choices start once the first one's prompt KV is in its prefill (or
            // colocated) worker's prefix cache, on the same route: their prefill finds every
            // whole block of the prompt cached and computes only the partial last one.
            let others: Vec<(ChoiceHost, Choice)> = (1..valid.n).map(|i| (host(i, None), choice(i))).collect();
            let route = route.clone();
            let out = tx.clone();
            tokio::spawn(
                async move {
                    let _ = first_prefilled.await;
                    if out.is_closed() {
                        return;
                    }
                    for (host, choice) in others {
                        tokio::spawn(host.run(choice, route.clone(), None, None).in_current_span());
                    }
                }
                .in_current_span(),
            );
        }
        // Only the first choice fetches: the others start once its prompt is cached on its worker.
        let first = host(0, (valid.n > 1).then_some(prefilled));
        drop(tx);
        tokio::spawn(first.run(choice(0), route, fetch, binding).in_current_span());
        if stream { sse_response(valid, id, rx) } else { full_response(valid, id, rx).await }
    }
}
