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
use baton_sched::GlobalPromptTrees;
use serde_json::json;
use tokio::sync::mpsc;
use tracing::Instrument;

use crate::elastic::Elastic;
use crate::life::{self, Choice, FetchLease, Life, Settings, Waiting};
use crate::metrics::{Metrics, Outcome, WorkerGauges};
use crate::openai::{Endpoint, ValidRequest, Validator};
use crate::response::{Piece, full_response, sse_response};
use crate::routing::{Decision, RoutePolicy, RouteRequest, Snapshot, WorkerView, decode_has_room, lone_role_fallback};
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
const SWITCH_DEADLINE: Duration = Duration::from_secs(5);

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
}

/// The conductor's ledger of its workers: a stable instance id per name, and the requests in
/// prefill and in decode on each, kept by [`Tracked`] guards.
#[derive(Debug, Default)]
struct Loads {
    ids: HashMap<String, u32>,
    next_id: u32,
    /// Worker → request → (sent, µs; prompt tokens it computes, not cached there).
    prefill: HashMap<String, HashMap<u64, (u64, usize)>>,
    /// Worker → request → (decode start, µs; context tokens).
    decode: HashMap<String, HashMap<u64, (u64, usize)>>,
    /// Request → (its decode worker, KV tokens): admitted to a decode worker but not yet
    /// decoding there (in prefill, or handing over), kept by a [`Binding`]. Counted against the
    /// worker's room, so a burst cannot be admitted all at once against the same free blocks.
    bound: HashMap<u64, (String, usize)>,
    /// Worker → the sum of its `bound` tokens, kept with `bound` (a snapshot reads it per
    /// worker on every routing decision: no walk over every request in flight).
    bound_sums: HashMap<String, usize>,
    /// How long requests stay on their decode worker (predictive admission's `t_d`).
    decode_time: MovingMean,
}

impl Loads {
    /// KV tokens claimed on decode worker `name` by requests admitted to it and not decoding yet.
    fn bound_to(&self, name: &str) -> usize {
        self.bound_sums.get(name).copied().unwrap_or(0)
    }

    /// Binds `tokens` of request `id` to decode worker `worker`.
    fn bind(&mut self, id: u64, worker: &str, tokens: usize) {
        self.unbind(id);
        *self.bound_sums.entry(worker.to_owned()).or_insert(0) += tokens;
        self.bound.insert(id, (worker.to_owned(), tokens));
    }

    /// Ends request `id`'s binding, if it has one.
    fn unbind(&mut self, id: u64) {
        if let Some((worker, tokens)) = self.bound.remove(&id)
            && let Some(sum) = self.bound_sums.get_mut(&worker)
        {
            *sum -= tokens;
            if *sum == 0 {
                self.bound_sums.remove(&worker);
            }
        }
    }
}

/// An exponential moving mean of durations, µs (weight 1/16 for each new one).
#[derive(Debug, Default, Clone, Copy)]
struct MovingMean(Option<f64>);

impl MovingMean {
    /// Takes a duration in; the mean now.
    fn observe(&mut self, us: u64) -> u64 {
        let us = us as f64;
        let mean = self.0.map_or(us, |m| m + (us - m) / 16.0);
        self.0 = Some(mean);
        mean as u64
    }

    fn get(self) -> Option<u64> {
        self.0.map(|m| m as u64)
    }
}

impl Loads {
    fn id(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.ids.get(name) {
            return id;
        }
        let id = self.next_id;
        self.next_id += 1;
        self.ids.insert(name.to_owned(), id);
        id
    }
}

/// A request's entry in the ledger while it prefills or decodes on a worker; removed on drop.
pub(crate) struct Tracked {
    conductor: Arc<Conductor>,
    worker: String,
    id: u64,
    decode: bool,
}

/// A request's claim on room in its decode worker's KV pool from admission until its decode
/// starts there (which takes the claim over) or the request ends; dropping it gives the room
/// back.
pub(crate) struct Binding {
    conductor: Arc<Conductor>,
    id: u64,
}

impl Drop for Binding {
    fn drop(&mut self) {
        self.conductor.loads().unbind(self.id);
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let mut loads = self.conductor.loads();
        if self.decode {
            let began = loads.decode.get_mut(&self.worker).and_then(|r| r.remove(&self.id));
            if let Some((began, _)) = began {
                let mean = loads.decode_time.observe(self.conductor.now_us().saturating_sub(began));
                drop(loads);
                self.conductor.policy.decode_time(mean);
            }
        } else {
            loads.prefill.get_mut(&self.worker).map(|r| r.remove(&self.id));
        }
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
        policy.attach_index(Arc::clone(&trees));
        Self {
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
        }
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
        let (workers, snapshot) = self.snapshot(&[]);
        let Some(switch) = elastic.lock().unwrap_or_else(std::sync::PoisonError::into_inner).decide(&snapshot) else {
            return;
        };
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

    fn loads(&self) -> std::sync::MutexGuard<'_, Loads> {
        self.loads.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records that request `id` prefills `prompt` on `worker` until the guard drops. The ledger
    /// counts the tokens the worker will compute: the prompt less the prefix its KV events say
    /// its cache holds (none with `--kv-index predicted`, which applies no events), as the
    /// simulator's queues do. The prompt is hashed here a second time (the policy hashed it in
    /// blocks of its own size); next to tokenising it, that is small.
    fn track_prefill(self: &Arc<Self>, worker: &dyn Worker, id: RequestId, prompt: &[u32], fetched: usize) -> Tracked {
        let instance = InstanceId(self.loads().id(worker.name()));
        let block_tokens = worker.block_tokens().max(1);
        let hashes = baton_kv::prefix_hashes(prompt, block_tokens);
        let cached = self
            .view
            .trees()
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .confirmed_prefix_len(instance, &hashes)
            * block_tokens;
        self.track(worker, id, false, prompt.len().saturating_sub(cached.max(fetched)))
    }

    /// Records that request `id` prefills (`decode: false`, `tokens` to compute) or decodes
    /// (`tokens` = context) on `worker` until the guard drops.
    fn track(self: &Arc<Self>, worker: &dyn Worker, id: RequestId, decode: bool, tokens: usize) -> Tracked {
        let now = self.now_us();
        let mut loads = self.loads();
        let name = worker.name().to_owned();
        if decode {
            // Decoding, the request's context counts here: its admission claim is over.
            loads.unbind(id.0);
            loads.decode.entry(name.clone()).or_default().insert(id.0, (now, tokens));
        } else {
            loads.prefill.entry(name.clone()).or_default().insert(id.0, (now, tokens));
        }
        Tracked { conductor: Arc::clone(self), worker: name, id: id.0, decode }
    }

    /// Claims room for `tokens` of KV on decode worker `decode` for request `id`, or refuses
    /// (429) when what decodes there and what is already bound to it leave no room. Checked and
    /// claimed under one lock: concurrent admissions see each other's claims, so a burst is
    /// admitted only as far as the decode pool can hold it (the policy's check saw a snapshot).
    fn bind(self: &Arc<Self>, decode: &dyn Worker, id: RequestId, tokens: usize) -> Result<Binding, ApiError> {
        let capacity = decode.capacity_blocks() * decode.block_tokens();
        let mut loads = self.loads();
        let decoding: usize = loads.decode.get(decode.name()).map_or(0, |r| r.values().map(|&(_, t)| t).sum());
        if !crate::routing::room_for(capacity, decoding + loads.bound_to(decode.name()), tokens) {
            return Err(ApiError::Overloaded {
                message: "no decode worker has room for the request's KV now; retry later".into(),
                retry_after_s: 1,
            });
        }
        loads.bind(id.0, decode.name(), tokens);
        Ok(Binding { conductor: Arc::clone(self), id: id.0 })
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
        self.metrics.breaker_trips.fetch_add(1, Ordering::Relaxed);
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

    /// The HTTP API.
    pub fn router(self: Arc<Self>) -> axum::Router {
        self.follow_workers();
        self.run_elastic();
        axum::Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/models", get(models))
            .route("/health", get(health))
            .route("/metrics", get(metrics))
            .route("/debug/kv-index", get(kv_index))
            .fallback(|| async { ApiError::NotFound("no such endpoint".into()) })
            .layer(axum::middleware::from_fn(request_id))
            .with_state(self)
    }

    fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(key) = &self.api_key else { return Ok(()) };
        let given =
            headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        match given {
            Some(g) if constant_time_eq(g.as_bytes(), key.as_bytes()) => Ok(()),
            Some(_) => Err(ApiError::Unauthorized("incorrect API key".into())),
            None => Err(ApiError::Unauthorized("missing API key: send `Authorization: Bearer <key>`".into())),
        }
    }

    /// The workers a policy may pick (all but `excluded` and those whose breaker tripped) and
    /// the snapshot it sees of them.
    fn snapshot(&self, excluded: &[String]) -> (Workers, Snapshot) {
        let tripped = self.tripped().clone();
        let workers: Workers = self
            .workers()
            .into_iter()
            .filter(|w| !excluded.iter().any(|e| e == w.name()) && !tripped.contains_key(w.name()))
            .collect();
        let mut loads = self.loads();
        let views = workers
            .iter()
            .enumerate()
            .map(|(index, w)| {
                let name = w.name();
                let instance = loads.id(name);
                WorkerView {
                    index,
                    instance,
                    role: w.role(),
                    in_flight: w.in_flight(),
                    prefilling: loads.prefill.get(name).map(|t| t.values().copied().collect()).unwrap_or_default(),
                    decoding: loads.decode.get(name).map(|t| t.values().copied().collect()).unwrap_or_default(),
                    bound_tokens: loads.bound_to(name),
                    capacity_blocks: w.capacity_blocks(),
                    capacity_tokens: w.capacity_blocks() * w.block_tokens(),
                    report: self.view.report(name),
                }
            })
            .collect();
        drop(loads);
        (workers, Snapshot { workers: views, now_us: self.now_us() })
    }

    /// Routes a request among the workers not `excluded`.
    ///
    /// With `admit` (a request not yet started), whatever the policy, a disaggregated decision
    /// whose decode worker has no room for the request's context is refused (429) before any
    /// prefill is spent ([`decode_has_room`]); a request that has started (its decode half handed
    /// on) is not refused: the decode worker queues it, or recomputes.
    fn route(&self, valid: &ValidRequest, excluded: &[String], admit: bool) -> Result<Route, ApiError> {
        self.plan(valid, excluded, admit).map(|(route, _)| route)
    }

    /// [`Self::route`], with the fetch of a cached prefix from another worker that the policy
    /// planned for the prompt's worker, if any.
    fn plan(
        &self,
        valid: &ValidRequest,
        excluded: &[String],
        admit: bool,
    ) -> Result<(Route, Option<PlannedFetch>), ApiError> {
        let (workers, snapshot) = self.snapshot(excluded);
        if let Some(w) = lone_role_fallback(&snapshot) {
            // A role has no live worker (its last one died, hung or left): the others run
            // requests whole until it is back, rather than refusing them all.
            tracing::debug!(worker = workers[w].name(), "a role has no live worker; running the request whole");
            return Ok((Route::Colocated(workers[w].clone()), None));
        }
        let session = valid.session.as_deref().map(crate::routing::session_id);
        let request = RouteRequest { prompt: &valid.prompt_ids, max_tokens: valid.stop.max_tokens, session };
        let plan = self.policy.plan(&snapshot, &request);
        let fetch = plan
            .fetch
            .map(|f| PlannedFetch { from: workers[f.from].clone(), tokens: f.tokens.min(valid.prompt_ids.len()) });
        let route = match plan.decision {
            Decision::Colocated(w) => Ok(Route::Colocated(workers[w].clone())),
            Decision::Disaggregated { decode, .. }
                if admit && !decode_has_room(&snapshot.workers[decode], valid.prompt_ids.len()) =>
            {
                Err(ApiError::Overloaded {
                    message: "no decode worker has room for the request's KV now; retry later".into(),
                    retry_after_s: 1,
                })
            }
            Decision::Disaggregated { prefill, decode } => {
                Ok(Route::Disaggregated { prefill: workers[prefill].clone(), decode: workers[decode].clone() })
            }
            Decision::Reject { reason } => Err(ApiError::Overloaded { message: reason, retry_after_s: 1 }),
            Decision::NoWorkers => Err(ApiError::Unavailable("no worker is available".into())),
        };
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
        let planned = self.plan(&valid, &[], true);
        if self.elastic.is_some() {
            self.elastic_wake.notify_one();
        }
        // One id per choice (workers and transfers need distinct ones); the first names the
        // response.
        let id = RequestId(self.next_id.fetch_add(valid.n as u64, Ordering::Relaxed));
        let admitted = planned.and_then(|(route, fetch)| {
            let binding = match &route {
                Route::Disaggregated { decode, .. } => {
                    Some(self.bind(decode.as_ref(), id, valid.prompt_ids.len() * valid.n)?)
                }
                Route::Colocated(_) => None,
            };
            Ok((route, fetch, binding))
        });
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

/// The header naming a request across the client's, the conductor's and the workers' logs.
pub const REQUEST_ID_HEADER: &str = "x-request-id";
/// Longest `x-request-id` taken from a client (a longer or non-printable one is replaced).
const MAX_REQUEST_ID: usize = 128;

/// Gives every API request an `x-request-id`: the client's when it sent a usable one (1 to 128
/// printable ASCII characters), else a new one; handlers read it from the request's headers,
/// and every response carries it back.
async fn request_id(mut req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let given = req
        .headers()
        .get(REQUEST_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= MAX_REQUEST_ID && v.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_owned);
    let id = given.unwrap_or_else(new_request_id);
    let value = header::HeaderValue::from_str(&id).unwrap_or_else(|_| header::HeaderValue::from_static("invalid"));
    req.headers_mut().insert(REQUEST_ID_HEADER, value.clone());
    let mut response = next.run(req).await;
    response.headers_mut().insert(REQUEST_ID_HEADER, value);
    response
}

/// A new request id: 32 hex digits, unique in practice (time, process and a counter hashed).
fn new_request_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(nanos);
    h.write_u64(n);
    h.write_u32(std::process::id());
    format!("{:016x}{:016x}", h.finish(), (nanos as u64) ^ n.rotate_left(32))
}

/// The request's `x-request-id` (set by [`request_id`] on every API request).
fn request_id_of(headers: &HeaderMap) -> String {
    headers.get(REQUEST_ID_HEADER).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned()
}

/// Compares secrets without an early exit that would leak their common prefix's length.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    subtle::ConstantTimeEq::ct_eq(a, b).into()
}

async fn completions(State(c): State<Arc<Conductor>>, headers: HeaderMap, body: Bytes) -> Response {
    c.handle(Endpoint::Completions, headers, body).await
}

async fn chat_completions(State(c): State<Arc<Conductor>>, headers: HeaderMap, body: Bytes) -> Response {
    c.handle(Endpoint::Chat, headers, body).await
}

async fn models(State(c): State<Arc<Conductor>>, headers: HeaderMap) -> Response {
    if let Err(e) = c.authorize(&headers) {
        return e.into_response();
    }
    Json(json!({"object": "list", "data": [{"id": c.validator.model_id, "object": "model", "created": 0, "owned_by": "baton"}]}))
        .into_response()
}

/// Where a conductor's request ids start: a random point of [1, 2^62], so that conductor replicas
/// routing to the same workers hand them distinct ids (a worker refuses a second request under
/// an id it runs). Two replicas that each number n requests overlap with probability about
/// 2n / 2^62; counting from 1, as every conductor once did, they collide at once.
fn first_request_id() -> u64 {
    (rand::random::<u64>() >> 2) | 1
}

async fn health(State(c): State<Arc<Conductor>>, headers: HeaderMap) -> Response {
    if c.protect_metrics
        && let Err(e) = c.authorize(&headers)
    {
        return e.into_response();
    }
    let workers = c.workers();
    if workers.is_empty() {
        return (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "no workers"}))).into_response();
    }
    let names: Vec<_> = workers.iter().map(|w| json!({"name": w.name(), "role": w.role().as_str()})).collect();
    Json(json!({"status": "ok", "workers": names})).into_response()
}

async fn metrics(State(c): State<Arc<Conductor>>, headers: HeaderMap) -> Response {
    if c.protect_metrics
        && let Err(e) = c.authorize(&headers)
    {
        return e.into_response();
    }
    let mut gauges = Vec::new();
    for w in c.workers() {
        if let Some(s) = w.stats().await {
            gauges.push(WorkerGauges {
                name: w.name().to_owned(),
                role: w.role().as_str(),
                running: s.running,
                waiting: s.waiting,
                blocks_used: s.total_blocks - s.available_blocks,
                blocks_total: s.total_blocks,
            });
        }
    }
    let index = c.view.gauges();
    let mut text = c.metrics.render(&gauges, &index);
    if let Some(us) = c.loads().decode_time.get() {
        text.push_str(&crate::metrics::render_decode_time(us));
    }
    if let Some(elastic) = &c.elastic {
        let (prefill, decode) = elastic.lock().unwrap_or_else(std::sync::PoisonError::into_inner).loads();
        text.push_str(&crate::metrics::render_pool_loads(prefill, decode));
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// `GET /debug/kv-index`: what the conductor's index holds of each worker (confirmed blocks by
/// chained hash, with tiers) and each worker's last load report. Behind the API key.
async fn kv_index(State(c): State<Arc<Conductor>>, headers: HeaderMap) -> Response {
    if let Err(e) = c.authorize(&headers) {
        return e.into_response();
    }
    let mut workers = serde_json::Map::new();
    for w in c.workers() {
        let blocks: Vec<serde_json::Value> = c
            .view
            .blocks(w.name())
            .unwrap_or_default()
            .into_iter()
            .map(|(h, t)| json!([h.0, baton_protocol::wire::KvTier::from(t).as_str()]))
            .collect();
        workers.insert(w.name().to_owned(), json!({"blocks": blocks, "report": c.view.report(w.name())}));
    }
    Json(json!({"mode": format!("{:?}", c.view.mode()).to_lowercase(), "workers": workers})).into_response()
}

/// PD-Caching-3: after request `id` ended on `decode`, the prompt and answer's blocks that
/// `prefill` lacks go from `decode`'s cache into `prefill`'s (an export there, an import here),
/// so the session's next prompt is computed after its whole history. Off the request's path;
/// every wait has a deadline and a failure only leaves the cache as it was.
async fn return_kv(
    c: Arc<Conductor>,
    decode: Arc<dyn Worker>,
    prefill: Arc<dyn Worker>,
    id: RequestId,
    tokens: Vec<u32>,
) {
    let lease = baton_protocol::wire::return_lease(id.0);
    let Some(source) = decode.export_prefix(lease, &tokens, baton_protocol::control::EXPORT_DEADLINE).await else {
        return;
    };
    let _lease = FetchLease { from: decode, lease };
    let received = prefill.import_prefix(lease, tokens, source, baton_protocol::control::IMPORT_DEADLINE).await;
    if let Some(r) = received {
        tracing::debug!(tokens = r.tokens, "the answer's KV went back to the prefill worker");
        c.metrics.return_tokens.fetch_add(r.tokens as u64, Ordering::Relaxed);
    }
}

/// What a request choice's [`Life`] asks of the conductor.
struct ChoiceHost {
    conductor: Arc<Conductor>,
    /// The response's stream, shared by the request's choices.
    out: mpsc::UnboundedSender<(usize, Piece)>,
    index: usize,
    /// Told when this choice's prompt KV is in the prefix cache (the first of `n` choices).
    prefilled: Option<tokio::sync::oneshot::Sender<()>>,
}

impl life::Peer for Arc<dyn Worker> {
    type Events = mpsc::UnboundedReceiver<RequestEvent>;

    fn name(&self) -> &str {
        Worker::name(self.as_ref())
    }

    fn kv_addr(&self) -> Option<std::net::SocketAddr> {
        Worker::kv_addr(self.as_ref())
    }

    fn submit(&self, req: WorkRequest) -> Self::Events {
        Worker::submit(self.as_ref(), req)
    }

    fn release(&self, id: u64) {
        Worker::release(self.as_ref(), id);
    }
}

impl life::Host for ChoiceHost {
    type Peer = Arc<dyn Worker>;
    type Track = Tracked;

    fn route(&self, valid: &ValidRequest, excluded: &[String], admit: bool) -> Result<Route, ApiError> {
        self.conductor.route(valid, excluded, admit)
    }

    fn track_prefill(&self, worker: &Arc<dyn Worker>, id: RequestId, prompt: &[u32], fetched: usize) -> Tracked {
        self.conductor.track_prefill(worker.as_ref(), id, prompt, fetched)
    }

    fn track_decode(&self, worker: &Arc<dyn Worker>, id: RequestId, context: usize) -> Tracked {
        self.conductor.track(worker.as_ref(), id, true, context)
    }

    fn prefill_busy(&self, worker: &Arc<dyn Worker>) -> bool {
        self.conductor.loads().prefill.get(Worker::name(worker.as_ref())).is_some_and(|queued| !queued.is_empty())
    }

    fn fresh_id(&self) -> u64 {
        self.conductor.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn trip(&self, worker: &str, reason: &str) {
        let c = &self.conductor;
        if let Some(w) = c.workers().into_iter().find(|w| Worker::name(w.as_ref()) == worker) {
            c.trip(&w, reason);
        }
    }

    fn send(&mut self, piece: Piece) -> bool {
        self.out.send((self.index, piece)).is_ok()
    }

    fn logprob_entry(&self, token: u32, lp: &baton_model::TokenLogprobs) -> crate::openai::LogprobEntry {
        self.conductor.validator.logprob_entry(token, lp)
    }

    fn prefilled(&mut self) {
        if let Some(tx) = self.prefilled.take() {
            let _ = tx.send(());
        }
    }

    fn return_kv(&self, from: Arc<dyn Worker>, to: Arc<dyn Worker>, id: RequestId, tokens: Vec<u32>) {
        tokio::spawn(return_kv(self.conductor.clone(), from, to, id, tokens).in_current_span());
    }

    fn metrics(&self) -> &Metrics {
        &self.conductor.metrics
    }
}

impl ChoiceHost {
    /// Runs a choice of a request on `route` to its end (the task that drives its [`Life`]),
    /// holding `binding` (its claim on its decode worker's room) until then.
    async fn run(self, choice: Choice, route: Route, fetch: Option<PlannedFetch>, binding: Option<Binding>) {
        let _binding = binding;
        let c = self.conductor.clone();
        let settings =
            Settings { kv_transfer: c.kv_transfer, pd_caching: c.pd_caching, kv_bytes_per_token: c.kv_bytes_per_token };
        let out = self.out.clone();
        let mut life = Life::new(self, settings, choice, route, fetch, Instant::now());
        loop {
            enum Got {
                Event(RequestEvent),
                Offer(Option<KvSource>),
                Gone,
            }
            let got = match life.waiting() {
                Waiting::Done => break,
                Waiting::Worker { worker, events } => match next_event(worker, events, c.worker_silence, &out).await {
                    Some(event) => Got::Event(event),
                    None => Got::Gone,
                },
                Waiting::Offer { from, lease, tokens } => tokio::select! {
                    offer = from.export_prefix(lease, tokens, baton_protocol::control::EXPORT_DEADLINE) => Got::Offer(offer),
                    () = out.closed() => Got::Gone,
                },
            };
            let now = Instant::now();
            match got {
                Got::Event(event) => life.event(event, now),
                Got::Offer(offer) => life.offered(offer),
                Got::Gone => life.client_gone(now),
            }
        }
        debug_assert!(life.outcome().is_some(), "a life waits on nothing only once it is over");
    }
}

/// A worker's next event for a request, or `None` as soon as the client goes away. A worker
/// silent past `silence` is probed (its engine answers a stats call between steps): one that
/// answers is busy and the wait goes on, up to [`WORKER_SILENCE_MAX`]; one that does not, or
/// whose stream ends before the request does, is reported as [`RequestEvent::Lost`].
async fn next_event(
    worker: &Arc<dyn Worker>,
    events: &mut mpsc::UnboundedReceiver<RequestEvent>,
    silence: Duration,
    out: &mpsc::UnboundedSender<(usize, Piece)>,
) -> Option<RequestEvent> {
    let lost = |reason: &str| Some(RequestEvent::Lost { reason: reason.to_owned() });
    let since = Instant::now();
    loop {
        let event = tokio::select! {
            e = tokio::time::timeout(silence, events.recv()) => e,
            () = out.closed() => return None,
        };
        match event {
            Ok(Some(e)) => return Some(e),
            Ok(None) => return lost("it stopped before finishing the request"),
            Err(_) if since.elapsed() >= WORKER_SILENCE_MAX => {
                return lost("it sent nothing for this request in ten minutes");
            }
            Err(_) => {
                // Silent: queued behind other requests, or dead? Its engine answers a stats
                // call between steps; a busy worker is not taken for a dead one.
                let alive = tokio::select! {
                    stats = worker.stats() => stats.is_some(),
                    () = out.closed() => return None,
                };
                if !alive {
                    return lost("it sent nothing and did not answer a probe in time");
                }
                tracing::debug!(worker = worker.name(), silent_s = since.elapsed().as_secs(), "worker busy; waiting");
            }
        }
    }
}
