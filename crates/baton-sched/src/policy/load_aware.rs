//! FlowKV's load-aware scheduler.
//!
//! Under normal load it balances: the prefill instance minimises queue time plus predicted
//! prefill time with its cached prefix (MemServe eq. 1, `argmin_p Σ exec(x', y'_p) + exec(x, y_p)`),
//! the decode instance has the least predicted TBT. Under *persistent* computational imbalance —
//! one pool over its high watermark and the other under its low watermark for long enough — it
//! moves the least-busy instance of the idle pool to the busy role ([`RoleChange`]), keeping at
//! least `min_per_role` instances in each. Where the idle pool has no instance to spare (two
//! instances, one of each), that instance becomes colocated instead: it keeps its role's work
//! and takes the busy kind too, the middle state between a fixed split and two colocated
//! instances. Where the idle pool has no single-role instance left, a single-role instance of
//! the busy pool becomes colocated: the idle kind of work then spreads over more instances
//! instead of stalling one. A pool is every instance that takes its kind of work, colocated
//! ones included.
//!
//! How long is long enough scales with how deep the imbalance is: `persist_us` is the hold for
//! a busy pool at its SLO (load 1); an imbalance accrues time at the pace
//! `(busy − high) / (1 − high)` (clamped to [`MIN_PACE`]..=[`MAX_PACE`]), so with FlowKV's 0.7
//! watermark a pool at 2.5 times its SLO acts in a sixth of the hold, one at 3.7 in a tenth,
//! and one just over the watermark in two holds. A large, steady imbalance is met within
//! seconds, a small one slowly. A lull drains the accrual at pace 1 (a noisy load that dips
//! under the watermark now and then still accrues; a balanced one does not), a change of
//! direction or a switch starts it again, so the policy never flaps faster than
//! `persist_us / MAX_PACE` — except that a switch to colocated keeps what the imbalance accrued,
//! so the pair's second step to two colocated instances follows at the next look while the
//! same imbalance lasts (both steps are towards colocation: nothing to flap between). The
//! default hold, 2 s, was chosen on `scripts/disagg-vs-colocated.sh emulated` (docs/benchmarks/disagg-vs-colocated.md).
//!
//! Decode load counts the step above its floor: a decode step reads the weights once whatever
//! the batch, so a lone request's step (5.2 ms for a 70B model on 8×H100) is no load; the load
//! is the share of the TBT budget above that floor the batch uses. An idle decode pool is then
//! at 0 under any SLO, not at floor/SLO (0.35 of a 15 ms target, over FlowKV's low watermark).
//!
//! The imbalance's accrual is the policy's state; time comes from the snapshot.

use rand::RngCore;
use serde::{Deserialize, Serialize};

use super::{Policy, PrefillPlan, least_loaded_decode, least_ttft, spread, tbt_with};
use crate::snapshot::{ClusterSnapshot, Decision, InstanceSnapshot, RejectReason, Request, Role};
use crate::{Micros, RoleChange};

/// Watermarks and timers of the load-aware policy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LoadAwareConfig {
    /// Prefill load is mean queue time over this (the TTFT SLO).
    pub ttft_slo_us: Micros,
    /// Decode load is mean step time over this (the TBT SLO), plus waiting requests per running one.
    pub tbt_slo_us: Micros,
    /// Load above which a pool is overloaded.
    pub high: f64,
    /// Load below which a pool can give an instance away.
    pub low: f64,
    /// How long an imbalance with its busy pool at its SLO (load 1) must last before a switch;
    /// deeper ones act sooner, shallower ones later (the module's doc).
    pub persist_us: Micros,
    /// Instances each role keeps at least.
    pub min_per_role: usize,
}

impl Default for LoadAwareConfig {
    fn default() -> Self {
        Self {
            ttft_slo_us: 30_000_000,
            tbt_slo_us: 100_000,
            high: 0.7,
            low: 0.3,
            persist_us: 2_000_000,
            min_per_role: 1,
        }
    }
}

/// The slowest pace an imbalance accrues at (a busy pool just over its high watermark): it acts
/// after `persist_us / MIN_PACE`.
pub const MIN_PACE: f64 = 0.5;
/// The fastest pace (a busy pool far over): it acts after `persist_us / MAX_PACE`.
pub const MAX_PACE: f64 = 10.0;

/// An imbalance in one direction, and how much of the hold it has accrued.
#[derive(Debug, Clone, Copy)]
struct Imbalance {
    /// `true`: decode overloaded.
    decode_hot: bool,
    /// When it was last looked at.
    seen: Micros,
    /// Microseconds of hold accrued (time weighted by the pace).
    accrued_us: f64,
}

/// FlowKV's policy.
#[derive(Debug, Clone)]
pub struct LoadAware {
    cfg: LoadAwareConfig,
    imbalance: Option<Imbalance>,
}

impl LoadAware {
    /// A policy with these settings.
    pub fn new(cfg: LoadAwareConfig) -> Self {
        Self { cfg, imbalance: None }
    }

    /// How fast an imbalance whose busy pool is at `busy` accrues hold.
    pub fn pace(&self, busy: f64) -> f64 {
        ((busy - self.cfg.high) / (1.0 - self.cfg.high).max(0.05)).clamp(MIN_PACE, MAX_PACE)
    }

    /// Load of a prefill instance (queue time over the TTFT SLO).
    pub fn prefill_load(&self, i: &InstanceSnapshot) -> f64 {
        i.queued_prefill_us as f64 / self.cfg.ttft_slo_us.max(1) as f64
    }

    /// Load of a decode instance (its step above the step's floor over the TBT SLO above it, KV
    /// occupancy, and the queue). A colocated instance's decodes wait for its prefill chunks
    /// too: its step is the larger of the predicted decode step and its measured mean step.
    pub fn decode_load(&self, snap: &ClusterSnapshot<'_>, i: &InstanceSnapshot) -> f64 {
        let mut step_us = i.decode_step(snap.cost, i.decode_batch(), i.decode_context());
        if i.role == Role::Colocated && i.decode_batch() > 0 {
            step_us = step_us.max(i.mean_step_us);
        }
        // The floor: one short request's step, the weights read once.
        let floor = i.decode_step(snap.cost, 1, 0) as f64;
        let slo = self.cfg.tbt_slo_us.max(1) as f64;
        let step = if slo > floor { (step_us as f64 - floor).max(0.0) / (slo - floor) } else { step_us as f64 / slo };
        let dev = i.kv[0];
        let mem = if dev.total > 0 { dev.used as f64 / dev.total as f64 } else { 0.0 };
        step.max(mem) + f64::from(i.decode_waiting) / (i.decode_batch().max(1) as f64)
    }

    /// The mean load of the accepting prefill instances and of the accepting decode instances
    /// (0 for a pool with none): what [`Policy::rebalance`] weighs against the watermarks.
    /// Colocated instances count in both pools.
    pub fn pool_loads(&self, snap: &ClusterSnapshot<'_>) -> (f64, f64) {
        (
            mean(snap.prefill_pool().map(|i| self.prefill_load(i))),
            mean(snap.decode_pool().map(|i| self.decode_load(snap, i))),
        )
    }
}

fn mean(v: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = v.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 { 0.0 } else { s / n as f64 }
}

impl Policy for LoadAware {
    fn name(&self) -> &'static str {
        "load-aware"
    }

    fn route(&mut self, snap: &ClusterSnapshot<'_>, req: &Request, _rng: &mut dyn RngCore) -> Decision {
        // Local prefixes only: FlowKV does not fetch KV between prefill instances.
        let plans: Vec<PrefillPlan<'_>> = snap
            .prefill_pool()
            .map(|i| PrefillPlan::new(snap, req, i, snap.trees.prefix_len(i.id, &req.block_hashes, snap.now), None))
            .collect();
        let Some(fastest) = least_ttft(plans.iter().copied(), req) else {
            return Decision::Reject { reason: RejectReason::NoInstance };
        };
        // A colocated instance decodes what it prefills: among colocated instances whose TTFT is
        // within a quarter of the fastest, the one the request slows least (by the TTFT alone,
        // requests that find the queues empty would land by chance, and one instance's decode
        // batch would grow while the other's shrank).
        let plan = if fastest.inst.role == Role::Colocated {
            let near =
                |p: &&PrefillPlan<'_>| p.inst.role == Role::Colocated && p.ttft <= fastest.ttft + fastest.ttft / 4;
            plans
                .iter()
                .filter(near)
                .min_by_key(|p| (tbt_with(snap, p.inst, req), spread(req, p.inst.id)))
                .copied()
                .unwrap_or(fastest)
        } else {
            fastest
        };
        match least_loaded_decode(snap, req, plan.inst) {
            Some(d) => Decision::Route(plan.route(d)),
            None => Decision::Reject { reason: RejectReason::NoInstance },
        }
    }

    fn rebalance(&mut self, snap: &ClusterSnapshot<'_>) -> Option<RoleChange> {
        let (pl, dl) = self.pool_loads(snap);
        // The low watermark keeps the idle pool from giving away an instance it needs. Under a
        // decode-heavy load with no single-role prefill instance left, the prefill pool gives
        // nothing: the switch makes a decode instance colocated, which adds to the prefill pool
        // and spreads the decode batch; that needs only the prefill pool not overloaded itself
        // (its colocated instances prefill every prompt between their decode steps, so it sits
        // between the watermarks). Not the other way: under a prefill-heavy load the last
        // prefill instance made colocated would put long prefill chunks between every decode
        // step of both instances, and 1P+1C measured better than 2C there (docs/benchmarks/disagg-vs-colocated.md).
        let no_single_prefill = !snap.instances.iter().any(|i| i.accepting && i.role == Role::Prefill);
        let prefill_spares = pl < self.cfg.low || (no_single_prefill && pl <= self.cfg.high);
        let direction = if dl > self.cfg.high && prefill_spares {
            Some(true)
        } else if pl > self.cfg.high && dl < self.cfg.low {
            Some(false)
        } else {
            None
        };
        let now = snap.now;
        let Some(decode_hot) = direction else {
            // A lull drains what the imbalance accrued, at the pace of a pool at its SLO: a
            // brief dip below the watermark (a noisy load) does not start the hold again, a
            // lasting one does.
            self.imbalance = self.imbalance.and_then(|mut i| {
                i.accrued_us -= now.saturating_sub(i.seen) as f64;
                i.seen = now;
                (i.accrued_us > 0.0).then_some(i)
            });
            return None;
        };
        let pace = self.pace(if decode_hot { dl } else { pl });
        let imbalance = match self.imbalance {
            Some(mut i) if i.decode_hot == decode_hot => {
                i.accrued_us += pace * now.saturating_sub(i.seen) as f64;
                i.seen = now;
                i
            }
            _ => Imbalance { decode_hot, seen: now, accrued_us: 0.0 },
        };
        self.imbalance = Some(imbalance);
        if imbalance.accrued_us < self.cfg.persist_us as f64 {
            return None;
        }
        // The idle pool gives its least busy single-role instance: it switches to the busy role
        // when the idle pool keeps `min_per_role` without it, else it becomes colocated. With
        // no single-role instance left in the idle pool, the idle kind of work all lands on
        // colocated instances, stalling their share of the busy kind (a lone colocated
        // instance prefills every prompt between its decode steps): a single-role instance of
        // the busy pool becomes colocated too, and spreads it.
        let (idle_role, idle_pool) = if decode_hot {
            (Role::Prefill, snap.prefill_pool().count())
        } else {
            (Role::Decode, snap.decode_pool().count())
        };
        let busy_role = if decode_hot { Role::Decode } else { Role::Prefill };
        let single = |role: Role| snap.instances.iter().filter(move |i| i.accepting && i.role == role);
        let idlest_prefill = |it: &mut dyn Iterator<Item = &InstanceSnapshot>| {
            it.min_by_key(|i| (i.queued_prefill_us, i.id)).map(|i| i.id)
        };
        let idlest_decode = |it: &mut dyn Iterator<Item = &InstanceSnapshot>| {
            it.min_by_key(|i| (i.decode_batch() + u64::from(i.decode_waiting), i.id)).map(|i| i.id)
        };
        // Under a prefill-heavy load the last prefill instance stays one: made colocated it
        // would put long prefill chunks between every decode step of both instances, and 1P+1C
        // measured better than 2C there (`scripts/disagg-vs-colocated.sh emulated`, long
        // prompts at 16 and 20 req/s: docs/benchmarks/disagg-vs-colocated.md).
        let (from_idle, from_busy) = if decode_hot {
            (idlest_prefill(&mut single(Role::Prefill)), idlest_decode(&mut single(Role::Decode)))
        } else {
            (idlest_decode(&mut single(Role::Decode)), None)
        };
        // Under a decode-heavy load the prefill pool keeps `min_per_role` prefill instances of
        // its own: a colocated one prefills between its decode steps, so beside it the last
        // prefill instance becomes colocated too (2C) rather than a decode instance (1C+1D,
        // where one instance would prefill every prompt).
        let idle_keeps = if decode_hot { single(Role::Prefill).count() } else { idle_pool };
        let change = match (from_idle, from_busy) {
            (Some(id), _) => {
                let to = if idle_keeps > self.cfg.min_per_role { busy_role } else { Role::Colocated };
                RoleChange { instance: id, from: idle_role, to }
            }
            (None, Some(id)) => RoleChange { instance: id, from: busy_role, to: Role::Colocated },
            (None, None) => return None,
        };
        // A switch starts the hold again, so the policy never flaps, except on the way to
        // colocation: an instance made colocated is the middle step of meeting this imbalance
        // (the pair's other instance follows when it lasts), so the imbalance keeps what it
        // accrued: if it still holds at the next look, the next step follows at once, and a
        // lull drains it as before. A 1P+1D pair under a steady decode-heavy load reaches 2C
        // in one hold, not two, and spends less time in 1C+1D, where the colocated instance
        // prefills every prompt between its decode steps.
        self.imbalance = (change.to == Role::Colocated).then_some(imbalance);
        Some(change)
    }
}

#[cfg(test)]
mod tests {
    use baton_kv::{BlockHash, InstanceId};
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;
    use crate::policy::testutil::{instances, request, snap, trees_for};
    use crate::{CostProfile, DecodeSeq};

    #[test]
    fn balanced_routing_weighs_cache_against_queue() {
        let cost = CostProfile::llama2_70b_8xa800();
        let mut inst = instances(2, 1);
        inst[0].queued_prefill_us = 2_000_000;
        let mut trees = trees_for(&inst);
        let h: Vec<BlockHash> = (1..=40).map(BlockHash).collect();
        trees.predict(InstanceId(0), &h[..36], 0);
        let s = snap(inst.clone(), &trees, &cost);
        let mut p = LoadAware::new(LoadAwareConfig::default());
        // 36 cached blocks save far more than the 2 s queue: instance 0.
        let r = p.route(&s, &request(40), &mut StdRng::seed_from_u64(0));
        assert_eq!(r.route().map(|r| r.prefill), Some(InstanceId(0)));
        // A 60 s queue is not worth it.
        inst[0].queued_prefill_us = 60_000_000;
        let s = snap(inst, &trees, &cost);
        let r = p.route(&s, &request(40), &mut StdRng::seed_from_u64(0));
        assert_eq!(r.route().map(|r| r.prefill), Some(InstanceId(1)));
    }

    #[test]
    fn switches_a_prefill_instance_to_decode_only_after_persistent_imbalance() {
        let cost = CostProfile::llama2_70b_8xa800();
        let mut inst = instances(3, 2);
        for d in &mut inst[3..] {
            d.decode_running = vec![DecodeSeq::new(0, 8_000); 64];
            d.decode_waiting = 64;
        }
        inst[1].queued_prefill_us = 5;
        let trees = trees_for(&inst);
        let cfg = LoadAwareConfig { persist_us: 10_000_000, ..LoadAwareConfig::default() };
        let mut p = LoadAware::new(cfg);
        let s = snap(inst.clone(), &trees, &cost);
        let (_, dl) = p.pool_loads(&s);
        let due = (10_000_000.0 / p.pace(dl)) as Micros;
        let mut at = |now| {
            let mut s = snap(inst.clone(), &trees, &cost);
            s.now = now;
            p.rebalance(&s)
        };
        assert_eq!(at(0), None, "imbalance just started");
        assert_eq!(at(due / 2), None);
        assert_eq!(at(due - 1000), None);
        assert_eq!(at(due + 1000), Some(RoleChange { instance: InstanceId(0), from: Role::Prefill, to: Role::Decode }));
        assert_eq!(at(due + 2000), None, "the hold starts again after a change");
        assert_eq!(at(2 * due), None);
        assert!(at(2 * due + 3000).is_some(), "and the imbalance goes on");
    }

    /// The hold scales with the imbalance: a decode pool far over its watermark is met within a
    /// fraction of `persist_us`, one just over it after several.
    #[test]
    fn a_deep_imbalance_switches_sooner_than_a_shallow_one() {
        let cost = CostProfile::llama2_70b_8xh100();
        let trees_of = |inst: &Vec<InstanceSnapshot>| trees_for(inst);
        let first_switch = |waiting: u32| {
            let mut inst = instances(2, 1);
            inst[2].decode_running = vec![DecodeSeq::new(0, 500); 8];
            inst[2].decode_waiting = waiting;
            let trees = trees_of(&inst);
            let cfg = LoadAwareConfig { persist_us: 10_000_000, tbt_slo_us: 15_000, ..LoadAwareConfig::default() };
            let mut p = LoadAware::new(cfg);
            (0..2_000u64)
                .map(|t| t * 100_000)
                .find(|&now| {
                    let mut s = snap(inst.clone(), &trees, &cost);
                    s.now = now;
                    p.rebalance(&s).is_some()
                })
                .expect("a switch within 200 s")
        };
        let deep = first_switch(80); // 10 waiting per running one: load ~10
        let shallow = first_switch(6); // load ~0.75, just over 0.7
        let at_slo = first_switch(8); // load ~1
        assert!(deep <= 1_500_000, "deep: {deep} us");
        assert!(shallow >= 15_000_000, "shallow: {shallow} us");
        assert!(shallow <= 20_100_000, "never slower than persist / MIN_PACE: {shallow} us");
        assert!((9_000_000..=11_000_000).contains(&at_slo), "at its SLO, the hold: {at_slo} us");
    }

    /// An idle decode pool is idle under any TBT target: its step's floor (the weights read once)
    /// is no load, so a tight target does not put it over the low watermark.
    #[test]
    fn a_decode_step_at_its_floor_is_no_load() {
        let cost = CostProfile::llama2_70b_8xh100();
        let mut inst = instances(0, 1);
        inst[0].decode_running = vec![DecodeSeq::new(0, 10)];
        let trees = trees_for(&inst);
        let p = LoadAware::new(LoadAwareConfig { tbt_slo_us: 15_000, ..LoadAwareConfig::default() });
        let s = snap(inst.clone(), &trees, &cost);
        let lone = p.decode_load(&s, &inst[0]);
        assert!(lone < 0.05, "one short request: {lone}");
        inst[0].decode_running = vec![DecodeSeq::new(0, 4_000); 128];
        let s = snap(inst.clone(), &trees, &cost);
        assert!(p.decode_load(&s, &inst[0]) > 0.7, "a full batch of long contexts");
    }

    #[test]
    fn switches_decode_to_prefill_when_prefill_is_swamped_and_keeps_one_of_each() {
        let cost = CostProfile::llama2_70b_8xa800();
        let mut inst = instances(1, 2);
        inst[0].queued_prefill_us = 100_000_000;
        inst[1].decode_running = vec![DecodeSeq::new(0, 100)];
        let trees = trees_for(&inst);
        let mut p = LoadAware::new(LoadAwareConfig { persist_us: 0, ..LoadAwareConfig::default() });
        let s = snap(inst.clone(), &trees, &cost);
        assert_eq!(
            p.rebalance(&s),
            Some(RoleChange { instance: InstanceId(2), from: Role::Decode, to: Role::Prefill })
        );
        // With one decode instance left it cannot be given: it becomes colocated, and decodes
        // while it takes prefills too.
        let mut one = inst;
        one.pop();
        let mut p = LoadAware::new(LoadAwareConfig { persist_us: 0, ..LoadAwareConfig::default() });
        assert_eq!(
            p.rebalance(&snap(one.clone(), &trees, &cost)),
            Some(RoleChange { instance: InstanceId(1), from: Role::Decode, to: Role::Colocated })
        );
        // Colocated, it prefills too, and no single-role decode instance is left to give: the
        // prefill instance stays one (made colocated, both would interleave long prefill chunks
        // with their decode steps; 1P+1C measured better than 2C on prefill-heavy loads).
        one[1].role = Role::Colocated;
        let mut p = LoadAware::new(LoadAwareConfig { persist_us: 0, ..LoadAwareConfig::default() });
        assert_eq!(p.rebalance(&snap(one.clone(), &trees, &cost)), None);
        // Two colocated instances: nothing is left to move.
        one[0].role = Role::Colocated;
        let mut p = LoadAware::new(LoadAwareConfig { persist_us: 0, ..LoadAwareConfig::default() });
        assert_eq!(p.rebalance(&snap(one, &trees, &cost)), None);
    }

    /// A colocated instance's decodes wait for its prefill chunks: its decode load is its
    /// measured mean step over the TBT target when that is longer than the decode step; a
    /// decode instance's is its decode step.
    #[test]
    fn a_colocated_instance_loads_its_decode_pool_with_its_whole_steps() {
        let cost = CostProfile::llama2_70b_8xa800();
        let cfg = LoadAwareConfig { tbt_slo_us: 100_000, ..LoadAwareConfig::default() };
        let mut inst = instances(0, 1);
        inst[0].decode_running = vec![DecodeSeq::new(0, 1_000)];
        inst[0].mean_step_us = 300_000;
        let trees = trees_for(&inst);
        let p = LoadAware::new(cfg);
        let load = |inst: &[InstanceSnapshot]| p.decode_load(&snap(inst.to_vec(), &trees, &cost), &inst[0]);
        assert!(load(&inst) < 1.0, "a decode instance: its decode step");
        inst[0].role = Role::Colocated;
        // Its whole 300 ms steps, above the floor, over the 100 ms target above it.
        let floor = inst[0].decode_step(&cost, 1, 0) as f64;
        let expected = (300_000.0 - floor) / (100_000.0 - floor);
        assert!((load(&inst) - expected).abs() < 1e-9, "colocated: its whole steps, {}", load(&inst));
    }

    /// A colocated prefill instance hands a decode to a single-role decode instance much
    /// lighter than itself (1C+1D), never to another colocated instance (2C runs requests
    /// whole), and keeps it when the decode instance is not much lighter.
    #[test]
    fn a_colocated_instance_hands_decodes_only_to_a_much_lighter_decode_instance() {
        let cost = CostProfile::llama2_70b_8xa800();
        let busy = vec![DecodeSeq::new(0, 8_000); 64];
        let mut inst = instances(1, 1);
        inst[0].role = Role::Colocated;
        inst[0].decode_running = busy.clone();
        let trees = trees_for(&inst);
        let route = |inst: &[InstanceSnapshot]| {
            let s = snap(inst.to_vec(), &trees, &cost);
            super::least_loaded_decode(&s, &request(8), &inst[0]).map(|d| d.0)
        };
        assert_eq!(route(&inst), Some(InstanceId(1)), "1C+1D: the idle decode instance takes it");
        inst[1].decode_running = busy.clone();
        assert_eq!(route(&inst), Some(InstanceId(0)), "as loaded: it stays home");
        inst[1].decode_running.clear();
        inst[1].role = Role::Colocated;
        assert_eq!(route(&inst), Some(InstanceId(0)), "2C: never handed to another colocated instance");
    }

    /// Two instances, one of each role: the idle one becomes colocated, and from that middle
    /// state a change of load moves the other single-role instance, never back to 1P+1D's
    /// shortage.
    #[test]
    fn one_prefill_and_one_decode_instance_meet_imbalance_by_colocating() {
        let cost = CostProfile::llama2_70b_8xa800();
        let hot_decode = |inst: &mut Vec<InstanceSnapshot>, i: usize| {
            inst[i].decode_running = vec![DecodeSeq::new(0, 8_000); 64];
            inst[i].decode_waiting = 64;
        };
        let mut inst = instances(1, 1);
        hot_decode(&mut inst, 1);
        let trees = trees_for(&inst);
        let cfg = LoadAwareConfig { persist_us: 0, ..LoadAwareConfig::default() };
        let change = LoadAware::new(cfg).rebalance(&snap(inst.clone(), &trees, &cost));
        assert_eq!(change, Some(RoleChange { instance: InstanceId(0), from: Role::Prefill, to: Role::Colocated }));

        // The same imbalance lasting: the policy that made the first switch makes the second at
        // its next look, with no second hold.
        let held = LoadAwareConfig { persist_us: 10_000_000, ..cfg };
        let mut p = LoadAware::new(held);
        assert_eq!(p.rebalance(&snap(inst.clone(), &trees, &cost)), None, "the hold starts");
        let mut later = snap(inst.clone(), &trees, &cost);
        later.now += 10_000_000;
        assert_eq!(
            p.rebalance(&later),
            Some(RoleChange { instance: InstanceId(0), from: Role::Prefill, to: Role::Colocated }),
            "the hold passed"
        );
        let mut next = inst.clone();
        next[0].role = Role::Colocated;
        hot_decode(&mut next, 0);
        next[0].queued_prefill_us = held.ttft_slo_us / 2;
        let mut next_look = snap(next, &trees, &cost);
        next_look.now = later.now + 250_000;
        assert_eq!(
            p.rebalance(&next_look),
            Some(RoleChange { instance: InstanceId(1), from: Role::Decode, to: Role::Colocated })
        );

        // 1C+1D, still decode-heavy, with the colocated instance's prefill queue between the
        // watermarks (it takes every prompt between its decode steps): no single-role prefill
        // instance is left to give, so the decode instance becomes colocated too (2C), which
        // takes nothing from the prefill pool.
        let mut one_c = inst.clone();
        one_c[0].role = Role::Colocated;
        hot_decode(&mut one_c, 0);
        one_c[0].queued_prefill_us = cfg.ttft_slo_us / 2;
        let change = LoadAware::new(cfg).rebalance(&snap(one_c.clone(), &trees, &cost));
        assert_eq!(change, Some(RoleChange { instance: InstanceId(1), from: Role::Decode, to: Role::Colocated }));
        // Over the high watermark itself, the prefill pool is hot too: nothing moves.
        one_c[0].queued_prefill_us = cfg.ttft_slo_us;
        assert_eq!(LoadAware::new(cfg).rebalance(&snap(one_c, &trees, &cost)), None);

        // 1C+1D. The load turns prefill-heavy: the colocated instance prefills, so the decode
        // instance can be given, to prefill (1C+1P).
        inst[0].role = Role::Colocated;
        inst[1].decode_running.clear();
        inst[1].decode_waiting = 0;
        inst[0].queued_prefill_us = 100_000_000;
        let change = LoadAware::new(cfg).rebalance(&snap(inst.clone(), &trees, &cost));
        assert_eq!(change, Some(RoleChange { instance: InstanceId(1), from: Role::Decode, to: Role::Prefill }));

        // 1C+1P, decode-heavy again: the prefill instance becomes colocated too (2C), not a
        // decode instance (1C+1D would leave one instance to prefill every prompt).
        inst[1].role = Role::Prefill;
        inst[0].queued_prefill_us = 0;
        hot_decode(&mut inst, 0);
        let change = LoadAware::new(cfg).rebalance(&snap(inst, &trees, &cost));
        assert_eq!(change, Some(RoleChange { instance: InstanceId(1), from: Role::Prefill, to: Role::Colocated }));
    }
}
