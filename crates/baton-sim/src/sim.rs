//! The event loop: instances with queues, continuous batching, KV caches and transfers, on
//! integer virtual time, driving a [`baton_sched::Scheduler`].
//!
//! Events are ordered by (time, priority, sequence number), so a run is a pure function of the
//! configuration, the workload and the seed.
//!
//! The model of an instance:
//! - one prefill at a time, FIFO (Mooncake's queue-time estimate is the sum of queued prefills);
//!   a prefill first loads host-tier hits and fetches the route's remote blocks, then computes
//!   `prefill_time(x, cached)`; the whole prompt is then in its cache (LRU, device then host);
//! - the prompt's KV moves to the decode instance over the link; the decode instance admits
//!   requests to its running batch while their KV (prompt + output) fits its device blocks and the
//!   batch is below `max_batch`, and runs decode steps of `decode_step(batch, context)`;
//! - an instance with both prefill and decode work (colocated, or after a role change) runs
//!   prefills first.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use baton_kv::{InstanceId, KvEvent};
use baton_sched::{
    AdmissionKind, ClusterSnapshot, Decision, DecodeSeq, GlobalPromptTrees, IncomingSeq, IncomingSeqs,
    InstanceSnapshot, Ledger, LoadAware, Micros, PendingPrefill, Policy, Predict, Request, RequestId, Role, Route,
    Scheduler, TierUsage, WorkerLoad,
};
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::SimConfig;
use crate::cache::BlockCache;
use crate::load::{AdmissionSample, LoadSample, LoadTrace};
use crate::metrics::{Extra, Outcome, Report, RequestRecord, RoleChangeAt, summarise};
use crate::workload::SimRequest;

/// The snapshot of `instances` (in id order) as [`ClusterSnapshot::from_workers`] builds it, with
/// the cluster's fetch setting.
fn cluster_snapshot<'a>(
    now: Micros,
    instances: Vec<InstanceSnapshot>,
    trees: &'a GlobalPromptTrees,
    cfg: &'a SimConfig,
) -> ClusterSnapshot<'a> {
    ClusterSnapshot {
        now,
        instances,
        trees,
        cost: &cfg.cost,
        links: Vec::new(),
        kv_fetch: cfg.cluster.kv_fetch,
        decode_affinity: false,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum EventKind {
    PrefillDone { inst: usize },
    DecodeStepDone { inst: usize },
    KvReady { req: usize },
    Arrival { req: usize },
    Rebalance,
}

impl EventKind {
    fn priority(self) -> u8 {
        match self {
            EventKind::PrefillDone { .. } | EventKind::DecodeStepDone { .. } => 0,
            EventKind::KvReady { .. } => 1,
            EventKind::Arrival { .. } => 2,
            EventKind::Rebalance => 3,
        }
    }
}

#[derive(Debug)]
struct Instance {
    id: InstanceId,
    role: Role,
    cache: BlockCache,
    kv_seq: u64,
    prefill_queue: VecDeque<usize>,
    /// The queued prefills' estimates in all (`est_prefill_us`), kept as they come and go, so a
    /// snapshot's queue time costs nothing per queued request.
    queued_est_us: Micros,
    /// The running prefill: request, start, end.
    prefill_running: Option<(usize, Micros, Micros)>,
    decode_waiting: VecDeque<usize>,
    /// The waiting requests' prompt tokens in all (their context: none has decoded yet).
    waiting_context: u64,
    decode_running: Vec<usize>,
    /// Requests routed here for decode whose KV has not arrived, as the policies weigh them.
    decode_incoming: IncomingSeqs,
    decode_blocks_used: u64,
    step_running: bool,
    device_blocks: u64,
    host_blocks: u64,
    /// Moving mean of its steps' times, prefills and decode steps alike (a worker's
    /// `step_time_us`: the same weights), µs; 0 before the first.
    mean_step_us: f64,
}

impl Instance {
    /// Counts a step of `us` in the moving mean, as a worker does.
    fn stepped(&mut self, us: Micros) {
        let us = us as f64;
        self.mean_step_us = if self.mean_step_us == 0.0 { us } else { 0.9 * self.mean_step_us + 0.1 * us };
    }
}

#[derive(Debug, Clone, Default)]
struct ReqState {
    route: Option<Route>,
    est_prefill_us: Micros,
    expected_ready_us: Micros,
    prefill_compute_us: Micros,
    decode_started_us: Micros,
    generated: u64,
    blocks: u64,
    outcome: Outcome,
    prefill_start_us: Option<Micros>,
    cached_tokens: u64,
    fetched_tokens: u64,
}

/// A simulation in progress. [`Simulator::worker_loads`], [`Simulator::snapshot`] and
/// [`Simulator::request_view`] expose exactly what the scheduler sees, so a test can check that
/// the simulator's decision equals the conductor's on the same figures.
pub struct Simulator {
    cfg: SimConfig,
    requests: Vec<SimRequest>,
    state: Vec<ReqState>,
    instances: Vec<Instance>,
    trees: GlobalPromptTrees,
    scheduler: Scheduler,
    /// With [`SimConfig::elastic`]: the rule that changes roles, apart from the routing policy.
    elastic: Option<LoadAware>,
    rng: StdRng,
    /// Requests by arrival (time, then index): the queue holds only the next one's arrival, so
    /// it holds the events in flight, not the whole workload.
    arrivals: Vec<usize>,
    next_arrival: usize,
    queue: BinaryHeap<Reverse<(Micros, u8, u64, EventKind)>>,
    seq: u64,
    now: Micros,
    extra: Extra,
    /// Every KV event applied to the trees, when recording (see [`Simulator::record_kv_events`]).
    event_log: Option<Vec<KvEvent>>,
    /// The load over time, with [`SimConfig::load_trace_us`], and the next sample's time.
    load_trace: Option<(LoadTrace, Micros)>,
}

impl std::fmt::Debug for Simulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Simulator").field("now", &self.now).field("requests", &self.requests.len()).finish()
    }
}

impl Simulator {
    /// A simulator at time 0 with its first arrival scheduled (each arrival schedules the next).
    pub fn new(cfg: SimConfig, requests: Vec<SimRequest>) -> Self {
        let c = &cfg.cluster;
        let roles = std::iter::repeat_n(Role::Prefill, c.prefill)
            .chain(std::iter::repeat_n(Role::Decode, c.decode))
            .chain(std::iter::repeat_n(Role::Colocated, c.colocated));
        let mut trees = GlobalPromptTrees::new(cfg.tree_ttl_us);
        let instances: Vec<Instance> = roles
            .enumerate()
            .map(|(i, role)| {
                let id = InstanceId(i as u32);
                trees.set_role(id, role);
                Instance {
                    id,
                    role,
                    cache: BlockCache::new(c.device_cache_blocks as usize, c.host_blocks as usize),
                    kv_seq: 0,
                    prefill_queue: VecDeque::new(),
                    queued_est_us: 0,
                    prefill_running: None,
                    decode_waiting: VecDeque::new(),
                    waiting_context: 0,
                    decode_running: Vec::new(),
                    decode_incoming: IncomingSeqs::new(),
                    decode_blocks_used: 0,
                    step_running: false,
                    device_blocks: c.device_blocks,
                    host_blocks: c.host_blocks,
                    mean_step_us: 0.0,
                }
            })
            .collect();
        let scheduler = Scheduler::new(cfg.policy.build(&cfg.policy_config), cfg.admission)
            .with_conditional(cfg.conditional_tokens);
        let mut sim = Self {
            rng: StdRng::seed_from_u64(cfg.seed),
            state: vec![ReqState::default(); requests.len()],
            requests,
            instances,
            trees,
            scheduler,
            elastic: cfg.elastic.then(|| LoadAware::new(cfg.policy_config.load_aware)),
            arrivals: Vec::new(),
            next_arrival: 0,
            queue: BinaryHeap::new(),
            seq: 0,
            now: 0,
            extra: Extra::default(),
            event_log: None,
            load_trace: (cfg.load_trace_us > 0)
                .then(|| (LoadTrace { every_us: cfg.load_trace_us, ..LoadTrace::default() }, 0)),
            cfg,
        };
        // The order in which a queue holding every arrival (pushed in index order) would pop
        // them: by time, then index. Scheduling one at a time keeps that order, and no other
        // event shares an arrival's priority, so every run is the same.
        let mut arrivals: Vec<usize> = (0..sim.requests.len()).collect();
        arrivals.sort_by_key(|&i| (sim.requests[i].arrival_us, i));
        sim.arrivals = arrivals;
        sim.schedule_next_arrival();
        if sim.cfg.rebalance_interval_us > 0 {
            sim.push(sim.cfg.rebalance_interval_us, EventKind::Rebalance);
        }
        sim
    }

    fn schedule_next_arrival(&mut self) {
        if let Some(&i) = self.arrivals.get(self.next_arrival) {
            self.next_arrival += 1;
            self.push(self.requests[i].arrival_us, EventKind::Arrival { req: i });
        }
    }

    fn push(&mut self, at: Micros, kind: EventKind) {
        self.seq += 1;
        self.queue.push(Reverse((at, kind.priority(), self.seq, kind)));
    }

    /// Virtual time now.
    pub fn now(&self) -> Micros {
        self.now
    }

    /// The scheduler's view of request `i` of the workload.
    pub fn request_view(&self, i: usize) -> Request {
        let r = &self.requests[i];
        Request {
            id: RequestId(i as u64),
            prompt_tokens: r.input_tokens,
            block_hashes: r.hashes.clone(),
            block_tokens: self.cfg.cluster.block_tokens,
            expected_output: r.output_tokens,
            session: r.session,
        }
    }

    /// Each instance's figures now, as a conductor would have them of live workers (the running
    /// prefill first, then the queued ones; decodes with their contexts; KV blocks in use: the
    /// decode batch's and the prefix cache's). Lists every queued request: the reference
    /// [`Simulator::snapshot`] is checked against, not what the event loop builds.
    pub fn worker_loads(&self) -> Vec<WorkerLoad> {
        self.instances.iter().map(|inst| self.worker_load(inst)).collect()
    }

    fn worker_load(&self, inst: &Instance) -> WorkerLoad {
        let (dev_cache, host_cache) = inst.cache.usage();
        let running =
            inst.prefill_running.map(|(_, start, end)| PendingPrefill { est_us: end - start, started_at: Some(start) });
        let queued = inst
            .prefill_queue
            .iter()
            .map(|&r| PendingPrefill { est_us: self.state[r].est_prefill_us, started_at: None });
        WorkerLoad {
            id: inst.id,
            role: inst.role,
            accepting: true,
            prefills: running.into_iter().chain(queued).collect(),
            decode_running: self.decode_seqs(inst),
            decode_waiting: inst.decode_waiting.len() as u32,
            decode_incoming: inst.decode_incoming.iter().collect(),
            kv_device: TierUsage { used: inst.decode_blocks_used + dev_cache as u64, total: inst.device_blocks },
            kv_host: TierUsage { used: host_cache as u64, total: inst.host_blocks },
            decode_step_scale: 1.0,
            mean_step_us: inst.mean_step_us as Micros,
            ledger: Ledger::default(),
            kv_group: None,
        }
    }

    /// The snapshot the simulator passes to the scheduler now: what
    /// [`ClusterSnapshot::from_workers`] builds from [`Simulator::worker_loads`], the call a
    /// conductor makes with live figures, but built from totals the instances keep as work comes
    /// and goes (`tests/overload.rs` checks the two are equal), so its cost does not grow with the
    /// queues: under overload the prefill queues and the requests coming to each decode
    /// instance grow without bound, and a snapshot is taken per arrival.
    pub fn snapshot(&self) -> ClusterSnapshot<'_> {
        cluster_snapshot(self.now, self.instance_snapshots(), &self.trees, &self.cfg)
    }

    fn instance_snapshots(&self) -> Vec<InstanceSnapshot> {
        self.instances.iter().map(|inst| self.instance_snapshot(inst)).collect()
    }

    /// What [`WorkerLoad::snapshot`] makes of [`Simulator::worker_load`], from running totals:
    /// O(1) per instance but for its decode batch (at most `max_batch`).
    fn instance_snapshot(&self, inst: &Instance) -> InstanceSnapshot {
        let (dev_cache, host_cache) = inst.cache.usage();
        let running =
            inst.prefill_running.map(|(_, start, end)| (end - start).saturating_sub(self.now.saturating_sub(start)));
        InstanceSnapshot {
            id: inst.id,
            role: inst.role,
            accepting: true,
            prefill_queue_len: (inst.prefill_queue.len() + usize::from(running.is_some())) as u32,
            queued_prefill_us: running.unwrap_or(0) + inst.queued_est_us,
            decode_running: self.decode_seqs(inst),
            decode_waiting: inst.decode_waiting.len() as u32,
            decode_incoming: inst.decode_incoming.clone(),
            kv: [
                TierUsage { used: inst.decode_blocks_used + dev_cache as u64, total: inst.device_blocks },
                TierUsage { used: host_cache as u64, total: inst.host_blocks },
                TierUsage::default(),
            ],
            nic_bytes_per_s: 0,
            decode_step_scale: 1.0,
            mean_step_us: inst.mean_step_us as Micros,
            ledger: Ledger::default(),
            kv_group: None,
        }
    }

    fn decode_seqs(&self, inst: &Instance) -> Vec<DecodeSeq> {
        inst.decode_running
            .iter()
            .map(|&r| DecodeSeq {
                started_at: self.state[r].decode_started_us,
                context: self.requests[r].input_tokens + self.state[r].generated,
                // The first token came from the prefill.
                remaining: (!self.cfg.uniform_decode_time)
                    .then(|| self.requests[r].output_tokens.saturating_sub(1 + self.state[r].generated)),
            })
            .collect()
    }

    /// Starts (or stops) keeping every KV event the instances emit, for
    /// [`Simulator::take_kv_events`]: what a conductor's prompt trees would be fed.
    pub fn record_kv_events(&mut self, on: bool) {
        self.event_log = on.then(Vec::new);
    }

    /// KV events recorded since the last call.
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        self.event_log.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// The scheduler's decision for request `i` now (consumes randomness and policy state, as the
    /// live conductor would).
    pub fn decide(&mut self, i: usize) -> Decision {
        self.decide_predicting(i).0
    }

    /// [`Self::decide`], with the prompt the decision expects cached where it routed it, for
    /// [`Self::on_arrival`] to apply to the trees (the decision only reads them).
    fn decide_predicting(&mut self, i: usize) -> (Decision, Option<Predict>) {
        let req = self.request_view(i);
        let snap = cluster_snapshot(self.now, self.instance_snapshots(), &self.trees, &self.cfg);
        let (decision, check) = self.scheduler.decide_explained(&snap, &req, &mut self.rng);
        if let (Some((trace, _)), Some(c)) = (&mut self.load_trace, check) {
            trace.admissions.push(AdmissionSample {
                at_us: self.now,
                request: i,
                decode: c.decode.0,
                horizon_us: c.at,
                predicted_us: c.load_us,
                limit_us: c.limit_us,
                admitted: decision.route().is_some(),
            });
        }
        let predict = Predict::of(&decision, req);
        (decision, predict)
    }

    /// Samples every instance at each sample time up to `until` (exclusive): nothing changes
    /// between events, so the state now is the state then.
    fn sample_load(&mut self, until: Micros) {
        let Some((mut trace, mut next)) = self.load_trace.take() else { return };
        while next < until {
            for inst in &self.instances {
                let (batch, ctx) = self.decode_batch(self.index_of(inst.id));
                let running = inst.prefill_running.map_or(0, |(_, start, end)| end.saturating_sub(next.max(start)));
                trace.samples.push(LoadSample {
                    at_us: next,
                    instance: inst.id.0,
                    decodes: inst.role.decodes(),
                    prefills: inst.role.prefills(),
                    prefill_queue_us: running + inst.queued_est_us,
                    decode_running: batch as u32,
                    decode_waiting: inst.decode_waiting.len() as u32,
                    decode_incoming: inst.decode_incoming.len() as u32,
                    step_us: self.cfg.cost.decode_step(batch, ctx),
                });
            }
            next += trace.every_us;
        }
        self.load_trace = Some((trace, next));
    }

    /// Processes events up to and including virtual time `until`. Returns false when none are left.
    pub fn run_until(&mut self, until: Micros) -> bool {
        while let Some(Reverse((at, _, _, kind))) = self.queue.peek().copied() {
            if at > until {
                return true;
            }
            self.queue.pop();
            if self.load_trace.is_some() {
                self.sample_load(at);
            }
            self.now = at;
            self.extra.events += 1;
            self.handle(kind);
        }
        false
    }

    /// Runs to the end and reports.
    pub fn finish(mut self) -> Report {
        self.run_until(Micros::MAX);
        let c = &self.cfg.cluster;
        let arrivals: Vec<(Micros, u64)> = self.requests.iter().map(|r| (r.arrival_us, r.output_tokens)).collect();
        let outcomes: Vec<Outcome> = self.state.iter().map(|s| s.outcome).collect();
        let records = if self.cfg.records { self.records() } else { Vec::new() };
        let load_trace = self.load_trace.take().map(|(t, _)| t).unwrap_or_default();
        let mut report = summarise(
            self.scheduler.policy.name(),
            self.cfg.admission.kind.name(),
            (c.prefill, c.decode, c.colocated),
            self.cfg.seed,
            self.cfg.admission.slo,
            &arrivals,
            &outcomes,
            self.extra,
            records,
        );
        report.load_trace = load_trace;
        report
    }

    fn records(&self) -> Vec<RequestRecord> {
        let since = |at: Option<Micros>, arrival| at.map(|t: Micros| t - arrival);
        (self.requests.iter().zip(&self.state))
            .enumerate()
            .map(|(id, (r, st))| RequestRecord {
                id,
                arrival_us: r.arrival_us,
                prefill: st.route.as_ref().map(|rt| rt.prefill.0),
                decode: st.route.as_ref().map(|rt| rt.decode.0),
                prompt_tokens: r.input_tokens,
                cached_tokens: st.cached_tokens,
                fetched_tokens: st.fetched_tokens,
                prefill_start_us: st.prefill_start_us,
                ttft_us: since(st.outcome.first_token_us, r.arrival_us),
                jct_us: since(st.outcome.done_us, r.arrival_us),
            })
            .collect()
    }

    fn handle(&mut self, kind: EventKind) {
        match kind {
            EventKind::Arrival { req } => {
                self.schedule_next_arrival();
                self.on_arrival(req);
            }
            EventKind::PrefillDone { inst } => self.on_prefill_done(inst),
            EventKind::KvReady { req } => self.on_kv_ready(req),
            EventKind::DecodeStepDone { inst } => self.on_step_done(inst),
            EventKind::Rebalance => self.on_rebalance(),
        }
    }

    fn index_of(&self, id: InstanceId) -> usize {
        id.0 as usize
    }

    fn on_arrival(&mut self, i: usize) {
        self.trees.expire(self.now);
        let (decision, predict) = self.decide_predicting(i);
        let route = match decision {
            Decision::Route(r) => r,
            Decision::Reject { .. } => {
                self.state[i].outcome.rejected_early = true;
                return;
            }
        };
        let (p, d) = (self.index_of(route.prefill), self.index_of(route.decode));
        if p == d && self.instances[d].role == Role::Decode {
            self.extra.run_on_decode += 1;
        }
        // The scheduler expects the prompt to be cached at p after this prefill.
        if let Some(predict) = &predict {
            self.trees.apply_predict(predict, self.now);
        }
        let req = &self.requests[i];
        let est = self
            .cfg
            .cost
            .prefill_time_cached(req.input_tokens, self.request_view(i).cached_tokens(route.reused_blocks() as usize));
        let transfer = if p == d { 0 } else { self.cfg.cost.kv_transfer_time(req.input_tokens, self.cfg.cost.network) };
        let st = &mut self.state[i];
        st.est_prefill_us = est;
        st.expected_ready_us = self.now + route.estimate.ttft_us + transfer;
        st.route = Some(route);
        let incoming = IncomingSeq {
            ready_at: st.expected_ready_us,
            context: req.input_tokens,
            output: (!self.cfg.uniform_decode_time).then(|| req.output_tokens.saturating_sub(1)),
        };
        self.instances[p].prefill_queue.push_back(i);
        self.instances[p].queued_est_us += est;
        self.instances[d].decode_incoming.push(incoming);
        self.kick(p);
    }

    /// Starts the next piece of work on an idle instance. An instance with decodes running runs
    /// its next prefill in one step with them, as the live engine does (the weights are read
    /// once for both: [`CostProfile::batch_time`](baton_sched::CostProfile::batch_time)).
    fn kick(&mut self, inst: usize) {
        if self.instances[inst].prefill_running.is_some() || self.instances[inst].step_running {
            return;
        }
        self.admit_decodes(inst);
        if let Some(r) = self.instances[inst].prefill_queue.pop_front() {
            self.instances[inst].queued_est_us -= self.state[r].est_prefill_us;
            self.start_prefill(inst, r);
        } else if !self.instances[inst].decode_running.is_empty() {
            let (batch, ctx) = self.decode_batch(inst);
            let step = self.cfg.cost.decode_step(batch, ctx).max(1);
            self.instances[inst].step_running = true;
            self.instances[inst].stepped(step);
            self.push(self.now + step, EventKind::DecodeStepDone { inst });
        }
    }

    /// The running decode batch of an instance: sequences and their context tokens.
    fn decode_batch(&self, inst: usize) -> (u64, u64) {
        let it = &self.instances[inst];
        let ctx: u64 = it.decode_running.iter().map(|&r| self.requests[r].input_tokens + self.state[r].generated).sum();
        (it.decode_running.len() as u64, ctx)
    }

    fn start_prefill(&mut self, p: usize, r: usize) {
        let cost = &self.cfg.cost;
        let req = &self.requests[r];
        let view = self.request_view(r);
        let st = &self.state[r];
        // What is cached here now (it may differ from what the scheduler saw).
        let hit = self.instances[p].cache.lookup(&req.hashes);
        let mut cached = hit.blocks;
        let mut extra_us = cost.kv_transfer_time(view.cached_tokens(hit.on_host), cost.host_to_device);
        // Remote spans the route asked for, as far as the source still holds them.
        if let Some(route) = &st.route {
            for span in route.reuse.iter().filter(|s| s.from != self.instances[p].id) {
                if (span.start as usize) > cached {
                    break;
                }
                let src = &self.instances[self.index_of(span.from)];
                let held = src.cache.lookup(&req.hashes).blocks.min(span.end as usize);
                if held > cached {
                    let tokens = view.cached_tokens(held) - view.cached_tokens(cached);
                    extra_us += cost.kv_transfer_time(tokens, cost.network);
                    cached = held;
                    self.extra.cache_transfers += 1;
                }
            }
        }
        let cached_tokens = view.cached_tokens(cached);
        let local_tokens = view.cached_tokens(hit.blocks);
        // With decodes running, one step computes the prompt and a token of each.
        let (batch, ctx) = self.decode_batch(p);
        let compute = cost.batch_time(&[(cached_tokens, req.input_tokens)], batch, ctx);
        self.extra.prefilled_tokens += req.input_tokens;
        self.extra.reused_tokens += cached_tokens;
        let end = self.now + extra_us + compute;
        let st = &mut self.state[r];
        st.prefill_compute_us = compute;
        st.prefill_start_us = Some(self.now);
        st.cached_tokens = local_tokens;
        st.fetched_tokens = cached_tokens - local_tokens;
        self.instances[p].prefill_running = Some((r, self.now, end));
        self.instances[p].stepped(end - self.now);
        // Blocks being read are in use: refresh them in the LRU now.
        let used = req.hashes[..hit.blocks].to_vec();
        self.instances[p].cache.insert(&used);
        self.flush_events(p);
        if batch > 0 {
            self.instances[p].step_running = true;
            self.push(end, EventKind::DecodeStepDone { inst: p });
        }
        self.push(end, EventKind::PrefillDone { inst: p });
    }

    fn flush_events(&mut self, inst: usize) {
        let it = &mut self.instances[inst];
        let id = it.id;
        let mut seq = it.kv_seq;
        let events: Vec<KvEvent> = it
            .cache
            .drain_events()
            .map(|kind| {
                seq += 1;
                KvEvent { instance: id, seq: seq - 1, kind }
            })
            .collect();
        it.kv_seq = seq;
        for e in &events {
            // The simulator's event stream has no gaps, so this cannot fail.
            let _ = self.trees.apply(e);
        }
        if let Some(log) = &mut self.event_log {
            log.extend(events);
        }
    }

    fn on_prefill_done(&mut self, p: usize) {
        let Some((r, _, _)) = self.instances[p].prefill_running.take() else { return };
        let hashes = self.requests[r].hashes.clone();
        self.instances[p].cache.insert(&hashes);
        self.flush_events(p);
        self.state[r].outcome.first_token_us = Some(self.now);
        let d = self.state[r].route.as_ref().map_or(p, |rt| self.index_of(rt.decode));
        let ready = if d == p {
            self.now
        } else {
            let cost = &self.cfg.cost;
            let input = self.requests[r].input_tokens;
            let transfer = cost.kv_transfer_time(input, cost.network);
            if self.cfg.layerwise_push {
                let layers = Micros::from(cost.layers.unwrap_or(1).max(1));
                let chunk = self.cfg.cluster.prefill_chunk.max(1);
                let last_chunk = input - input.saturating_sub(1) / chunk * chunk;
                let last_layer = cost.kv_transfer_time(last_chunk, cost.network).div_ceil(layers);
                let compute_start = self.now - self.state[r].prefill_compute_us;
                (self.now + last_layer).max(compute_start + transfer)
            } else {
                self.now + transfer
            }
        };
        self.push(ready, EventKind::KvReady { req: r });
        self.kick(p);
    }

    fn on_kv_ready(&mut self, r: usize) {
        let Some(d) = self.state[r].route.as_ref().map(|rt| self.index_of(rt.decode)) else { return };
        let req = &self.requests[r];
        let arrived = IncomingSeq {
            ready_at: self.state[r].expected_ready_us,
            context: req.input_tokens,
            output: (!self.cfg.uniform_decode_time).then(|| req.output_tokens.saturating_sub(1)),
        };
        self.instances[d].decode_incoming.remove(arrived);
        if req.output_tokens <= 1 {
            self.state[r].outcome.done_us = Some(self.now);
            return;
        }
        if self.cfg.admission.kind.decode_checks_on_arrival() {
            // The decode instance guards its own TBT: this is where a prefill gets wasted.
            let it = &self.instances[d];
            let (_, running_ctx) = self.decode_batch(d);
            let ctx = running_ctx + it.waiting_context;
            let batch = (it.decode_running.len() + it.decode_waiting.len() + 1) as u64;
            let tbt = self.cfg.cost.decode_step(batch, ctx + req.input_tokens);
            let blocks = (req.input_tokens + req.output_tokens).div_ceil(self.cfg.cluster.block_tokens);
            if tbt > self.cfg.admission.slo.tbt_us || blocks > it.device_blocks {
                self.state[r].outcome.rejected_late = true;
                self.extra.wasted_prefill_us += self.state[r].prefill_compute_us;
                self.extra.wasted_prefill_tokens += req.input_tokens;
                return;
            }
        }
        self.instances[d].decode_waiting.push_back(r);
        self.instances[d].waiting_context += req.input_tokens;
        self.kick(d);
    }

    fn admit_decodes(&mut self, d: usize) {
        let bt = self.cfg.cluster.block_tokens;
        while let Some(&r) = self.instances[d].decode_waiting.front() {
            let req = &self.requests[r];
            let blocks = (req.input_tokens + req.output_tokens).div_ceil(bt);
            let it = &self.instances[d];
            let fits = it.decode_blocks_used + blocks <= it.device_blocks || it.decode_running.is_empty();
            if !fits || it.decode_running.len() >= self.cfg.cluster.max_batch {
                break;
            }
            self.instances[d].decode_waiting.pop_front();
            self.instances[d].waiting_context -= req.input_tokens;
            self.instances[d].decode_blocks_used += blocks;
            self.instances[d].decode_running.push(r);
            self.state[r].blocks = blocks;
            self.state[r].decode_started_us = self.now;
            self.state[r].outcome.decode_start_us.get_or_insert(self.now);
        }
    }

    fn on_step_done(&mut self, d: usize) {
        self.instances[d].step_running = false;
        let running = std::mem::take(&mut self.instances[d].decode_running);
        let mut keep = Vec::with_capacity(running.len());
        for r in running {
            let st = &mut self.state[r];
            st.generated += 1;
            // The first token came from the prefill.
            if st.generated + 1 >= self.requests[r].output_tokens {
                st.outcome.done_us = Some(self.now);
                self.instances[d].decode_blocks_used -= st.blocks;
            } else {
                keep.push(r);
            }
        }
        self.instances[d].decode_running = keep;
        self.kick(d);
    }

    fn on_rebalance(&mut self) {
        let snap = cluster_snapshot(self.now, self.instance_snapshots(), &self.trees, &self.cfg);
        let change = match &mut self.elastic {
            Some(rule) => rule.rebalance(&snap),
            None => self.scheduler.rebalance(&snap),
        };
        if let Some(c) = change {
            let i = self.index_of(c.instance);
            self.instances[i].role = c.to;
            self.trees.set_role(c.instance, c.to);
            self.extra.role_changes.push(RoleChangeAt::new(self.now, c));
            self.kick(i);
        }
        // Keep ticking while work remains.
        if self.queue.iter().any(|Reverse((_, _, _, k))| !matches!(k, EventKind::Rebalance)) {
            self.push(self.now + self.cfg.rebalance_interval_us, EventKind::Rebalance);
        }
    }

    /// The admission kind in force (for callers that need it).
    pub fn admission(&self) -> AdmissionKind {
        self.cfg.admission.kind
    }
}
