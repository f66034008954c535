//! The conductor: the OpenAI-compatible HTTP API in front of the workers, and each request's
//! life across them.
//!
//! A request is validated into a [`ValidRequest`], routed by the [`RoutePolicy`], then run:
//! colocated, it goes to one worker; disaggregated, the prefill worker computes the prompt and
//! the first token and keeps the KV under a lease, the conductor streams that token, the decode
//! worker reserves blocks of its own and pulls the KV into them (or, in push mode, the prefill
//! worker writes it into them: [`crate::handoff`]), the prefill worker is told to release
//! whatever it still holds, and the decode worker streams the rest. A client that disconnects
//! drops the response stream, which drops the worker's event receiver, which aborts the request
//! (and any transfer of its KV in flight) and frees its KV.
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
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use baton_engine::{RequestId, StopParams};
use baton_kv::InstanceId;
use baton_model::SamplingParams;
use baton_sched::GlobalPromptTrees;
use serde_json::json;
use tokio::sync::mpsc;
use tracing::Instrument;

use crate::elastic::Elastic;
use crate::error::ApiError;
use crate::handoff::KvTransfer;
use crate::metrics::{FetchOutcome, Metrics, Outcome, WorkerGauges};
use crate::openai::{Endpoint, ValidRequest, Validator};
use crate::response::{Piece, full_response, sse_response};
use crate::routing::{Decision, RoutePolicy, RouteRequest, Snapshot, WorkerView, decode_has_room, lone_role_fallback};
use crate::view::{ClusterView, KvIndexMode, PREDICTED_TTL_US};
use crate::wire::{KvSource, PdCaching, Received, WorkerError, fetch_lease};
use crate::worker::{Finish, RequestEvent, WorkRequest, Worker};

/// How long a request's worker may stay silent before the conductor asks whether it is alive
/// (the default of [`Conductor::with_worker_silence`]). A request queued behind others on a
/// busy worker sends nothing until its turn: silence alone is not death.
pub const WORKER_SILENCE: Duration = Duration::from_secs(30);
/// The longest a request waits on a worker that answers probes but sends the request nothing:
/// past it the request is failed (and goes on elsewhere if it can), never left to hang.
const WORKER_SILENCE_MAX: Duration = Duration::from_secs(600);
/// How many times a request whose worker was lost before it streamed anything is routed again.
const MAX_RETRIES: usize = 2;
/// First wait before probing a worker whose breaker tripped; it doubles up to `PROBE_MAX`,
/// jittered.
const PROBE_FIRST: Duration = Duration::from_millis(250);
/// Longest wait between probes of a tripped worker.
const PROBE_MAX: Duration = Duration::from_secs(5);
/// How long a worker may take to answer a role switch.
const SWITCH_DEADLINE: Duration = Duration::from_secs(5);

type Workers = Vec<Arc<dyn Worker>>;

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
struct Tracked<'a> {
    conductor: &'a Conductor,
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

impl Drop for Tracked<'_> {
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
    fn track_prefill(&self, worker: &dyn Worker, id: RequestId, prompt: &[u32], fetched: usize) -> Tracked<'_> {
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
    fn track(&self, worker: &dyn Worker, id: RequestId, decode: bool, tokens: usize) -> Tracked<'_> {
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
        Tracked { conductor: self, worker: name, id: id.0, decode }
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
            let mut waits = crate::retry::backoff(PROBE_FIRST, PROBE_MAX);
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
        let run = |index: usize, prefilled: Option<tokio::sync::oneshot::Sender<()>>| Run {
            conductor: self.clone(),
            valid: valid.clone(),
            id: RequestId(id.0 + index as u64),
            index,
            request_id: request_id.clone(),
            out: tx.clone(),
            streamed: AtomicBool::new(false),
            cached_tokens: OnceLock::new(),
            prefilled: Mutex::new(prefilled),
            fetch: Mutex::new(None),
        };
        let first = run(0, (valid.n > 1).then_some(prefilled));
        // Only the first choice fetches: the others start once its prompt is cached on its worker.
        *first.fetch.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = fetch;
        if valid.n > 1 {
            // The other choices start once the first one's prompt KV is in its prefill (or
            // colocated) worker's prefix cache, on the same route: their prefill finds every
            // whole block of the prompt cached and computes only the partial last one.
            let others: Vec<Run> = (1..valid.n).map(|i| run(i, None)).collect();
            let route = route.clone();
            let out = tx.clone();
            tokio::spawn(
                async move {
                    let _ = first_prefilled.await;
                    if out.is_closed() {
                        return;
                    }
                    for r in others {
                        tokio::spawn(r.run(route.clone(), None).in_current_span());
                    }
                }
                .in_current_span(),
            );
        }
        drop(tx);
        tokio::spawn(first.run(route, binding).in_current_span());
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
            .map(|(h, t)| json!([h.0, crate::wire::KvTier::from(t).as_str()]))
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
    let lease = crate::wire::return_lease(id.0);
    let Some(source) = decode.export_prefix(lease, &tokens, crate::control::EXPORT_DEADLINE).await else {
        return;
    };
    let _lease = FetchLease { from: decode, lease };
    let received = prefill.import_prefix(lease, tokens, source, crate::control::IMPORT_DEADLINE).await;
    if let Some(r) = received {
        tracing::debug!(tokens = r.tokens, "the answer's KV went back to the prefill worker");
        c.metrics.return_tokens.fetch_add(r.tokens as u64, Ordering::Relaxed);
    }
}

/// A fetch the policy planned: the prompt's first `tokens` tokens, cached on `from`.
struct PlannedFetch {
    from: Arc<dyn Worker>,
    tokens: usize,
}

/// A cached prefix a worker offers for one request's fetch. Dropping it ends the offer's lease
/// on the holder (a no-op once the fetching worker COMPLETEd its pull): whatever becomes of the
/// request, the holder's blocks are not kept for it.
struct FetchLease {
    from: Arc<dyn Worker>,
    lease: u64,
}

impl Drop for FetchLease {
    fn drop(&mut self) {
        self.from.release(self.lease);
    }
}

/// A fetch under way for a request's prompt worker: what was offered, and the lease on it.
struct Fetching {
    source: KvSource,
    _lease: FetchLease,
}

/// Where a request runs.
#[derive(Clone)]
enum Route {
    Colocated(Arc<dyn Worker>),
    Disaggregated { prefill: Arc<dyn Worker>, decode: Arc<dyn Worker> },
}

/// One request's life across the workers.
struct Run {
    conductor: Arc<Conductor>,
    valid: ValidRequest,
    id: RequestId,
    /// Which of the request's `n` choices this run generates.
    index: usize,
    /// The client's (or a generated) `x-request-id`, passed to the workers for their logs.
    request_id: String,
    out: mpsc::UnboundedSender<(usize, Piece)>,
    /// Whether any text reached the client (after which a lost worker cannot be hidden).
    streamed: AtomicBool,
    /// Prompt tokens the prefill (or colocated) worker served from its prefix cache: the first
    /// worker to finish sets it, so a decode worker's received KV does not count.
    cached_tokens: OnceLock<usize>,
    /// Told when this choice's prompt KV is in the prefix cache (the first of `n` choices).
    prefilled: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    /// The fetch of a cached prefix the policy planned; the first attempt takes it (a request
    /// routed again computes its prompt where it lands).
    fetch: Mutex<Option<PlannedFetch>>,
}

impl Run {
    /// Starts the planned fetch for the worker about to compute the prompt, `to`: asks the
    /// holder to offer its cached prefix under a lease (within [`crate::control::EXPORT_DEADLINE`]).
    /// `None` when none was planned, `to` holds it itself, or the holder offers nothing in time:
    /// the prompt is then computed whole, as without a fetch.
    async fn start_fetch(&self, to: &dyn Worker) -> Option<Fetching> {
        let planned = self.fetch.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take()?;
        if planned.from.name() == to.name() || planned.tokens == 0 {
            return None;
        }
        let lease = FetchLease { from: planned.from.clone(), lease: fetch_lease(self.id.0) };
        let tokens = &self.valid.prompt_ids[..planned.tokens];
        match planned.from.export_prefix(lease.lease, tokens, crate::control::EXPORT_DEADLINE).await {
            Some(source) => {
                tracing::info!(
                    from = planned.from.name(),
                    to = to.name(),
                    tokens = source.tokens,
                    "fetching a cached prefix"
                );
                Some(Fetching { source, _lease: lease })
            }
            None => {
                tracing::info!(
                    from = planned.from.name(),
                    "the planned prefix is not offered; computing the prompt whole"
                );
                self.conductor.metrics.fetch(FetchOutcome::Unavailable, None);
                None
            }
        }
    }

    /// Counts how a fetch sent with the prompt's work ended: `received` is what the worker
    /// says it received before computing.
    fn fetch_ended(&self, fetching: Option<&Fetching>, received: Option<Received>) {
        if fetching.is_some() {
            let outcome = if received.is_some() { FetchOutcome::Fetched } else { FetchOutcome::Recomputed };
            self.conductor.metrics.fetch(outcome, received);
        }
    }

    /// The prompt's KV is cached now: the other choices may start. Also counts the prompt
    /// tokens the prefill computed.
    fn prefill_done(&self, worker: &str, prompt_tokens: usize, cached_tokens: usize) {
        let m = &self.conductor.metrics;
        m.prefill_tokens.fetch_add(prompt_tokens.saturating_sub(cached_tokens) as u64, Ordering::Relaxed);
        m.prefix_cache(worker, prompt_tokens, cached_tokens);
        if let Some(tx) = self.prefilled.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take() {
            let _ = tx.send(());
        }
    }

    /// Runs the request on `route` to its end, holding `binding` (its claim on its decode
    /// worker's room) until its decode starts or it ends.
    async fn run(self, mut route: Route, binding: Option<Binding>) {
        let _binding = binding;
        let c = self.conductor.clone();
        let start = Instant::now();
        let mut lost_workers = Vec::new();
        // Tokens a colocated worker streamed: a worker lost mid-stream hands them on.
        let mut so_far: Vec<u32> = Vec::new();
        let result = loop {
            let result = match &route {
                Route::Colocated(_) if so_far.len() >= self.valid.stop.max_tokens => {
                    // Lost after its last token, before saying so: nothing is left to generate.
                    self.finish(Finish::Length, self.valid.prompt_ids.len(), so_far.len())
                }
                Route::Colocated(w) => {
                    c.metrics.routed_colocated.fetch_add(1, Ordering::Relaxed);
                    let fetching = self.start_fetch(w.as_ref()).await;
                    let fetch = fetching.as_ref().map(|f| f.source.clone());
                    let fetched = fetch.as_ref().map_or(0, |f| f.tokens);
                    let events = w.submit(WorkRequest { generated: so_far.clone(), fetch, ..self.request() });
                    let prefill = c.track_prefill(w.as_ref(), self.id, &self.valid.prompt_ids, fetched);
                    let mut relayed = Vec::new();
                    let result = self.relay(w, events, start, None, Some((prefill, fetching)), &mut relayed).await;
                    so_far.extend(relayed);
                    result
                }
                Route::Disaggregated { prefill, decode } => {
                    c.metrics.routed_disaggregated.fetch_add(1, Ordering::Relaxed);
                    self.disaggregated(prefill, decode, start).await
                }
            };
            match result {
                // Lost before anything was streamed: route the request again. Lost after a
                // colocated worker streamed tokens: migrate — another worker continues from the
                // prompt and those tokens (it recomputes their KV), so the client's stream goes
                // on with no duplicate and, for greedy requests, the same tokens.
                Err(RunError::Lost { worker, reason })
                    if (!so_far.is_empty() || !self.streamed.load(Ordering::Relaxed))
                        && lost_workers.len() < MAX_RETRIES =>
                {
                    self.handed_on(&worker, &reason, so_far.len());
                    lost_workers.push(worker);
                    // (A request that streamed nothing is refused again if it must be.)
                    match c.route(&self.valid, &lost_workers, so_far.is_empty()) {
                        // A migrated request has its first tokens: it continues on one worker.
                        Ok(Route::Disaggregated { decode, .. }) if !so_far.is_empty() => {
                            route = Route::Colocated(decode);
                        }
                        Ok(r) => route = r,
                        Err(e) => break Err(RunError::Api(e)),
                    }
                }
                other => break other,
            }
        };
        let outcome = match result {
            Ok(()) => Outcome::Ok,
            Err(RunError::Cancelled) => Outcome::Cancelled,
            Err(RunError::Lost { worker, reason }) => {
                self.trip_named(&worker, &reason);
                tracing::warn!(request = self.id.0, worker, reason, "worker lost mid-request");
                let _ = self.out.send((
                    self.index,
                    Piece::Failed(ApiError::Internal("a worker was lost while running the request; retry it".into())),
                ));
                Outcome::Failed
            }
            Err(RunError::Api(ApiError::Internal(detail)) | RunError::Handoff(detail)) => {
                // The detail names workers' addresses and internals: the log's, not the client's.
                tracing::error!(request = self.id.0, error = detail, "request failed");
                let message = format!(
                    "the request failed inside the cluster; the conductor's log has the details under x-request-id `{}`",
                    self.request_id
                );
                let _ = self.out.send((self.index, Piece::Failed(ApiError::Internal(message))));
                Outcome::Failed
            }
            Err(RunError::Api(e)) => {
                let o = Outcome::of_error(&e);
                let _ = self.out.send((self.index, Piece::Failed(e)));
                o
            }
        };
        tracing::info!(outcome = ?outcome, choice = self.index, "request finished");
        c.metrics.outcome(outcome);
        c.metrics.e2e.observe(start.elapsed().as_secs_f64());
    }

    /// Books a worker lost while running this request, which goes on elsewhere: trips its
    /// breaker and counts a retry, or a migration when the lost worker had streamed `tokens`.
    fn handed_on(&self, worker: &str, reason: &str, tokens: usize) {
        let m = &self.conductor.metrics;
        self.trip_named(worker, reason);
        m.retries.fetch_add(1, Ordering::Relaxed);
        if tokens > 0 {
            m.migrations.fetch_add(1, Ordering::Relaxed);
        }
        tracing::warn!(request = self.id.0, worker, reason, tokens, "worker lost; the request goes on on another");
    }

    /// Trips the breaker of the worker named `name`, if the conductor still knows it.
    fn trip_named(&self, name: &str, reason: &str) {
        let c = &self.conductor;
        if let Some(w) = c.workers().into_iter().find(|w| w.name() == name) {
            c.trip(&w, reason);
        }
    }

    /// Another worker to decode on, after `tried` failed: the decode worker (or else the
    /// colocated worker) the policy picks among the rest.
    fn reroute_decode(&self, tried: &[String]) -> Option<Arc<dyn Worker>> {
        match self.conductor.route(&self.valid, tried, false).ok()? {
            Route::Disaggregated { decode, .. } => Some(decode),
            Route::Colocated(w) => Some(w),
        }
    }

    fn request(&self) -> WorkRequest {
        let v = &self.valid;
        WorkRequest {
            id: self.id.0,
            request_id: Some(self.request_id.clone()),
            prompt: v.prompt_ids.clone(),
            generated: Vec::new(),
            sampling: SamplingParams {
                seed: v.sampling.seed.map(|s| s.wrapping_add(self.index as u64)),
                ..v.sampling.clone()
            },
            stop: v.stop.clone(),
            logprobs: v.logprobs,
            stop_token_ids: v.stop_token_ids.clone(),
            retain_kv: false,
            kv_transfer: self.conductor.kv_transfer,
            kv: None,
            fetch: None,
            prefix_cache: self.conductor.pd_caching != PdCaching::Basic,
        }
    }

    async fn disaggregated(&self, p: &Arc<dyn Worker>, d: &Arc<dyn Worker>, start: Instant) -> Result<(), RunError> {
        let c = &self.conductor;
        // Prefill: the prompt and the first token; the KV stays on `p` under a lease (in push
        // mode, `p` also waits to write it into `d`'s blocks). (With max_tokens 1 the request
        // ends there: nothing to hand over.)
        let retain_kv = self.valid.stop.max_tokens > 1;
        let base = self.request();
        let stop = StopParams { max_tokens: 1, ..base.stop.clone() };
        let fetching = self.start_fetch(p.as_ref()).await;
        let fetch = fetching.as_ref().map(|f| f.source.clone());
        let fetched = fetch.as_ref().map_or(0, |f| f.tokens);
        // Layer-wise: the decode worker has the request now, reserves blocks for the prompt's
        // KV and registers them with `p`'s KV server, which writes each layer into them as the
        // prefill computes it; the last write brings the first token. Only when `p` prefills
        // nothing else for this conductor: behind a queue, the reservation would hold decode
        // memory idle for the queue's time, so the KV is pulled once the prefill is done (as
        // it is without `p`'s KV server address).
        let p_busy = c.loads().prefill.get(p.name()).is_some_and(|queued| !queued.is_empty());
        let mut early = match (base.kv_transfer, p.kv_addr()) {
            (KvTransfer::Layerwise, Some(addr)) if retain_kv && !p_busy => {
                let tokens = self.valid.prompt_ids.len();
                let kv = Some(KvSource { addr, blocks: Vec::new(), tokens, lease: None });
                let prefix_cache = c.pd_caching >= PdCaching::Decode;
                Some(d.submit(WorkRequest { kv, prefix_cache, ..self.request() }))
            }
            _ => None,
        };
        let kv_transfer = if early.is_some() { base.kv_transfer } else { base.kv_transfer.after_prefill() };
        let mut events = p.submit(WorkRequest { stop, retain_kv, fetch, kv_transfer, ..base });
        let prefill = c.track_prefill(p.as_ref(), self.id, &self.valid.prompt_ids, fetched);
        let mut first = Vec::new();
        let prefilled = async {
            loop {
                match self.next(p, &mut events).await? {
                    RequestEvent::Token { token, text, logprobs } => {
                        c.metrics.ttft.observe(start.elapsed().as_secs_f64());
                        first.push(token);
                        self.send_logprobs(token, logprobs)?;
                        self.send(Piece::Text(text))?;
                    }
                    RequestEvent::Finished { reason, prompt_tokens, kv, cached_tokens, received, .. } => {
                        let _ = self.cached_tokens.set(cached_tokens);
                        self.fetch_ended(fetching.as_ref(), received);
                        self.prefill_done(p.name(), prompt_tokens, cached_tokens);
                        break Ok((reason, prompt_tokens, kv));
                    }
                    RequestEvent::Failed(e) => break Err(RunError::Api(e.into())),
                    RequestEvent::Lost { reason } => break Err(RunError::Lost { worker: p.name().to_owned(), reason }),
                }
            }
        };
        let (reason, prompt_tokens, kv) = match prefilled.await {
            Ok(done) => done,
            // Lost after its first token (the client has it) but before it said it finished:
            // the decode side goes on from the prompt and that token, recomputing their KV as a
            // migrated request does.
            Err(RunError::Lost { worker, reason }) if !first.is_empty() => {
                self.handed_on(&worker, &reason, first.len());
                (Finish::Length, self.valid.prompt_ids.len(), None)
            }
            Err(e) => {
                // The client may have gone just as the prefill finished, or the worker's stream
                // was lost (a half-open connection, a partition) after it offered the KV: the
                // conductor never heard of the hand-off, but releases it by the request's id, so
                // a worker still alive does not hold it until its lease ends. (Dropping `early`
                // aborts the decode worker's half, and frees the blocks it reserved.)
                p.release(self.id.0);
                return Err(e);
            }
        };
        drop(prefill);
        drop(fetching);
        let done_at_prefill = reason != Finish::Length || self.valid.stop.max_tokens == 1;
        let prefill_lost = kv.is_none() && !done_at_prefill;
        let kv = kv.filter(|_| !done_at_prefill);
        if kv.is_none() && !prefill_lost {
            drop(early);
            p.release(self.id.0);
            return self.finish(reason, prompt_tokens, first.len());
        }
        // Decode: reserve blocks and pull the KV into them, or have `p` push it (COMPLETE
        // releases it on the prefill side), then stream the rest.
        let handoff = Instant::now();
        let mut decode = d.clone();
        let mut tried = Vec::new();
        // Every token the client has: the prefill's first, then the decode workers'.
        let mut generated = first.clone();
        let mut handoff = kv.is_some().then_some(handoff);
        let result = loop {
            if generated.len() >= self.valid.stop.max_tokens {
                // Lost after its last token, before saying so.
                break self.finish(Finish::Length, prompt_tokens, generated.len());
            }
            let context = self.valid.prompt_ids.len() + generated.len();
            let _decode = c.track(decode.as_ref(), self.id, true, context);
            // The prefill worker's lease holds the prompt's KV until a decode worker completes its
            // transfer; a migrated request recomputes its KV instead.
            let kv = kv.clone().filter(|_| generated.len() == first.len());
            // Decode workers keep (and reuse) requests' KV only in PD-Caching-2.
            let prefix_cache = c.pd_caching >= PdCaching::Decode;
            // The prefill is over: a hand-off from here on pulls what `p` leases (a layer-wise
            // one already is on its way, in `early`).
            let kv_transfer = c.kv_transfer.after_prefill();
            let layerwise = early.is_some();
            // With no decode worker left, the prefill worker itself runs the rest whole
            // (`lone_role_fallback`): it gives up what it held for the lost hand-off, and the
            // rest runs under a fresh id, since the old one may still be settling there.
            let on_prefill_worker = decode.name() == p.name();
            let id = if on_prefill_worker {
                p.release(self.id.0);
                c.next_id.fetch_add(1, Ordering::Relaxed)
            } else {
                self.id.0
            };
            let events = match early.take() {
                Some(events) => events,
                None => decode.submit(WorkRequest {
                    id,
                    generated: generated.clone(),
                    kv: kv.filter(|_| !on_prefill_worker),
                    prefix_cache,
                    kv_transfer,
                    ..self.request()
                }),
            };
            let mut relayed = Vec::new();
            let result = self.relay(&decode, events, start, handoff.take(), None, &mut relayed).await;
            let streamed_here = relayed.len();
            if layerwise && streamed_here > 0 {
                c.metrics.layerwise_handoffs.fetch_add(1, Ordering::Relaxed);
            }
            generated.extend(relayed);
            // A decode worker lost: hand the decode to another, before its first token (it pulls
            // the KV if the lease still holds it, else recomputes) or mid-stream (migration: it
            // recomputes the KV of the prompt and the tokens so far, and continues).
            match result {
                // The layer-wise hand-off failed (the prefill worker died mid-stream, or the
                // decode worker had no room in time): the decode worker gave the request back
                // before streaming anything; it gets it again with the first token, and pulls
                // the KV if `p` still leases it, else recomputes it.
                Err(RunError::Handoff(reason)) => {
                    tracing::warn!(request = self.id.0, reason, "layer-wise hand-off failed; handing over again");
                    c.metrics.retries.fetch_add(1, Ordering::Relaxed);
                    handoff = Some(Instant::now());
                }
                Err(RunError::Lost { worker, reason }) if tried.len() < MAX_RETRIES => {
                    self.handed_on(&worker, &reason, streamed_here);
                    tried.push(worker.clone());
                    match self.reroute_decode(&tried) {
                        Some(next) => decode = next,
                        None => break Err(RunError::Lost { worker, reason }),
                    }
                }
                other => break other,
            }
        };
        // Whatever happened on the decode side, the prefill side's blocks are not needed any
        // more (a no-op when the pull completed).
        p.release(self.id.0);
        if result.is_ok() && c.pd_caching == PdCaching::Return {
            let tokens: Vec<u32> = self.valid.prompt_ids.iter().chain(&generated).copied().collect();
            tokio::spawn(return_kv(c.clone(), decode, p.clone(), self.id, tokens).in_current_span());
        }
        result
    }

    /// Streams a worker's events to the response. With `handoff`, the first event means the
    /// KV was pulled: record the hand-off (and, when the request ends, the KV the worker says it
    /// received: tokens it cached already did not travel).
    async fn relay(
        &self,
        worker: &Arc<dyn Worker>,
        mut events: mpsc::UnboundedReceiver<RequestEvent>,
        start: Instant,
        mut handoff: Option<Instant>,
        mut prefill: Option<(Tracked<'_>, Option<Fetching>)>,
        relayed: &mut Vec<u32>,
    ) -> Result<(), RunError> {
        let c = &self.conductor;
        let mut last = None;
        let mut _decode = None;
        let colocated = prefill.is_some();
        let mut fetching = None;
        loop {
            let event = self.next(worker, &mut events).await?;
            if let Some(t) = handoff.take()
                && !matches!(event, RequestEvent::Failed(_) | RequestEvent::Lost { .. })
            {
                c.metrics.transfer.observe(t.elapsed().as_secs_f64());
                last = Some(Instant::now());
            }
            match event {
                RequestEvent::Token { token, text, logprobs } => {
                    // A colocated worker's first token ends its prefill.
                    if let Some((_, f)) = prefill.take() {
                        fetching = f;
                        _decode = Some(c.track(worker.as_ref(), self.id, true, self.valid.prompt_ids.len() + 1));
                    }
                    let now = Instant::now();
                    match last {
                        // (A migrated request's first token here is not its first.)
                        None if relayed.is_empty() && !self.streamed.load(Ordering::Relaxed) => {
                            c.metrics.ttft.observe(start.elapsed().as_secs_f64());
                        }
                        None => {}
                        Some(t) => c.metrics.tbt.observe((now - t).as_secs_f64()),
                    }
                    last = Some(now);
                    relayed.push(token);
                    self.send_logprobs(token, logprobs)?;
                    self.send(Piece::Text(text))?;
                }
                RequestEvent::Finished {
                    reason, prompt_tokens, completion_tokens, cached_tokens, received, ..
                } => {
                    let _ = self.cached_tokens.set(cached_tokens);
                    if let Some(r) = received.filter(|_| !colocated) {
                        c.metrics.transfer_tokens.fetch_add(r.tokens as u64, Ordering::Relaxed);
                        let bytes = c.kv_bytes_per_token.map_or(r.bytes, |b| (r.tokens * b) as u64);
                        c.metrics.transfer_bytes.fetch_add(bytes, Ordering::Relaxed);
                    }
                    if colocated {
                        let fetching = fetching.take().or_else(|| prefill.take().and_then(|(_, f)| f));
                        self.fetch_ended(fetching.as_ref(), received);
                        self.prefill_done(worker.name(), prompt_tokens, cached_tokens);
                    }
                    return self.finish(reason, prompt_tokens, completion_tokens);
                }
                RequestEvent::Failed(WorkerError::Handoff(reason)) => return Err(RunError::Handoff(reason)),
                RequestEvent::Failed(e) => return Err(RunError::Api(e.into())),
                RequestEvent::Lost { reason } => {
                    return Err(RunError::Lost { worker: worker.name().to_owned(), reason });
                }
            }
        }
    }

    fn finish(&self, reason: Finish, prompt_tokens: usize, completion_tokens: usize) -> Result<(), RunError> {
        if reason == Finish::GrammarFailed {
            // The text so far is not a sentence of the grammar: the client must not take it
            // for a complete output (a 400 before the body, or an error event in a stream).
            return Err(RunError::Api(ApiError::param(
                "response_format",
                format!(
                    "the output's grammar (`response_format` or a forced tool call) failed after {completion_tokens} \
                     tokens: the grammar engine cannot serve this schema (too deep a recursion, or a pattern past its \
                     limits); simplify it"
                ),
            )));
        }
        let m = &self.conductor.metrics;
        if self.index == 0 {
            m.prompt_tokens.fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        }
        m.generation_tokens.fetch_add(completion_tokens as u64, Ordering::Relaxed);
        let cached_tokens = self.cached_tokens.get().copied().unwrap_or(0);
        self.send(Piece::Done { reason, prompt_tokens, completion_tokens, cached_tokens })
    }

    fn send_logprobs(&self, token: u32, logprobs: Option<baton_model::TokenLogprobs>) -> Result<(), RunError> {
        match logprobs {
            Some(lp) => self.send(Piece::Logprobs(self.conductor.validator.logprob_entry(token, &lp))),
            None => Ok(()),
        }
    }

    fn send(&self, piece: Piece) -> Result<(), RunError> {
        if matches!(&piece, Piece::Text(t) if !t.is_empty()) {
            self.streamed.store(true, Ordering::Relaxed);
        }
        self.out.send((self.index, piece)).map_err(|_| RunError::Cancelled)
    }
}

enum RunError {
    /// The client went away.
    Cancelled,
    /// The request failed.
    Api(ApiError),
    /// A worker went away.
    Lost { worker: String, reason: String },
    /// A layer-wise hand-off did not arrive; the decode worker gave the request back.
    Handoff(String),
}

impl Run {
    /// A worker's next event for this request, or `Cancelled` as soon as the client goes away
    /// (returning drops the worker's receiver, which aborts the request there).
    async fn next(
        &self,
        worker: &Arc<dyn Worker>,
        events: &mut mpsc::UnboundedReceiver<RequestEvent>,
    ) -> Result<RequestEvent, RunError> {
        let lost = |reason: &str| RunError::Lost { worker: worker.name().to_owned(), reason: reason.to_owned() };
        let since = Instant::now();
        loop {
            let event = tokio::select! {
                e = tokio::time::timeout(self.conductor.worker_silence, events.recv()) => e,
                () = self.out.closed() => return Err(RunError::Cancelled),
            };
            match event {
                Ok(Some(e)) => return Ok(e),
                Ok(None) => return Err(lost("it stopped before finishing the request")),
                Err(_) if since.elapsed() >= WORKER_SILENCE_MAX => {
                    return Err(lost("it sent nothing for this request in ten minutes"));
                }
                Err(_) => {
                    // Silent: queued behind other requests, or dead? Its engine answers a
                    // stats call between steps; a busy worker is not taken for a dead one.
                    let alive = tokio::select! {
                        stats = worker.stats() => stats.is_some(),
                        () = self.out.closed() => return Err(RunError::Cancelled),
                    };
                    if !alive {
                        return Err(lost("it sent nothing and did not answer a probe in time"));
                    }
                    tracing::debug!(
                        worker = worker.name(),
                        silent_s = since.elapsed().as_secs(),
                        "worker busy; waiting"
                    );
                }
            }
        }
    }
}
