//! The scheduling crate's policies in the conductor: the same [`Scheduler::decide`] the
//! simulator calls, on a [`ClusterSnapshot`] built from the conductor's view of its workers.
//!
//! [`SchedPolicy`] implements the conductor's [`RoutePolicy`] seam. Per request it turns the
//! routing [`Snapshot`] (the conductor's ledger: requests prefilling and decoding on each
//! worker, pool sizes) into a [`ClusterSnapshot`], hashes the prompt into the chained block
//! hashes the pool uses, asks the scheduler, and maps the instances it names back to workers.
//!
//! Prompt trees: the conductor's [`ClusterView`](crate::view::ClusterView) feeds the trees with
//! every worker's KV events (an exact index); the policy also records each routed prompt's
//! blocks at its prefill instance ([`GlobalPromptTrees::predict`]) when it routes it — an
//! entry the trees' TTL drops unless an event confirms it — so the window between routing a
//! request and its events arriving is covered. Load reports, when a worker has sent one,
//! replace the ledger's guesses of its decode batch, queue and memory.

use std::sync::Mutex;

use baton_kv::{InstanceId, prefix_hashes};
use baton_sched::{
    ClusterSnapshot, CostProfile, DecodeSeq, GlobalPromptTrees, Micros, PendingPrefill, Request, RequestId, Scheduler,
    TierUsage, WorkerLoad,
};
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::routing::{Decision, Fetch, Plan, RoutePolicy, RouteRequest, Snapshot};

pub use crate::view::PREDICTED_TTL_US;
use crate::view::SharedTrees;

/// Live state behind the lock.
struct State {
    scheduler: Scheduler,
    trees: SharedTrees,
    rng: StdRng,
    next_request: u64,
}

/// A baton-sched [`Scheduler`] behind the conductor's routing seam.
pub struct SchedPolicy {
    state: Mutex<State>,
    cost: CostProfile,
    block_tokens: usize,
    /// Whether routes may fetch a prefix cached on another worker.
    kv_fetch: bool,
    /// Whether a request prefers the decode worker caching its history.
    decode_affinity: bool,
    /// The measured mean time requests stay on their decode worker (0: none yet). Kept outside
    /// the state's lock: every request's end writes it; the next decision reads it.
    decode_time_us: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for SchedPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchedPolicy").field("block_tokens", &self.block_tokens).finish_non_exhaustive()
    }
}

impl SchedPolicy {
    /// A policy deciding with `scheduler`, costing with `cost`, hashing prompts in blocks of
    /// `block_tokens` (the workers' block size).
    pub fn new(scheduler: Scheduler, cost: CostProfile, block_tokens: usize, seed: u64) -> Self {
        let state = State {
            scheduler,
            trees: std::sync::Arc::new(Mutex::new(GlobalPromptTrees::new(PREDICTED_TTL_US))),
            rng: StdRng::seed_from_u64(seed),
            next_request: 0,
        };
        Self {
            state: Mutex::new(state),
            cost,
            block_tokens: block_tokens.max(1),
            kv_fetch: false,
            decode_affinity: false,
            decode_time_us: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Lets routes fetch a prefix cached on another worker when that beats recomputing it
    /// (off by default: the conductor must carry the fetch out).
    #[must_use]
    pub fn with_kv_fetch(mut self, on: bool) -> Self {
        self.kv_fetch = on;
        self
    }

    /// The per-worker figures baton-sched's snapshot builder takes, from the conductor's
    /// ledger: queued prefills with their predicted compute time, running decodes with their
    /// contexts, device blocks in use (estimated from the tokens in flight).
    pub fn worker_loads(snapshot: &Snapshot, cost: &CostProfile, block_tokens: usize) -> Vec<WorkerLoad> {
        snapshot
            .workers
            .iter()
            .map(|w| {
                let mut load = WorkerLoad::idle(InstanceId(w.instance), w.role);
                load.prefills = prefill_queue(&w.prefilling, cost, snapshot.now_us);
                load.decode_running =
                    w.decoding.iter().map(|&(started_at, ctx)| DecodeSeq::new(started_at, ctx as u64)).collect();
                let tokens: usize =
                    w.prefilling.iter().map(|p| p.1).sum::<usize>() + w.decoding.iter().map(|d| d.1).sum::<usize>();
                load.kv_device = TierUsage {
                    used: tokens.div_ceil(block_tokens) as u64,
                    total: if w.capacity_blocks == 0 { u64::MAX } else { w.capacity_blocks as u64 },
                };
                // What the worker measured replaces the ledger's guesses of its decode side
                // and memory (the ledger still has the prefills it routed, with estimates).
                if let Some(r) = &w.report {
                    // The ledger's queue is this conductor's estimate of the prefills it sent;
                    // the report says what the worker has still to compute, whoever sent it
                    // (another conductor replica too) and however long it really takes (the
                    // cost profile may under-predict the worker). The queue is the longer of the
                    // two: what the report has beyond the ledger waits as one more prefill.
                    let ledger_us = load.queued_prefill_us(snapshot.now_us);
                    let reported_us = reported_prefill_us(cost, r);
                    if reported_us > ledger_us {
                        load.prefills.push(PendingPrefill { est_us: reported_us - ledger_us, started_at: None });
                    }
                    // The report has the contexts, the ledger when this conductor's decodes began:
                    // the oldest sequences get the oldest start times; any more (another
                    // replica's) began now, as far as this conductor knows.
                    let now = snapshot.now_us;
                    let mut starts: Vec<u64> = w.decoding.iter().map(|d| d.0).collect();
                    starts.sort_unstable();
                    load.decode_running = r
                        .decode_contexts
                        .iter()
                        .enumerate()
                        .map(|(i, &c)| DecodeSeq::new(starts.get(i).copied().unwrap_or(now), c as u64))
                        .collect();
                    load.decode_waiting = u32::try_from(r.waiting).unwrap_or(u32::MAX);
                    load.decode_incoming =
                        (0..r.incoming + r.receiving).map(|_| baton_sched::IncomingSeq::new(now, 0)).collect();
                    if let Some(scale) = decode_step_scale(cost, r) {
                        load.decode_step_scale = scale;
                    }
                    load.mean_step_us = r.step_time_us;
                    if r.total_blocks > 0 {
                        let reclaimable = r.free_blocks + r.evictable_blocks;
                        load.kv_device = TierUsage {
                            used: r.total_blocks.saturating_sub(reclaimable) as u64,
                            total: r.total_blocks as u64,
                        };
                    }
                }
                load
            })
            .collect()
    }

    /// The scheduler's view of the conductor's snapshot at `now`: [`Self::worker_loads`]
    /// through [`ClusterSnapshot::from_workers`], the builder the simulator uses too. With
    /// `kv_fetch` off no route counts on fetching a prefix from another worker.
    pub fn cluster_snapshot<'a>(
        snapshot: &Snapshot,
        trees: &'a GlobalPromptTrees,
        cost: &'a CostProfile,
        block_tokens: usize,
        now: Micros,
        kv_fetch: bool,
    ) -> ClusterSnapshot<'a> {
        ClusterSnapshot::from_workers(now, &Self::worker_loads(snapshot, cost, block_tokens), trees, cost)
            .with_kv_fetch(kv_fetch)
    }

    /// The scheduler's request for a prompt.
    pub fn request(id: u64, request: &RouteRequest<'_>, block_tokens: usize) -> Request {
        Request {
            id: RequestId(id),
            prompt_tokens: request.prompt.len() as u64,
            block_hashes: prefix_hashes(request.prompt, block_tokens),
            block_tokens: block_tokens as u64,
            expected_output: request.max_tokens as u64,
            session: request.session.map(baton_sched::SessionId),
        }
    }

    /// Prefers the decode worker caching the longest prefix of the prompt among those about as
    /// fast as the fastest (MemServe's PD-Caching-2; off by default).
    #[must_use]
    pub fn with_decode_affinity(mut self, on: bool) -> Self {
        self.decode_affinity = on;
        self
    }

    /// Maps a scheduler decision back onto the snapshot's workers.
    pub fn to_route(snapshot: &Snapshot, decision: &baton_sched::Decision) -> Decision {
        Self::to_plan(snapshot, decision, 1).decision
    }

    /// Maps a scheduler decision back onto the snapshot's workers, with the blocks its route
    /// reuses from another worker's cache as a [`Fetch`] of the prompt's first blocks (the
    /// holder has all of them: a cached block's ancestors are cached with it).
    pub fn to_plan(snapshot: &Snapshot, decision: &baton_sched::Decision, block_tokens: usize) -> Plan {
        let index = |id: InstanceId| snapshot.workers.iter().find(|w| w.instance == id.0).map(|w| w.index);
        let route = match decision {
            baton_sched::Decision::Route(r) => r,
            baton_sched::Decision::Reject { reason } => {
                return Plan { decision: Decision::Reject { reason: reason.to_string() }, fetch: None };
            }
        };
        let decision = match (index(route.prefill), index(route.decode)) {
            (Some(p), Some(d)) if p == d => Decision::Colocated(p),
            (Some(prefill), Some(decode)) => Decision::Disaggregated { prefill, decode },
            _ => Decision::NoWorkers,
        };
        let fetch = route
            .reuse
            .iter()
            .filter(|r| r.from != route.prefill && r.end > r.start)
            .max_by_key(|r| r.end)
            .and_then(|r| Some(Fetch { from: index(r.from)?, tokens: r.end as usize * block_tokens }));
        Plan { decision, fetch }
    }
}

/// How a worker's decode steps compare with the cost profile's, from its load report: its
/// measured decode-only steps (moving means of time, batch and context: the model is linear in
/// batch and context, so the prediction for the mean work is the mean prediction), or, from a
/// worker that predates those, its mean over every step against the batch it reports now (which
/// a colocated worker's prefill chunks inflate). Clamped to [0.25, 4]; `None` before a measure.
fn decode_step_scale(cost: &CostProfile, r: &baton_protocol::wire::LoadReport) -> Option<f64> {
    let (measured, predicted) = if r.decode_step_us > 0 && r.decode_step_batch > 0.0 {
        let d = &cost.decode;
        let predicted =
            d.fixed_us + d.per_seq_us * r.decode_step_batch + d.per_context_token_us * r.decode_step_context;
        (r.decode_step_us as f64, predicted)
    } else if r.step_time_us > 0 && !r.decode_contexts.is_empty() {
        let ctx: usize = r.decode_contexts.iter().sum();
        (r.step_time_us as f64, cost.decode_step(r.decode_contexts.len() as u64, ctx as u64) as f64)
    } else {
        return None;
    };
    (predicted > 0.0).then(|| (measured / predicted).clamp(0.25, 4.0))
}

/// The compute time of the prompt tokens a worker reports still to compute, as prefills of
/// their mean length (the report has their sum and the number of waiting sequences).
fn reported_prefill_us(cost: &CostProfile, r: &baton_protocol::wire::LoadReport) -> Micros {
    let tokens = r.queued_prefill_tokens as u64;
    if tokens == 0 {
        return 0;
    }
    let prompts = (r.waiting as u64).clamp(1, tokens);
    cost.prefill_time(tokens / prompts, 0.0) * prompts
}

/// A worker's queued prefills as the policies see them: each costs its estimate, and the worker
/// runs them one after another in the order they were sent, so the oldest started when it was
/// sent (or when the one before it ended) and only its remainder is still to wait for. Without
/// start times every prefill counted whole, and a worker about to finish one looked as busy as
/// one that had just begun it: cache-affine policies sent the next turn of a conversation away
/// from the worker holding its cache (the simulator always knew how far a prefill had got).
fn prefill_queue(prefilling: &[(u64, usize)], cost: &CostProfile, now: Micros) -> Vec<PendingPrefill> {
    let mut sent: Vec<(u64, usize)> = prefilling.to_vec();
    sent.sort_unstable();
    let mut free_at = 0;
    sent.into_iter()
        .map(|(at, tokens)| {
            let est_us = cost.prefill_time(tokens as u64, 0.0);
            let start = free_at.max(at);
            free_at = start + est_us;
            PendingPrefill { est_us, started_at: (start <= now).then_some(start) }
        })
        .collect()
}

impl RoutePolicy for SchedPolicy {
    fn route(&self, snapshot: &Snapshot, request: &RouteRequest<'_>) -> Decision {
        self.plan(snapshot, request).decision
    }

    fn plan(&self, snapshot: &Snapshot, request: &RouteRequest<'_>) -> Plan {
        if snapshot.workers.is_empty() {
            return Plan { decision: Decision::NoWorkers, fetch: None };
        }
        let now = snapshot.now_us;
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let State { scheduler, trees, rng, next_request } = &mut *state;
        match self.decode_time_us.load(std::sync::atomic::Ordering::Relaxed) {
            0 => {}
            measured => scheduler.admission.decode_time_us = measured,
        }
        let mut trees = trees.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        trees.expire(now);
        for w in &snapshot.workers {
            trees.set_role(InstanceId(w.instance), w.role);
        }
        *next_request += 1;
        let req = Self::request(*next_request, request, self.block_tokens);
        let decision = {
            let cluster = Self::cluster_snapshot(snapshot, &trees, &self.cost, self.block_tokens, now, self.kv_fetch)
                .with_decode_affinity(self.decode_affinity);
            scheduler.decide(&cluster, &req, rng)
        };
        if let baton_sched::Decision::Route(r) = &decision {
            trees.predict(r.prefill, &req.block_hashes, now);
        }
        Self::to_plan(snapshot, &decision, self.block_tokens)
    }

    fn attach_index(&self, trees: SharedTrees) {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner).trees = trees;
    }

    /// Predictive admission's `t_d` becomes the measured mean (the configured one stands until
    /// the first request has left its decode worker).
    fn decode_time(&self, mean_us: u64) {
        self.decode_time_us.store(mean_us, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Which policy the conductor routes with.
#[derive(Debug, Clone)]
pub enum PolicyChoice {
    /// The conductor's own least-in-flight routing with an optional cap (HTTP 429 above it).
    Simple {
        /// Requests in flight per worker before new ones are refused.
        max_in_flight: Option<usize>,
    },
    /// A baton-sched policy and admission control, as the simulator runs them.
    Sched {
        /// The policy.
        policy: baton_sched::PolicyKind,
        /// Its parameters.
        config: baton_sched::PolicyConfig,
        /// Admission control and SLOs.
        admission: baton_sched::AdmissionConfig,
        /// The cost model predictions use.
        cost: Box<CostProfile>,
        /// Seed of random choices.
        seed: u64,
        /// Whether a prompt's worker may fetch a prefix cached on another worker
        /// (`--kv-fetch`).
        kv_fetch: bool,
        /// Whether a request prefers the decode worker caching its prompt's history
        /// (`--pd-caching 2`).
        decode_affinity: bool,
        /// Conditional disaggregation: the most prompt tokens not cached on its decode worker
        /// that a request may compute there, whole, without a hand-off
        /// (`--conditional-disagg-tokens`; `None`: never).
        conditional_tokens: Option<u64>,
    },
    /// A policy of the caller's own (a library user's, or a test's that scripts decisions).
    Custom(CustomPolicy),
}

/// A caller's [`RoutePolicy`], shared by every conductor built with it.
#[derive(Clone)]
pub struct CustomPolicy(pub std::sync::Arc<dyn RoutePolicy>);

impl std::fmt::Debug for CustomPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CustomPolicy")
    }
}

impl RoutePolicy for CustomPolicy {
    fn route(&self, snapshot: &Snapshot, request: &RouteRequest<'_>) -> Decision {
        self.0.route(snapshot, request)
    }

    fn plan(&self, snapshot: &Snapshot, request: &RouteRequest<'_>) -> Plan {
        self.0.plan(snapshot, request)
    }

    fn attach_index(&self, trees: SharedTrees) {
        self.0.attach_index(trees);
    }
}

impl Default for PolicyChoice {
    fn default() -> Self {
        PolicyChoice::Simple { max_in_flight: None }
    }
}

impl PolicyChoice {
    /// The routing policy, for workers whose KV blocks hold `block_tokens` tokens.
    pub fn build(&self, block_tokens: usize) -> Box<dyn RoutePolicy> {
        match self {
            PolicyChoice::Simple { max_in_flight } => {
                Box::new(crate::routing::LeastLoad { max_in_flight: *max_in_flight })
            }
            PolicyChoice::Sched {
                policy,
                config,
                admission,
                cost,
                seed,
                kv_fetch,
                decode_affinity,
                conditional_tokens,
            } => {
                let scheduler = Scheduler::new(policy.build(config), *admission).with_conditional(*conditional_tokens);
                let policy = SchedPolicy::new(scheduler, (**cost).clone(), block_tokens, *seed);
                Box::new(policy.with_kv_fetch(*kv_fetch).with_decode_affinity(*decode_affinity))
            }
            PolicyChoice::Custom(p) => Box::new(p.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use baton_sched::{AdmissionConfig, PolicyConfig, PolicyKind};

    use super::*;
    use crate::Role;
    use crate::routing::WorkerView;

    fn snapshot() -> Snapshot {
        let mut workers = vec![
            WorkerView::new(0, Role::Prefill, 3),
            WorkerView::new(1, Role::Prefill, 0),
            WorkerView::new(2, Role::Decode, 1),
            WorkerView::new(3, Role::Decode, 4),
        ];
        workers[0].prefilling = vec![(0, 4000), (0, 2000), (0, 900)];
        workers[2].decoding = vec![(10, 700)];
        workers[3].decoding = vec![(10, 4000), (20, 3000), (30, 5000), (40, 100)];
        for (i, w) in workers.iter_mut().enumerate() {
            w.instance = 10 + i as u32;
            w.capacity_blocks = 4096;
        }
        Snapshot { workers, now_us: 1_000_000 }
    }

    /// A worker runs its prefills in the order they were sent: the oldest has been running since
    /// it was sent and only its remainder is left; the others wait whole, each after the one
    /// before it.
    #[test]
    fn a_prefill_sent_long_ago_counts_only_what_is_left_of_it() {
        let cost = CostProfile::llama2_70b_8xh100();
        let full = cost.prefill_time(4000, 0.0);
        let now = 10 * full;
        let queue = |prefilling: &[(u64, usize)]| {
            WorkerLoad {
                prefills: prefill_queue(prefilling, &cost, now),
                ..WorkerLoad::idle(InstanceId(0), Role::Prefill)
            }
            .queued_prefill_us(now)
        };
        assert_eq!(queue(&[(now, 4000)]), full, "sent just now: all of it");
        assert_eq!(queue(&[(now - full / 2, 4000)]), full - full / 2, "half done");
        assert_eq!(queue(&[(now - 2 * full, 4000)]), 0, "overdue: nothing left to wait for");
        // Sent one after the other half a prefill ago: the first is half done, the second waits.
        assert_eq!(queue(&[(now - full / 2, 4000), (now - full / 2, 4000)]), full - full / 2 + full);
    }

    /// A worker's load report shows prompt tokens it has yet to compute: beyond the prefills
    /// this conductor sent it (another replica's), or left of prefills the ledger thinks done
    /// (the worker is slower than the cost profile). The queue is the longer of the ledger's and
    /// the report's; what the ledger already counts is not counted twice.
    #[test]
    fn prefills_another_conductor_sent_queue_too() {
        let cost = CostProfile::llama2_70b_8xh100();
        let mut w = WorkerView { instance: 0, ..WorkerView::new(0, Role::Prefill, 0) };
        let report =
            |tokens| Some(baton_protocol::wire::LoadReport { queued_prefill_tokens: tokens, ..Default::default() });
        let queued = |w: &WorkerView| {
            let snap = Snapshot { workers: vec![w.clone()], now_us: 0 };
            SchedPolicy::worker_loads(&snap, &cost, 16)[0].queued_prefill_us(0)
        };
        assert_eq!(queued(&w), 0);
        w.report = report(3000);
        assert_eq!(queued(&w), cost.prefill_time(3000, 0.0), "another replica's prefill");
        w.prefilling = vec![(0, 3000)];
        assert_eq!(queued(&w), cost.prefill_time(3000, 0.0), "its own: counted once");
        w.report = report(5000);
        assert_eq!(queued(&w), cost.prefill_time(5000, 0.0), "the report's, the longer");
        // Sent long ago: the ledger thinks it done, the worker says it is not.
        w.prefilling = vec![(0, 3000)];
        w.report = report(3000);
        let later = Snapshot { workers: vec![w.clone()], now_us: 100_000_000 };
        assert_eq!(
            SchedPolicy::worker_loads(&later, &cost, 16)[0].queued_prefill_us(100_000_000),
            cost.prefill_time(3000, 0.0)
        );
    }

    /// Least-load with `kind` admission, a TBT target of `tbt_us`, a TTFT target of a minute and
    /// a `t_d` of 10 s.
    fn admitting(kind: baton_sched::AdmissionKind, tbt_us: u64, cost: CostProfile) -> SchedPolicy {
        let slo = baton_sched::Slo { ttft_us: 60_000_000, tbt_us };
        let admission = AdmissionConfig { kind, slo, decode_time_us: 10_000_000, tbt_headroom: 0.0 };
        let policy = PolicyKind::LeastLoad.build(&PolicyConfig::default());
        SchedPolicy::new(Scheduler::new(policy, admission), cost, 16, 1)
    }

    /// Predictive admission on the live snapshot: a decode worker's running requests began when
    /// the ledger sent them (not when the report came), and each is taken to stay the measured
    /// `t_d`: requests that began 20 s ago and are expected to take 10 s are gone by the time a
    /// new prefill ends (admitted); once the conductor measures that they take a minute, they
    /// are still there (refused: the decode batch would miss the TBT target).
    #[test]
    fn predictive_admission_uses_when_decodes_began_and_how_long_they_take() {
        use baton_sched::AdmissionKind;
        let cost = CostProfile::llama2_70b_8xa800();
        let now = 20_000_000;
        let mut decode = WorkerView { instance: 1, capacity_blocks: 1 << 20, ..WorkerView::new(1, Role::Decode, 64) };
        decode.decoding = (0..64).map(|_| (0, 2000)).collect();
        decode.report =
            Some(baton_protocol::wire::LoadReport { decode_contexts: vec![2000; 64], ..Default::default() });
        let snap = Snapshot {
            workers: vec![WorkerView { instance: 0, ..WorkerView::new(0, Role::Prefill, 0) }, decode],
            now_us: now,
        };
        let busy = cost.decode_step(65, 64 * 2000 + 100);
        let policy = admitting(AdmissionKind::Predictive, busy - 1, cost);
        let prompt: Vec<u32> = (0..100).collect();
        let request = RouteRequest { prompt: &prompt, max_tokens: 16, session: None };
        assert!(matches!(policy.route(&snap, &request), Decision::Disaggregated { .. }));
        policy.decode_time(60_000_000);
        assert!(matches!(policy.route(&snap, &request), Decision::Reject { .. }));
    }

    /// Early admission checks a decode worker's TBT with its steps as the worker measures them:
    /// a worker whose steps take twice what the cost profile predicts for its batch is over a TBT
    /// target the prediction alone would meet.
    #[test]
    fn admission_scales_the_predicted_step_by_what_the_worker_measures() {
        use baton_sched::AdmissionKind;
        let cost = CostProfile::llama2_70b_8xh100();
        let mut decode = WorkerView { instance: 1, capacity_blocks: 1 << 20, ..WorkerView::new(1, Role::Decode, 8) };
        let predicted = cost.decode_step(8, 8 * 500);
        let report = |step_time_us| baton_protocol::wire::LoadReport {
            decode_contexts: vec![500; 8],
            step_time_us,
            ..Default::default()
        };
        let policy = admitting(AdmissionKind::EarlyRejection, predicted * 3 / 2, cost);
        let prompt: Vec<u32> = (0..100).collect();
        let request = RouteRequest { prompt: &prompt, max_tokens: 16, session: None };
        let route = |decode: &WorkerView| {
            let snap = Snapshot {
                workers: vec![WorkerView { instance: 0, ..WorkerView::new(0, Role::Prefill, 0) }, decode.clone()],
                now_us: 1,
            };
            policy.route(&snap, &request)
        };
        decode.report = Some(report(predicted));
        assert!(matches!(route(&decode), Decision::Disaggregated { .. }), "steps as predicted");
        decode.report = Some(report(predicted * 2));
        assert!(matches!(route(&decode), Decision::Reject { .. }), "steps twice as long");

        // A worker that measures its decode-only steps: those count, not a mean that prefill
        // chunks inflated (a colocated worker's, a switched one's).
        let decode_only = |us| baton_protocol::wire::LoadReport {
            decode_step_us: us,
            decode_step_batch: 8.0,
            decode_step_context: 4000.0,
            ..report(predicted * 10)
        };
        decode.report = Some(decode_only(predicted));
        assert!(matches!(route(&decode), Decision::Disaggregated { .. }), "decode steps as predicted");
        decode.report = Some(decode_only(predicted * 2));
        assert!(matches!(route(&decode), Decision::Reject { .. }), "decode steps twice as long");
    }

    /// The conductor's seam and a direct call of the scheduler on the snapshot it builds (what
    /// the simulator does) agree, for every policy.
    #[test]
    fn the_seam_decides_as_the_scheduler_does() {
        let snap = snapshot();
        let prompt: Vec<u32> = (0..300).collect();
        let cost = CostProfile::llama2_70b_8xa800();
        for kind in PolicyKind::ALL {
            let live = SchedPolicy::new(
                Scheduler::new(kind.build(&PolicyConfig::default()), AdmissionConfig::default()),
                cost.clone(),
                16,
                7,
            );
            let routed = live.route(&snap, &RouteRequest { prompt: &prompt, max_tokens: 64, session: None });

            let mut direct = Scheduler::new(kind.build(&PolicyConfig::default()), AdmissionConfig::default());
            let mut trees = GlobalPromptTrees::new(PREDICTED_TTL_US);
            for w in &snap.workers {
                trees.set_role(InstanceId(w.instance), w.role);
            }
            let cluster = SchedPolicy::cluster_snapshot(&snap, &trees, &cost, 16, snap.now_us, false);
            let req = SchedPolicy::request(1, &RouteRequest { prompt: &prompt, max_tokens: 64, session: None }, 16);
            let decision = direct.decide(&cluster, &req, &mut StdRng::seed_from_u64(7));
            assert_eq!(routed, SchedPolicy::to_route(&snap, &decision), "{}", kind.name());
            assert!(matches!(routed, Decision::Disaggregated { .. }), "{}: {routed:?}", kind.name());
        }
    }

    /// Least-load sees the ledger: the idle prefill worker and the lighter decode worker.
    #[test]
    fn the_ledger_reaches_the_policy() {
        let live = SchedPolicy::new(
            Scheduler::new(PolicyKind::LeastLoad.build(&PolicyConfig::default()), AdmissionConfig::default()),
            CostProfile::llama2_70b_8xa800(),
            16,
            0,
        );
        let d = live.route(&snapshot(), &RouteRequest { prompt: &[1, 2, 3], max_tokens: 8, session: None });
        assert_eq!(d, Decision::Disaggregated { prefill: 1, decode: 2 });
    }

    /// Prompt-tree routing remembers where a prompt went: the same prompt returns to the same
    /// colocated worker even when another is as idle.
    #[test]
    fn prompt_tree_sends_a_repeated_prompt_back() {
        let live = SchedPolicy::new(
            Scheduler::new(PolicyKind::PromptTree.build(&PolicyConfig::default()), AdmissionConfig::default()),
            CostProfile::llama2_70b_8xa800(),
            16,
            0,
        );
        let snap = Snapshot {
            workers: vec![WorkerView::new(0, Role::Colocated, 0), WorkerView::new(1, Role::Colocated, 0)],
            now_us: 0,
        };
        let a: Vec<u32> = (0..64).collect();
        let b: Vec<u32> = (100..164).collect();
        let first_a = live.route(&snap, &RouteRequest { prompt: &a, max_tokens: 4, session: None });
        let first_b = live.route(&snap, &RouteRequest { prompt: &b, max_tokens: 4, session: None });
        for _ in 0..3 {
            assert_eq!(live.route(&snap, &RouteRequest { prompt: &a, max_tokens: 4, session: None }), first_a);
            assert_eq!(live.route(&snap, &RouteRequest { prompt: &b, max_tokens: 4, session: None }), first_b);
        }
    }

    /// Session affinity live: a session's requests (keyed by `user` or `x-session-id`) stay on
    /// the worker the first one went to (the least loaded then), whatever their prompts, until
    /// another worker would start them sooner.
    #[test]
    fn session_affinity_keeps_a_session_on_one_worker() {
        let live = SchedPolicy::new(
            Scheduler::new(PolicyKind::SessionAffinity.build(&PolicyConfig::default()), AdmissionConfig::default()),
            CostProfile::llama2_70b_8xa800(),
            16,
            0,
        );
        // All but worker `idle` have prompts queued.
        let snap = |idle: usize| Snapshot {
            workers: (0..4)
                .map(|i| WorkerView {
                    prefilling: if i == idle { Vec::new() } else { vec![(0, 2000); 3] },
                    ..WorkerView::new(i, Role::Colocated, 0)
                })
                .collect(),
            now_us: 0,
        };
        for s in 0..4usize {
            let session = Some(crate::routing::session_id(&format!("user-{s}")));
            let prompt: Vec<u32> = (0..40).map(|t| (s * 100 + t) as u32).collect();
            let first = live.route(&snap(s), &RouteRequest { prompt: &prompt, max_tokens: 4, session });
            assert_eq!(first, Decision::Colocated(s), "the least loaded worker takes a new session");
            // Every worker equally busy: the session stays on its own.
            let even = Snapshot {
                workers: (0..4)
                    .map(|i| WorkerView { prefilling: vec![(0, 2000); 3], ..WorkerView::new(i, Role::Colocated, 0) })
                    .collect(),
                now_us: 0,
            };
            for turn in 1..4u32 {
                let start = s as u32 * 1000 + turn * 7;
                let other: Vec<u32> = (start..start + 30).collect();
                let d = live.route(&even, &RouteRequest { prompt: &other, max_tokens: 4, session });
                assert_eq!(d, first, "session {s}, turn {turn}");
            }
            // Its own worker queued and another idle: the session moves rather than pile up
            // (issue #18: affinity is never worth more than the queue it costs).
            let other: Vec<u32> = (s as u32 * 1000 + 500..s as u32 * 1000 + 530).collect();
            let d = live.route(&snap((s + 1) % 4), &RouteRequest { prompt: &other, max_tokens: 4, session });
            assert_eq!(d, Decision::Colocated((s + 1) % 4), "session {s} stayed behind a queue");
        }
    }
}
