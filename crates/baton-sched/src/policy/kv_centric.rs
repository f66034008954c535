//! Mooncake's KVCache-centric scheduling (Algorithm 1, §5.1–§5.2).
//!
//! For every prefill instance the predicted TTFT is its queue time plus the prefill time given the
//! prefix it can reuse:
//!
//! - **cache-aware** branch (`best_prefix_len / prefix_len < kvcache_balancing_threshold`): reuse
//!   the local prefix only;
//! - **cache-aware and -balancing** branch (otherwise): fetch the blocks between the local prefix
//!   and the best instance's prefix from the best instance, if that pays — MemServe's equation 2,
//!   `transfer(y_p, y_p') ≤ exec(x, y_p) − exec(x, y_p')` — else recompute them.
//!
//! The instance with the least TTFT wins; the decode instance is the one with the least predicted
//! TBT. When the winner fetches remote blocks, it keeps them (line 30–31: hot-spot migration), so
//! hot prefixes replicate to lightly loaded instances. Line 27's SLO check is the admission
//! stage's job ([`crate::Scheduler`]); the route carries the predicted TTFT and TBT it needs.

use rand::RngCore;

use super::{Policy, least_loaded_decode};
use crate::Micros;
use crate::snapshot::{ClusterSnapshot, Decision, Estimate, RejectReason, Request, Reuse, Route};

/// Algorithm 1 with its one parameter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvCentric {
    /// `kvcache_balancing_threshold` (> 1 in practice): how many times longer the best remote
    /// prefix must be than the local one before fetching it is considered.
    pub kvcache_balancing_threshold: f64,
}

/// What Algorithm 1 chose for the prefill side (exposed for tests and tracing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PrefillChoice {
    pub(crate) index: usize,
    pub(crate) local: usize,
    pub(crate) fetched_to: Option<usize>,
    pub(crate) ttft: Micros,
}

impl KvCentric {
    pub(crate) fn choose_prefill(&self, snap: &ClusterSnapshot<'_>, req: &Request) -> Option<PrefillChoice> {
        let pool: Vec<_> = snap.prefill_pool().collect();
        let prefix: Vec<usize> =
            pool.iter().map(|i| snap.trees.prefix_len(i.id, &req.block_hashes, snap.now)).collect();
        // FindBestPrefixMatch(P): longest prefix, lowest id on ties.
        let (best_idx, &best) = prefix.iter().enumerate().max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(&a.0)))?;
        let best_id = pool[best_idx].id;
        let mut choice: Option<PrefillChoice> = None;
        for (i, inst) in pool.iter().enumerate() {
            let local = prefix[i];
            let t_queue = inst.queued_prefill_us;
            let ratio = match (best, local) {
                (0, _) => 1.0,
                (_, 0) => f64::INFINITY,
                (b, l) => b as f64 / l as f64,
            };
            let t_local = t_queue + snap.cost.prefill_time_cached(req.prompt_tokens, req.cached_tokens(local));
            let (ttft, fetched_to) = if ratio < self.kvcache_balancing_threshold {
                // Cache-aware prefill scheduling.
                (t_local, None)
            } else {
                // Cache-aware and -balancing: transfer best − local blocks, or recompute (eq. 2).
                let transfer_tokens = req.cached_tokens(best) - req.cached_tokens(local);
                let t_transfer = snap.cost.kv_transfer_time(transfer_tokens, snap.link(best_id, inst.id));
                let t_remote =
                    t_transfer + t_queue + snap.cost.prefill_time_cached(req.prompt_tokens, req.cached_tokens(best));
                if t_remote <= t_local { (t_remote, Some(best)) } else { (t_local, None) }
            };
            if choice.is_none_or(|c| ttft < c.ttft) {
                choice = Some(PrefillChoice { index: i, local, fetched_to, ttft });
            }
        }
        choice
    }
}

impl Policy for KvCentric {
    fn name(&self) -> &'static str {
        "kv-centric"
    }

    fn route(&mut self, snap: &ClusterSnapshot<'_>, req: &Request, _rng: &mut dyn RngCore) -> Decision {
        let Some(c) = self.choose_prefill(snap, req) else {
            return Decision::Reject { reason: RejectReason::NoInstance };
        };
        let pool: Vec<_> = snap.prefill_pool().collect();
        let p = pool[c.index];
        let Some((decode, tbt)) = least_loaded_decode(snap, req, p) else {
            return Decision::Reject { reason: RejectReason::NoInstance };
        };
        let mut reuse = Vec::new();
        if c.local > 0 {
            reuse.push(Reuse { from: p.id, start: 0, end: c.local as u32 });
        }
        if let Some(to) = c.fetched_to {
            // The best instance: the first with that many blocks (same tie rule as above).
            let from = pool
                .iter()
                .find(|i| snap.trees.prefix_len(i.id, &req.block_hashes, snap.now) == to)
                .map_or(p.id, |i| i.id);
            reuse.push(Reuse { from, start: c.local as u32, end: to as u32 });
        }
        Decision::Route(Route {
            prefill: p.id,
            decode,
            reuse,
            migrate: c.fetched_to.is_some(),
            estimate: Estimate { ttft_us: c.ttft, tbt_us: tbt },
        })
    }
}

#[cfg(test)]
mod tests {
    use baton_kv::{BlockHash, InstanceId};
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;
    use crate::CostProfile;
    use crate::policy::testutil::{instances, request, snap, trees_for};

    fn cache(trees: &mut crate::GlobalPromptTrees, inst: u32, blocks: u64) {
        let hashes: Vec<BlockHash> = (1..=blocks).map(BlockHash).collect();
        trees.predict(InstanceId(inst), &hashes, 0);
    }

    fn policy() -> KvCentric {
        KvCentric { kvcache_balancing_threshold: 1.5 }
    }

    fn route(s: &ClusterSnapshot<'_>, req: &Request) -> Route {
        policy().route(s, req, &mut StdRng::seed_from_u64(0)).route().cloned().expect("routed")
    }

    #[test]
    fn cache_aware_branch_prefers_the_longest_prefix_when_queues_are_equal() {
        let cost = CostProfile::llama2_70b_8xa800();
        let inst = instances(3, 2);
        let mut trees = trees_for(&inst);
        cache(&mut trees, 1, 16);
        cache(&mut trees, 2, 12);
        let s = snap(inst, &trees, &cost);
        let req = request(20);
        let r = route(&s, &req);
        assert_eq!(r.prefill, InstanceId(1));
        assert_eq!(r.reuse, vec![Reuse { from: InstanceId(1), start: 0, end: 16 }]);
        assert!(!r.migrate);
        assert_eq!(r.estimate.ttft_us, cost.prefill_time_cached(req.prompt_tokens, 16 * 512));
    }

    #[test]
    fn cache_aware_branch_trades_prefix_for_queue_time() {
        // Instance 1 holds 16 blocks but is busy; instance 2 holds 12 (ratio 16/12 < 1.5: the
        // cache-aware branch, no transfer) and is idle: its TTFT is lower. (Instance 0, holding
        // nothing, would fetch all 16 blocks: it is busy too.)
        let cost = CostProfile::llama2_70b_8xa800();
        let mut inst = instances(3, 2);
        inst[0].queued_prefill_us = 30_000_000;
        inst[1].queued_prefill_us = 30_000_000;
        let mut trees = trees_for(&inst);
        cache(&mut trees, 1, 16);
        cache(&mut trees, 2, 12);
        let s = snap(inst, &trees, &cost);
        let r = route(&s, &request(20));
        assert_eq!(r.prefill, InstanceId(2));
        assert_eq!(r.reuse, vec![Reuse { from: InstanceId(2), start: 0, end: 12 }]);
        assert!(!r.migrate);
    }

    #[test]
    fn balancing_branch_fetches_from_the_best_instance_and_migrates() {
        // Instance 0 holds 40 blocks but is swamped; the others hold nothing (ratio ∞ ≥ 1.5): an
        // idle instance fetching 40 blocks over 100 GB/s beats recomputing them.
        let cost = CostProfile::llama2_70b_8xa800();
        let mut inst = instances(3, 2);
        inst[0].queued_prefill_us = 60_000_000;
        inst[1].queued_prefill_us = 1_000;
        let mut trees = trees_for(&inst);
        cache(&mut trees, 0, 40);
        let s = snap(inst, &trees, &cost);
        let req = request(44);
        let r = route(&s, &req);
        assert_eq!(r.prefill, InstanceId(2));
        assert_eq!(r.reuse, vec![Reuse { from: InstanceId(0), start: 0, end: 40 }]);
        assert!(r.migrate, "hot-spot migration: the fetched blocks are kept");
        let t_transfer = cost.kv_transfer_time(40 * 512, cost.network);
        assert_eq!(r.estimate.ttft_us, t_transfer + cost.prefill_time_cached(req.prompt_tokens, 40 * 512));
    }

    #[test]
    fn balancing_branch_recomputes_when_the_link_is_too_slow() {
        // Same as above over a 1 GB/s link: 40 blocks of KV (6.7 GB) take longer to move than to
        // recompute (MemServe eq. 2 false), so the idle instance prefills from scratch.
        let cost = CostProfile::llama2_70b_8xa800();
        let mut inst = instances(3, 2);
        inst[0].queued_prefill_us = 60_000_000;
        for i in &mut inst {
            i.nic_bytes_per_s = 1_000_000_000;
        }
        let mut trees = trees_for(&inst);
        cache(&mut trees, 0, 40);
        let s = snap(inst, &trees, &cost);
        let req = request(44);
        let r = route(&s, &req);
        assert_eq!(r.prefill, InstanceId(1));
        assert!(r.reuse.is_empty() && !r.migrate);
        assert_eq!(r.estimate.ttft_us, cost.prefill_time(req.prompt_tokens, 0.0));
    }

    #[test]
    fn balancing_branch_extends_a_short_local_prefix() {
        // Instance 1 holds 4 blocks, instance 0 holds 40 and is busy: 40/4 ≥ 1.5, so instance 1
        // fetches blocks 4..40 from instance 0 and reuses its own 0..4.
        let cost = CostProfile::llama2_70b_8xa800();
        let mut inst = instances(2, 1);
        inst[0].queued_prefill_us = 60_000_000;
        let mut trees = trees_for(&inst);
        cache(&mut trees, 0, 40);
        cache(&mut trees, 1, 4);
        let s = snap(inst, &trees, &cost);
        let r = route(&s, &request(44));
        assert_eq!(r.prefill, InstanceId(1));
        assert_eq!(
            r.reuse,
            vec![Reuse { from: InstanceId(1), start: 0, end: 4 }, Reuse { from: InstanceId(0), start: 4, end: 40 }]
        );
        assert!(r.migrate);
        assert_eq!(r.decode, InstanceId(2));
    }

    #[test]
    fn no_cache_anywhere_is_least_queue() {
        let cost = CostProfile::llama2_70b_8xa800();
        let mut inst = instances(3, 1);
        inst[0].queued_prefill_us = 3;
        inst[1].queued_prefill_us = 2;
        inst[2].queued_prefill_us = 5;
        let trees = trees_for(&inst);
        let s = snap(inst, &trees, &cost);
        assert_eq!(route(&s, &request(8)).prefill, InstanceId(1));
    }
}
