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

use super::{Policy, PrefillPlan, least_loaded_decode, least_ttft};
use crate::snapshot::{ClusterSnapshot, Decision, RejectReason, Request};

/// Algorithm 1 with its one parameter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvCentric {
    /// `kvcache_balancing_threshold` (> 1 in practice): how many times longer the best remote
    /// prefix must be than the local one before fetching it is considered.
    pub kvcache_balancing_threshold: f64,
}

impl KvCentric {
    /// Algorithm 1's prefill side: the plan of least predicted TTFT; ties (an idle cluster, a
    /// prompt cached nowhere) are spread over the instances ([`least_ttft`]).
    pub(crate) fn choose_prefill<'s>(&self, snap: &'s ClusterSnapshot<'_>, req: &Request) -> Option<PrefillPlan<'s>> {
        let pool: Vec<_> = snap.prefill_pool().collect();
        let prefix: Vec<usize> =
            pool.iter().map(|i| snap.trees.prefix_len(i.id, &req.block_hashes, snap.now)).collect();
        // FindBestPrefixMatch(P): longest prefix, lowest id on ties.
        let (best_idx, &best) = prefix.iter().enumerate().max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(&a.0)))?;
        let holder = (pool[best_idx].id, best);
        let plans = pool.iter().zip(&prefix).map(|(inst, &local)| {
            let ratio = match (best, local) {
                (0, _) => 1.0,
                (_, 0) => f64::INFINITY,
                (b, l) => b as f64 / l as f64,
            };
            // Cache-aware prefill scheduling below the threshold (the local prefix only);
            // cache-aware and -balancing above it (fetch best − local blocks, or recompute:
            // eq. 2).
            let fetch_from = (ratio >= self.kvcache_balancing_threshold).then_some(holder);
            PrefillPlan::new(snap, req, inst, local, fetch_from)
        });
        least_ttft(plans, req)
    }
}

impl Policy for KvCentric {
    fn name(&self) -> &'static str {
        "kv-centric"
    }

    fn route(&mut self, snap: &ClusterSnapshot<'_>, req: &Request, _rng: &mut dyn RngCore) -> Decision {
        let Some(plan) = self.choose_prefill(snap, req) else {
            return Decision::Reject { reason: RejectReason::NoInstance };
        };
        match least_loaded_decode(snap, req, plan.inst) {
            Some(decode) => Decision::Route(plan.route(decode)),
            None => Decision::Reject { reason: RejectReason::NoInstance },
        }
    }
}

#[cfg(test)]
mod tests {
    use baton_kv::{BlockHash, InstanceId};
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;
    use crate::policy::testutil::{instances, request, snap, trees_for};
    use crate::{CostProfile, Reuse, Route};

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

    /// A prefix the index places on a slower tier costs its copy back, or its recomputation
    /// where that is cheaper: on the 70B profile host memory (200 GB/s) pays, a 6 GB/s disk
    /// does not.
    #[test]
    fn a_prefix_on_a_slower_tier_counts_its_copy_or_its_recomputation() {
        use baton_kv::{KvEvent, KvEventKind, Tier};
        let cost = CostProfile::llama2_70b_8xh100();
        let req = request(20);
        for (tier, expected) in [
            (
                Tier::Host,
                cost.kv_transfer_time(8 * 512, cost.host_to_device)
                    + cost.prefill_time_cached(req.prompt_tokens, 16 * 512),
            ),
            (Tier::Disk, cost.prefill_time_cached(req.prompt_tokens, 8 * 512)),
        ] {
            let inst = instances(3, 2);
            let mut trees = trees_for(&inst);
            // Instance 1 caches the prompt's first 16 blocks, the last 8 of them on `tier`.
            for b in 0..16u64 {
                let kind = KvEventKind::Stored {
                    hash: BlockHash(b + 1),
                    parent: (b > 0).then_some(BlockHash(b)),
                    tokens: Default::default(),
                    tier: if b < 8 { Tier::Device } else { tier },
                };
                trees.apply(&KvEvent { instance: InstanceId(1), seq: b, kind }).expect("in order");
            }
            let s = snap(inst, &trees, &cost);
            let r = route(&s, &req);
            assert_eq!(r.prefill, InstanceId(1), "{tier:?}");
            assert_eq!(r.estimate.ttft_us, expected, "{tier:?}");
        }
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
        assert_ne!(r.prefill, InstanceId(0), "one of the idle instances");
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
