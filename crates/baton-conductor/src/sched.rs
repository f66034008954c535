//! The scheduling crate's policies in the conductor: the same [`Scheduler::decide`] the
//! simulator calls, on the same [`ClusterSnapshot`], which the conductor builds from its view of
//! its workers ([`crate::routing::cluster_snapshot`]).
//!
//! [`SchedPolicy`] implements the conductor's [`RoutePolicy`] seam. Per request it hashes the
//! prompt into the chained block hashes the pool uses, asks the scheduler, and maps the
//! instances it names back to positions in the snapshot.
//!
//! Prompt trees: the conductor's [`ClusterView`](crate::view::ClusterView) feeds the trees with
//! every worker's KV events (an exact index). The decision reads them and writes nothing: the
//! prompt it routed is expected cached at its prefill instance, a [`Predict`] in the [`Plan`],
//! which the conductor applies to the trees after the decision ([`GlobalPromptTrees::predict`]) —
//! an entry the trees' TTL drops unless an event confirms it — so the window between routing a
//! request and its events arriving is covered. The scheduler and its random stream sit behind
//! this adapter's own lock, held for the decision alone.

use std::sync::Mutex;

use baton_kv::{InstanceId, prefix_hashes};
#[cfg(doc)]
use baton_sched::GlobalPromptTrees;
use baton_sched::{ClusterSnapshot, CostProfile, Predict, Request, RequestId, Scheduler};
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::routing::{Decision, Fetch, Plan, RoutePolicy, RouteRequest, SnapshotConfig};

pub use crate::view::PREDICTED_TTL_US;

/// A scheduler's state across requests, behind the adapter's lock.
struct State {
    scheduler: Scheduler,
    rng: StdRng,
    next_request: u64,
}

/// A baton-sched [`Scheduler`] behind the conductor's routing seam.
pub struct SchedPolicy {
    state: Mutex<State>,
    /// How the conductor builds the snapshot the scheduler reads.
    config: SnapshotConfig,
    block_tokens: usize,
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
        let state = State { scheduler, rng: StdRng::seed_from_u64(seed), next_request: 0 };
        Self {
            state: Mutex::new(state),
            config: SnapshotConfig { cost, kv_fetch: false, decode_affinity: false, prompt_trees: true },
            block_tokens: block_tokens.max(1),
            decode_time_us: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Lets routes fetch a prefix cached on another worker when that beats recomputing it
    /// (off by default: the conductor must carry the fetch out).
    #[must_use]
    pub fn with_kv_fetch(mut self, on: bool) -> Self {
        self.config.kv_fetch = on;
        self
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
        self.config.decode_affinity = on;
        self
    }

    /// Maps a scheduler decision back onto the snapshot's workers.
    pub fn to_route(snapshot: &ClusterSnapshot<'_>, decision: &baton_sched::Decision) -> Decision {
        Self::to_plan(snapshot, decision, 1).decision
    }

    /// Maps a scheduler decision back onto the snapshot's workers, with the blocks its route
    /// reuses from another worker's cache as a [`Fetch`] of the prompt's first blocks (the
    /// holder has all of them: a cached block's ancestors are cached with it). Predicts nothing:
    /// [`RoutePolicy::plan`] adds the decision's [`Predict`].
    pub fn to_plan(snapshot: &ClusterSnapshot<'_>, decision: &baton_sched::Decision, block_tokens: usize) -> Plan {
        let index = |id: InstanceId| snapshot.instances.iter().position(|i| i.id == id);
        let route = match decision {
            baton_sched::Decision::Route(r) => r,
            baton_sched::Decision::Reject { reason } => {
                return Plan::of(Decision::Reject { reason: reason.to_string() });
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
        Plan { decision, fetch, predict: None }
    }
}

impl RoutePolicy for SchedPolicy {
    fn snapshot_config(&self) -> SnapshotConfig {
        self.config.clone()
    }

    fn route(&self, snapshot: &ClusterSnapshot<'_>, request: &RouteRequest<'_>) -> Decision {
        self.plan(snapshot, request).decision
    }

    fn plan(&self, snapshot: &ClusterSnapshot<'_>, request: &RouteRequest<'_>) -> Plan {
        if snapshot.instances.is_empty() {
            return Plan::of(Decision::NoWorkers);
        }
        let (decision, req) = {
            let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let State { scheduler, rng, next_request } = &mut *state;
            match self.decode_time_us.load(std::sync::atomic::Ordering::Relaxed) {
                0 => {}
                measured => scheduler.admission.decode_time_us = measured,
            }
            *next_request += 1;
            let req = Self::request(*next_request, request, self.block_tokens);
            (scheduler.decide(snapshot, &req, rng), req)
        };
        let plan = Self::to_plan(snapshot, &decision, self.block_tokens);
        Plan { predict: Predict::of(&decision, req), ..plan }
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
    fn snapshot_config(&self) -> SnapshotConfig {
        self.0.snapshot_config()
    }

    fn route(&self, snapshot: &ClusterSnapshot<'_>, request: &RouteRequest<'_>) -> Decision {
        self.0.route(snapshot, request)
    }

    fn plan(&self, snapshot: &ClusterSnapshot<'_>, request: &RouteRequest<'_>) -> Plan {
        self.0.plan(snapshot, request)
    }

    fn decode_time(&self, mean_us: u64) {
        self.0.decode_time(mean_us);
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

    use baton_sched::{GlobalPromptTrees, WorkerLoad};

    use super::*;
    use crate::Role;
    use crate::loads::WorkerFigures;
    use crate::routing::{cluster_snapshot, ready_trees};

    /// The conductor's ledger at some instant: its workers' figures, and the time.
    struct Snapshot {
        workers: Vec<WorkerFigures>,
        now_us: u64,
    }

    impl Snapshot {
        /// The figures the policies' snapshot is built from, costed by `config`.
        fn loads(&self, config: &SnapshotConfig) -> Vec<WorkerLoad> {
            self.workers.iter().map(|w| w.clone().load(&config.cost, self.now_us)).collect()
        }
    }

    /// A policy as the conductor runs it: over prompt trees it keeps across requests, readied
    /// before each decision, the plan's prediction applied after.
    struct Live {
        policy: SchedPolicy,
        trees: GlobalPromptTrees,
    }

    impl Live {
        fn new(policy: SchedPolicy) -> Self {
            Self { policy, trees: GlobalPromptTrees::new(PREDICTED_TTL_US) }
        }

        fn route(&mut self, snap: &Snapshot, request: &RouteRequest<'_>) -> Decision {
            let config = self.policy.snapshot_config();
            let loads = snap.loads(&config);
            ready_trees(&mut self.trees, snap.now_us, &loads);
            let plan = self.policy.plan(&cluster_snapshot(snap.now_us, &loads, &self.trees, &config), request);
            if let Some(p) = &plan.predict {
                self.trees.apply_predict(p, snap.now_us);
            }
            plan.decision
        }

        fn decode_time(&self, mean_us: u64) {
            self.policy.decode_time(mean_us);
        }
    }

    fn snapshot() -> Snapshot {
        let mut workers = vec![
            WorkerFigures::new(0, Role::Prefill, 3),
            WorkerFigures::new(1, Role::Prefill, 0),
            WorkerFigures::new(2, Role::Decode, 1),
            WorkerFigures::new(3, Role::Decode, 4),
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

    /// Least-load with `kind` admission, a TBT target of `tbt_us`, a TTFT target of a minute and
    /// a `t_d` of 10 s.
    fn admitting(kind: baton_sched::AdmissionKind, tbt_us: u64, cost: CostProfile) -> Live {
        let slo = baton_sched::Slo { ttft_us: 60_000_000, tbt_us };
        let admission = AdmissionConfig { kind, slo, decode_time_us: 10_000_000, tbt_headroom: 0.0 };
        let policy = PolicyKind::LeastLoad.build(&PolicyConfig::default());
        Live::new(SchedPolicy::new(Scheduler::new(policy, admission), cost, 16, 1))
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
        let mut decode = WorkerFigures { capacity_blocks: 1 << 20, ..WorkerFigures::new(1, Role::Decode, 64) };
        decode.decoding = (0..64).map(|_| (0, 2000)).collect();
        decode.report =
            Some(baton_protocol::wire::LoadReport { decode_contexts: vec![2000; 64], ..Default::default() });
        let snap = Snapshot { workers: vec![WorkerFigures::new(0, Role::Prefill, 0), decode], now_us: now };
        let busy = cost.decode_step(65, 64 * 2000 + 100);
        let mut policy = admitting(AdmissionKind::Predictive, busy - 1, cost);
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
        let mut decode = WorkerFigures { capacity_blocks: 1 << 20, ..WorkerFigures::new(1, Role::Decode, 8) };
        let predicted = cost.decode_step(8, 8 * 500);
        let report = |step_time_us| baton_protocol::wire::LoadReport {
            decode_contexts: vec![500; 8],
            step_time_us,
            ..Default::default()
        };
        let mut policy = admitting(AdmissionKind::EarlyRejection, predicted * 3 / 2, cost);
        let prompt: Vec<u32> = (0..100).collect();
        let request = RouteRequest { prompt: &prompt, max_tokens: 16, session: None };
        let mut route = |decode: &WorkerFigures| {
            let snap = Snapshot { workers: vec![WorkerFigures::new(0, Role::Prefill, 0), decode.clone()], now_us: 1 };
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
            let mut live = Live::new(SchedPolicy::new(
                Scheduler::new(kind.build(&PolicyConfig::default()), AdmissionConfig::default()),
                cost.clone(),
                16,
                7,
            ));
            let routed = live.route(&snap, &RouteRequest { prompt: &prompt, max_tokens: 64, session: None });

            let mut direct = Scheduler::new(kind.build(&PolicyConfig::default()), AdmissionConfig::default());
            let mut trees = GlobalPromptTrees::new(PREDICTED_TTL_US);
            for w in &snap.workers {
                trees.set_role(InstanceId(w.instance), w.role);
            }
            let config = SnapshotConfig { cost: cost.clone(), ..SnapshotConfig::default() };
            let loads = snap.loads(&config);
            let cluster = cluster_snapshot(snap.now_us, &loads, &trees, &config);
            let req = SchedPolicy::request(1, &RouteRequest { prompt: &prompt, max_tokens: 64, session: None }, 16);
            let decision = direct.decide(&cluster, &req, &mut StdRng::seed_from_u64(7));
            assert_eq!(routed, SchedPolicy::to_route(&cluster, &decision), "{}", kind.name());
            assert!(matches!(routed, Decision::Disaggregated { .. }), "{}: {routed:?}", kind.name());
        }
    }

    /// Least-load sees the ledger: the idle prefill worker and the lighter decode worker.
    #[test]
    fn the_ledger_reaches_the_policy() {
        let mut live = Live::new(SchedPolicy::new(
            Scheduler::new(PolicyKind::LeastLoad.build(&PolicyConfig::default()), AdmissionConfig::default()),
            CostProfile::llama2_70b_8xa800(),
            16,
            0,
        ));
        let d = live.route(&snapshot(), &RouteRequest { prompt: &[1, 2, 3], max_tokens: 8, session: None });
        assert_eq!(d, Decision::Disaggregated { prefill: 1, decode: 2 });
    }

    /// Prompt-tree routing remembers where a prompt went: the same prompt returns to the same
    /// colocated worker even when another is as idle.
    #[test]
    fn prompt_tree_sends_a_repeated_prompt_back() {
        let mut live = Live::new(SchedPolicy::new(
            Scheduler::new(PolicyKind::PromptTree.build(&PolicyConfig::default()), AdmissionConfig::default()),
            CostProfile::llama2_70b_8xa800(),
            16,
            0,
        ));
        let snap = Snapshot {
            workers: vec![WorkerFigures::new(0, Role::Colocated, 0), WorkerFigures::new(1, Role::Colocated, 0)],
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
        let mut live = Live::new(SchedPolicy::new(
            Scheduler::new(PolicyKind::SessionAffinity.build(&PolicyConfig::default()), AdmissionConfig::default()),
            CostProfile::llama2_70b_8xa800(),
            16,
            0,
        ));
        // All but worker `idle` have prompts queued.
        let snap = |idle: usize| Snapshot {
            workers: (0..4)
                .map(|i| WorkerFigures {
                    prefilling: if i == idle { Vec::new() } else { vec![(0, 2000); 3] },
                    ..WorkerFigures::new(i as u32, Role::Colocated, 0)
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
                    .map(|i| WorkerFigures {
                        prefilling: vec![(0, 2000); 3],
                        ..WorkerFigures::new(i as u32, Role::Colocated, 0)
                    })
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
