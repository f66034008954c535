//! FlowKV's load-aware scheduler.
//!
//! Under normal load it balances: the prefill instance minimises queue time plus predicted
//! prefill time with its cached prefix (MemServe eq. 1, `argmin_p Σ exec(x', y'_p) + exec(x, y_p)`),
//! the decode instance has the least predicted TBT. Under *persistent* computational imbalance —
//! one pool over its high watermark and the other under its low watermark for `persist_us` — it
//! moves the least-busy instance of the idle pool to the busy role ([`RoleChange`]), keeping at
//! least `min_per_role` instances in each. The imbalance timer is the policy's state; time comes
//! from the snapshot.

use rand::RngCore;
use serde::{Deserialize, Serialize};

use super::{Policy, PrefillPlan, least_loaded_decode, least_ttft};
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
    /// How long the imbalance must last before a switch (and the pause after one).
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
            persist_us: 20_000_000,
            min_per_role: 1,
        }
    }
}

/// FlowKV's policy.
#[derive(Debug, Clone)]
pub struct LoadAware {
    cfg: LoadAwareConfig,
    /// Since when the imbalance in this direction (`true`: decode overloaded) has lasted.
    imbalance: Option<(bool, Micros)>,
    last_change: Option<Micros>,
}

impl LoadAware {
    /// A policy with these settings.
    pub fn new(cfg: LoadAwareConfig) -> Self {
        Self { cfg, imbalance: None, last_change: None }
    }

    /// Load of a prefill instance (queue time over the TTFT SLO).
    pub fn prefill_load(&self, i: &InstanceSnapshot) -> f64 {
        i.queued_prefill_us as f64 / self.cfg.ttft_slo_us.max(1) as f64
    }

    /// Load of a decode instance (step time over the TBT SLO, KV occupancy, and the queue).
    pub fn decode_load(&self, snap: &ClusterSnapshot<'_>, i: &InstanceSnapshot) -> f64 {
        let step =
            i.decode_step(snap.cost, i.decode_batch(), i.decode_context()) as f64 / self.cfg.tbt_slo_us.max(1) as f64;
        let dev = i.kv[0];
        let mem = if dev.total > 0 { dev.used as f64 / dev.total as f64 } else { 0.0 };
        step.max(mem) + f64::from(i.decode_waiting) / (i.decode_batch().max(1) as f64)
    }

    /// The mean load of the accepting prefill instances and of the accepting decode instances
    /// (0 for a pool with none): what [`Policy::rebalance`] weighs against the watermarks.
    pub fn pool_loads(&self, snap: &ClusterSnapshot<'_>) -> (f64, f64) {
        let pool = |role: Role| snap.instances.iter().filter(move |i| i.accepting && i.role == role);
        (
            mean(pool(Role::Prefill).map(|i| self.prefill_load(i))),
            mean(pool(Role::Decode).map(|i| self.decode_load(snap, i))),
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
        let plans = snap
            .prefill_pool()
            .map(|i| PrefillPlan::new(snap, req, i, snap.trees.prefix_len(i.id, &req.block_hashes, snap.now), None));
        let Some(plan) = least_ttft(plans, req) else {
            return Decision::Reject { reason: RejectReason::NoInstance };
        };
        match least_loaded_decode(snap, req, plan.inst) {
            Some(d) => Decision::Route(plan.route(d)),
            None => Decision::Reject { reason: RejectReason::NoInstance },
        }
    }

    fn rebalance(&mut self, snap: &ClusterSnapshot<'_>) -> Option<RoleChange> {
        let prefills: Vec<&InstanceSnapshot> =
            snap.instances.iter().filter(|i| i.accepting && i.role == Role::Prefill).collect();
        let decodes: Vec<&InstanceSnapshot> =
            snap.instances.iter().filter(|i| i.accepting && i.role == Role::Decode).collect();
        let (pl, dl) = self.pool_loads(snap);
        let direction = if dl > self.cfg.high && pl < self.cfg.low {
            Some(true)
        } else if pl > self.cfg.high && dl < self.cfg.low {
            Some(false)
        } else {
            None
        };
        let Some(decode_hot) = direction else {
            self.imbalance = None;
            return None;
        };
        let since = match self.imbalance {
            Some((d, t)) if d == decode_hot => t,
            _ => {
                self.imbalance = Some((decode_hot, snap.now));
                snap.now
            }
        };
        let calm = self.last_change.is_none_or(|t| snap.now >= t + self.cfg.persist_us);
        if snap.now < since + self.cfg.persist_us || !calm {
            return None;
        }
        let change = if decode_hot {
            if prefills.len() <= self.cfg.min_per_role {
                return None;
            }
            let i = prefills.iter().min_by_key(|i| (i.queued_prefill_us, i.id))?;
            RoleChange { instance: i.id, from: Role::Prefill, to: Role::Decode }
        } else {
            if decodes.len() <= self.cfg.min_per_role {
                return None;
            }
            let i = decodes.iter().min_by_key(|i| (i.decode_batch() + u64::from(i.decode_waiting), i.id))?;
            RoleChange { instance: i.id, from: Role::Decode, to: Role::Prefill }
        };
        self.last_change = Some(snap.now);
        self.imbalance = None;
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
            d.decode_running = vec![DecodeSeq { started_at: 0, context: 8_000 }; 64];
            d.decode_waiting = 64;
        }
        inst[1].queued_prefill_us = 5;
        let trees = trees_for(&inst);
        let cfg = LoadAwareConfig { persist_us: 10, ..LoadAwareConfig::default() };
        let mut p = LoadAware::new(cfg);
        let mut at = |now| {
            let mut s = snap(inst.clone(), &trees, &cost);
            s.now = now;
            p.rebalance(&s)
        };
        assert_eq!(at(0), None, "imbalance just started");
        assert_eq!(at(5), None);
        assert_eq!(at(10), Some(RoleChange { instance: InstanceId(0), from: Role::Prefill, to: Role::Decode }));
        assert_eq!(at(12), None, "pause after a change");
    }

    #[test]
    fn switches_decode_to_prefill_when_prefill_is_swamped_and_keeps_one_of_each() {
        let cost = CostProfile::llama2_70b_8xa800();
        let mut inst = instances(1, 2);
        inst[0].queued_prefill_us = 100_000_000;
        inst[1].decode_running = vec![DecodeSeq { started_at: 0, context: 100 }];
        let trees = trees_for(&inst);
        let mut p = LoadAware::new(LoadAwareConfig { persist_us: 0, ..LoadAwareConfig::default() });
        let s = snap(inst.clone(), &trees, &cost);
        assert_eq!(
            p.rebalance(&s),
            Some(RoleChange { instance: InstanceId(2), from: Role::Decode, to: Role::Prefill })
        );
        // With one decode instance left there is nothing to give.
        let mut one = inst;
        one.pop();
        let mut p = LoadAware::new(LoadAwareConfig { persist_us: 0, ..LoadAwareConfig::default() });
        assert_eq!(p.rebalance(&snap(one, &trees, &cost)), None);
    }
}
