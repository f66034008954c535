//! MemServe's prompt-tree-based policy (§6, Table 6).
//!
//! The prefill instance is the one with the longest cached prefix in the global prompt trees
//! (ties: the least queued work, then the lowest id). If an instance of any type holds more of the
//! prompt than the chosen one, the extra blocks are fetched when equation 2 says transfer beats
//! recomputation (`transfer(y_p, y_p') ≤ exec(x, y_p) − exec(x, y_p')`), and kept (MemPool's
//! `transfer_with_insert`). The policy is best effort: it does not weigh load against locality.

use rand::RngCore;

use super::{Policy, least_loaded_decode, local_route};
use crate::snapshot::{ClusterSnapshot, Decision, RejectReason, Request, Reuse};

/// Longest prefix first.
#[derive(Debug, Clone, Copy, Default)]
pub struct PromptTree;

impl Policy for PromptTree {
    fn name(&self) -> &'static str {
        "prompt-tree"
    }

    fn route(&mut self, snap: &ClusterSnapshot<'_>, req: &Request, _rng: &mut dyn RngCore) -> Decision {
        let hashes = &req.block_hashes;
        let Some((p, local)) = snap
            .prefill_pool()
            .map(|i| (i, snap.trees.prefix_len(i.id, hashes, snap.now)))
            .min_by_key(|(i, n)| (std::cmp::Reverse(*n), i.queued_prefill_us, i.id))
        else {
            return Decision::Reject { reason: RejectReason::NoInstance };
        };
        let Some(decode) = least_loaded_decode(snap, req, p) else {
            return Decision::Reject { reason: RejectReason::NoInstance };
        };
        let mut route = local_route(snap, req, p, decode, local);
        // Extra cached blocks elsewhere (any instance type)?
        if let Some(m) = snap.trees.matches(hashes, snap.now, |_| true).into_iter().find(|m| m.blocks > local) {
            let have = req.cached_tokens(local);
            let more = req.cached_tokens(m.blocks);
            let transfer = snap.cost.kv_transfer_time(more - have, snap.link(m.instance, p.id));
            let saved = snap.cost.prefill_time_cached(req.prompt_tokens, have)
                - snap.cost.prefill_time_cached(req.prompt_tokens, more);
            if transfer <= saved {
                route.reuse.push(Reuse { from: m.instance, start: local as u32, end: m.blocks as u32 });
                route.migrate = true;
                route.estimate.ttft_us = route.estimate.ttft_us - saved + transfer;
            }
        }
        Decision::Route(route)
    }
}

#[cfg(test)]
mod tests {
    use baton_kv::{BlockHash, InstanceId};
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;
    use crate::policy::testutil::{instances, request, snap, trees_for};
    use crate::{CostProfile, Role};

    #[test]
    fn longest_prefix_wins_even_when_busy() {
        let cost = CostProfile::llama2_70b_8xa800();
        let mut inst = instances(3, 1);
        inst[2].queued_prefill_us = 100_000_000;
        let mut trees = trees_for(&inst);
        let h: Vec<BlockHash> = (1..=10).map(BlockHash).collect();
        trees.predict(InstanceId(2), &h[..6], 0);
        trees.predict(InstanceId(1), &h[..2], 0);
        let s = snap(inst, &trees, &cost);
        let r = PromptTree.route(&s, &request(10), &mut StdRng::seed_from_u64(0));
        let r = r.route().expect("routed");
        assert_eq!(r.prefill, InstanceId(2));
        assert_eq!(r.reuse, vec![Reuse { from: InstanceId(2), start: 0, end: 6 }]);
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
