//! MemServe's prompt-tree-based policy (§6, Table 6), bounded by load.
//!
//! MemServe sends a request to the instance with the longest cached prefix in the global prompt
//! trees; if an instance of any type (MemServe caches at decode instances too) holds more of the
//! prompt, the extra blocks are fetched when equation 2 says transfer beats recomputation
//! (`transfer(y_p, y_p') ≤ exec(x, y_p) − exec(x, y_p')`), and kept (MemPool's
//! `transfer_with_insert`).
//!
//! Taken alone that rule sends every request of a popular prefix to the one instance holding it
//! and queues them there without bound (issue #18). So every prefill instance is costed as a
//! [`PrefillPlan`]: its queue, plus the transfer of the blocks it would fetch from the longest
//! holder (eq. 2), plus the prefill of the rest; the least predicted TTFT wins, ties going to the
//! longest local prefix, then the shortest queue, then the lowest id. When loads are comparable
//! the longest prefix still wins, since it needs neither transfer nor recomputation; when its
//! queue costs more than the hit saves, another instance fetches the prefix (and keeps it, so
//! the hot prefix spreads) or recomputes it.

use std::cmp::Reverse;

use rand::RngCore;

use super::{Policy, PrefillPlan, least_loaded_decode, spread};
use crate::snapshot::{ClusterSnapshot, Decision, RejectReason, Request};

/// Longest prefix first, unless its queue costs more than it saves.
#[derive(Debug, Clone, Copy, Default)]
pub struct PromptTree;

impl Policy for PromptTree {
    fn name(&self) -> &'static str {
        "prompt-tree"
    }

    fn route(&mut self, snap: &ClusterSnapshot<'_>, req: &Request, _rng: &mut dyn RngCore) -> Decision {
        let hashes = &req.block_hashes;
        // The instance of any type holding the longest prefix (lowest id on ties).
        let holder = snap.trees.matches(hashes, snap.now, |_| true).first().map(|m| (m.instance, m.blocks));
        let Some(plan) = snap
            .prefill_pool()
            .map(|i| PrefillPlan::new(snap, req, i, snap.trees.prefix_len(i.id, hashes, snap.now), holder))
            .min_by_key(|p| (p.ttft, Reverse(p.local), p.inst.queued_prefill_us, spread(req, p.inst.id)))
        else {
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
    use crate::{CostProfile, Reuse, Role};

    #[test]
    fn longest_prefix_wins_while_its_queue_costs_less_than_it_saves() {
        let cost = CostProfile::llama2_70b_8xa800();
        let mut inst = instances(3, 1);
        let mut trees = trees_for(&inst);
        let h: Vec<BlockHash> = (1..=10).map(BlockHash).collect();
        trees.predict(InstanceId(2), &h[..6], 0);
        trees.predict(InstanceId(1), &h[..2], 0);
        let req = request(10);
        // Instance 2 is busier, but by less than a transfer of its six blocks takes.
        inst[2].queued_prefill_us = 1_000;
        let s = snap(inst.clone(), &trees, &cost);
        let r = PromptTree.route(&s, &req, &mut StdRng::seed_from_u64(0));
        let r = r.route().expect("routed");
        assert_eq!(r.prefill, InstanceId(2));
        assert_eq!(r.reuse, vec![Reuse { from: InstanceId(2), start: 0, end: 6 }]);
        assert!(!r.migrate);
        assert_eq!(r.estimate.ttft_us, 1_000 + cost.prefill_time_cached(req.prompt_tokens, 6 * 512));
    }

    #[test]
    fn a_hot_prefix_behind_a_long_queue_is_fetched_by_an_idle_instance() {
        // Issue #18: MemServe's rule alone would queue this request behind instance 2's 100 s.
        let cost = CostProfile::llama2_70b_8xa800();
        let mut inst = instances(3, 1);
        inst[2].queued_prefill_us = 100_000_000;
        inst[1].queued_prefill_us = 5_000;
        let mut trees = trees_for(&inst);
        let h: Vec<BlockHash> = (1..=10).map(BlockHash).collect();
        trees.predict(InstanceId(2), &h[..6], 0);
        trees.predict(InstanceId(1), &h[..2], 0);
        let s = snap(inst, &trees, &cost);
        let req = request(10);
        let r = PromptTree.route(&s, &req, &mut StdRng::seed_from_u64(0));
        let r = r.route().expect("routed");
        // Instance 0 fetches all six blocks; instance 1 would fetch only four but waits 5 ms.
        assert_eq!(r.prefill, InstanceId(0));
        assert_eq!(r.reuse, vec![Reuse { from: InstanceId(2), start: 0, end: 6 }]);
        assert!(r.migrate, "the idle instance keeps a replica of the hot prefix");
        let t_transfer = cost.kv_transfer_time(6 * 512, cost.network);
        assert_eq!(r.estimate.ttft_us, t_transfer + cost.prefill_time_cached(req.prompt_tokens, 6 * 512));
    }

    #[test]
    fn a_prefix_not_worth_its_transfer_is_recomputed_where_the_queue_is_shortest() {
        // Over a 100 MB/s link the 6 blocks (1 GB of KV) take 10 s to move: recompute them.
        let cost = CostProfile::llama2_70b_8xa800();
        let mut inst = instances(3, 1);
        inst[2].queued_prefill_us = 100_000_000;
        inst[0].queued_prefill_us = 7;
        for i in &mut inst {
            i.nic_bytes_per_s = 100_000_000;
        }
        let mut trees = trees_for(&inst);
        let h: Vec<BlockHash> = (1..=10).map(BlockHash).collect();
        trees.predict(InstanceId(2), &h[..6], 0);
        let s = snap(inst, &trees, &cost);
        let req = request(10);
        let r = PromptTree.route(&s, &req, &mut StdRng::seed_from_u64(0));
        let r = r.route().expect("routed");
        assert_eq!(r.prefill, InstanceId(1));
        assert!(r.reuse.is_empty() && !r.migrate);
        assert_eq!(r.estimate.ttft_us, cost.prefill_time(req.prompt_tokens, 0.0));
    }

    #[test]
    fn ties_go_to_the_least_loaded_and_extra_blocks_on_a_decode_instance_are_fetched() {
        let cost = CostProfile::llama2_70b_8xa800();
        let mut inst = instances(2, 1);
        inst[0].queued_prefill_us = 10;
        let mut trees = trees_for(&inst);
        let h: Vec<BlockHash> = (1..=20).map(BlockHash).collect();
        // The decode instance kept the whole conversation (MemServe caches at D too).
        trees.set_role(InstanceId(2), Role::Decode);
        trees.predict(InstanceId(2), &h[..16], 0);
        let s = snap(inst, &trees, &cost);
        let r = PromptTree.route(&s, &request(20), &mut StdRng::seed_from_u64(0));
        let r = r.route().expect("routed");
        assert_eq!(r.prefill, InstanceId(1));
        assert_eq!(r.reuse, vec![Reuse { from: InstanceId(2), start: 0, end: 16 }]);
        assert!(r.migrate);
    }
}
