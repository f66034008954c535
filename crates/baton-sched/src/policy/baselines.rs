//! The baselines: round-robin, random, least-load, session affinity (MemServe Table 6's first
//! two rows).

use std::collections::BTreeMap;

use baton_kv::InstanceId;
use rand::{Rng, RngCore};

use super::{Policy, PrefillPlan, least_loaded_decode, least_ttft, local_route, route_to, spread};
use crate::snapshot::{ClusterSnapshot, Decision, InstanceSnapshot, RejectReason, Request, SessionId};

/// Each pool in turn. The cursors are the policy's only state.
#[derive(Debug, Clone, Default)]
pub struct RoundRobin {
    next_prefill: usize,
    next_decode: usize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round-robin"
    }

    fn route(&mut self, snap: &ClusterSnapshot<'_>, req: &Request, _rng: &mut dyn RngCore) -> Decision {
        let prefills: Vec<&InstanceSnapshot> = snap.prefill_pool().collect();
        let decodes: Vec<&InstanceSnapshot> = snap.decode_pool().collect();
        if prefills.is_empty() {
            return Decision::Reject { reason: RejectReason::NoInstance };
        }
        let p = prefills[self.next_prefill % prefills.len()];
        self.next_prefill = self.next_prefill.wrapping_add(1);
        let decodes: Vec<&InstanceSnapshot> = decodes.into_iter().filter(|d| d.shares_kv(p)).collect();
        let d = if p.role == crate::Role::Colocated || decodes.is_empty() {
            p
        } else {
            let d = decodes[self.next_decode % decodes.len()];
            self.next_decode = self.next_decode.wrapping_add(1);
            d
        };
        if !d.role.decodes() {
            return Decision::Reject { reason: RejectReason::NoInstance };
        }
        let local = snap.trees.prefix_len(p.id, &req.block_hashes, snap.now);
        Decision::Route(local_route(snap, req, p, (d.id, super::tbt_with(snap, d, req)), local))
    }
}

/// Uniformly at random (the rng is the caller's).
#[derive(Debug, Clone, Copy, Default)]
pub struct RandomPolicy;

impl Policy for RandomPolicy {
    fn name(&self) -> &'static str {
        "random"
    }

    fn route(&mut self, snap: &ClusterSnapshot<'_>, req: &Request, rng: &mut dyn RngCore) -> Decision {
        let prefills: Vec<&InstanceSnapshot> = snap.prefill_pool().collect();
        let decodes: Vec<&InstanceSnapshot> = snap.decode_pool().collect();
        if prefills.is_empty() {
            return Decision::Reject { reason: RejectReason::NoInstance };
        }
        let p = prefills[rng.random_range(0..prefills.len())];
        let decodes: Vec<&InstanceSnapshot> = decodes.into_iter().filter(|d| d.shares_kv(p)).collect();
        let d = if p.role == crate::Role::Colocated || decodes.is_empty() {
            p
        } else {
            decodes[rng.random_range(0..decodes.len())]
        };
        if !d.role.decodes() {
            return Decision::Reject { reason: RejectReason::NoInstance };
        }
        let local = snap.trees.prefix_len(p.id, &req.block_hashes, snap.now);
        Decision::Route(local_route(snap, req, p, (d.id, super::tbt_with(snap, d, req)), local))
    }
}

/// The prefill instance with the least queued work (locality-unaware), the decode instance with
/// the least predicted TBT.
#[derive(Debug, Clone, Copy, Default)]
pub struct LeastLoad;

/// The prefill instance with the shortest queue; ties spread by [`spread`].
pub(crate) fn least_queued<'s>(snap: &'s ClusterSnapshot<'_>, req: &Request) -> Option<&'s InstanceSnapshot> {
    snap.prefill_pool().min_by_key(|i| (i.queued_prefill_us, i.prefill_queue_len, spread(req, i.id)))
}

impl Policy for LeastLoad {
    fn name(&self) -> &'static str {
        "least-load"
    }

    fn route(&mut self, snap: &ClusterSnapshot<'_>, req: &Request, _rng: &mut dyn RngCore) -> Decision {
        match least_queued(snap, req) {
            Some(p) => route_to(snap, req, p),
            None => Decision::Reject { reason: RejectReason::NoInstance },
        }
    }
}

/// A session sticks to a prefill instance (the least loaded when it was first seen), as long as
/// no other instance would serve it sooner: if the session's instance's predicted TTFT (its queue
/// plus the prefill of what it does not cache) exceeds another's, the request goes to the one
/// with the least and the session follows it. Requests without a session go to the least loaded
/// instance. Enables intra-session context caching only (no fetching between instances).
///
/// The bound is what keeps a session's cache from being worth more than the queue it costs
/// (issue #18): stickiness alone lets one instance collect busy sessions while others idle.
#[derive(Debug, Clone, Default)]
pub struct SessionAffinity {
    sessions: BTreeMap<SessionId, InstanceId>,
}

impl Policy for SessionAffinity {
    fn name(&self) -> &'static str {
        "session-affinity"
    }

    fn route(&mut self, snap: &ClusterSnapshot<'_>, req: &Request, _rng: &mut dyn RngCore) -> Decision {
        let plan = |i| PrefillPlan::new(snap, req, i, snap.trees.prefix_len(i.id, &req.block_hashes, snap.now), None);
        let sticky =
            req.session.and_then(|s| self.sessions.get(&s)).and_then(|&id| snap.prefill_pool().find(|i| i.id == id));
        let p = match sticky {
            Some(home) => {
                let home = plan(home);
                let best = least_ttft(snap.prefill_pool().map(plan), req);
                best.filter(|b| b.ttft < home.ttft).unwrap_or(home)
            }
            None => match least_queued(snap, req) {
                Some(i) => plan(i),
                None => return Decision::Reject { reason: RejectReason::NoInstance },
            },
        };
        if let Some(s) = req.session {
            self.sessions.insert(s, p.inst.id);
        }
        match least_loaded_decode(snap, req, p.inst) {
            Some(d) => Decision::Route(p.route(d)),
            None => Decision::Reject { reason: RejectReason::NoInstance },
        }
    }
}

#[cfg(test)]
mod tests {
    use baton_kv::InstanceId;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;
    use crate::CostProfile;
    use crate::policy::testutil::{instances, request, snap, trees_for};

    fn ids(d: &Decision) -> (u32, u32) {
        let r = d.route().expect("routed");
        (r.prefill.0, r.decode.0)
    }

    #[test]
    fn round_robin_cycles_both_pools() {
        let cost = CostProfile::llama2_70b_8xa800();
        let inst = instances(2, 3);
        let trees = trees_for(&inst);
        let s = snap(inst, &trees, &cost);
        let mut rr = RoundRobin::default();
        let mut rng = StdRng::seed_from_u64(0);
        let got: Vec<_> = (0..4).map(|_| ids(&rr.route(&s, &request(2), &mut rng))).collect();
        assert_eq!(got, vec![(0, 2), (1, 3), (0, 4), (1, 2)]);
    }

    #[test]
    fn random_is_deterministic_for_a_seed_and_covers_the_pool() {
        let cost = CostProfile::llama2_70b_8xa800();
        let inst = instances(4, 4);
        let trees = trees_for(&inst);
        let s = snap(inst, &trees, &cost);
        let run = |seed| {
            let mut rng = StdRng::seed_from_u64(seed);
            (0..64).map(|_| ids(&RandomPolicy.route(&s, &request(2), &mut rng))).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        let prefills: std::collections::BTreeSet<u32> = run(7).iter().map(|x| x.0).collect();
        assert_eq!(prefills.len(), 4);
        assert!(run(7).iter().all(|&(p, d)| p < 4 && (4..8).contains(&d)));
    }

    #[test]
    fn least_load_picks_the_shortest_queue_and_lightest_decode() {
        let cost = CostProfile::llama2_70b_8xa800();
        let mut inst = instances(3, 2);
        inst[0].queued_prefill_us = 5_000_000;
        inst[1].queued_prefill_us = 1_000_000;
        inst[2].queued_prefill_us = 3_000_000;
        inst[3].decode_running = vec![crate::DecodeSeq::new(0, 50_000)];
        let trees = trees_for(&inst);
        let s = snap(inst, &trees, &cost);
        let d = LeastLoad.route(&s, &request(4), &mut StdRng::seed_from_u64(0));
        assert_eq!(ids(&d), (1, 4));
        let r = d.route().expect("routed");
        assert_eq!(r.estimate.ttft_us, 1_000_000 + cost.prefill_time(2048, 0.0));
        // Nothing to prefill on: a reason, not a panic.
        let no_prefill = snap(instances(0, 2), &trees, &cost);
        assert_eq!(
            LeastLoad.route(&no_prefill, &request(1), &mut StdRng::seed_from_u64(0)),
            Decision::Reject { reason: RejectReason::NoInstance }
        );
    }

    #[test]
    fn session_affinity_sticks_while_its_cache_is_worth_its_queue() {
        let cost = CostProfile::llama2_70b_8xa800();
        let mut inst = instances(2, 1);
        inst[0].queued_prefill_us = 10;
        let mut trees = trees_for(&inst);
        let mut policy = SessionAffinity::default();
        let mut rng = StdRng::seed_from_u64(0);
        let mut req = request(20);
        req.session = Some(SessionId(9));
        let s = snap(inst.clone(), &trees, &cost);
        assert_eq!(ids(&policy.route(&s, &req, &mut rng)).0, 1, "first sight: the least loaded");
        // Instance 1 now caches 16 blocks of the session's history.
        trees.predict(InstanceId(1), &req.block_hashes[..16], 0);
        let saves = cost.prefill_time(req.prompt_tokens, 0.0) - cost.prefill_time_cached(req.prompt_tokens, 16 * 512);
        // It is the busier one, by no more than its cache saves: the session stays.
        inst[1].queued_prefill_us = 10 + saves;
        let s = snap(inst.clone(), &trees, &cost);
        let d = policy.route(&s, &req, &mut rng);
        assert_eq!(ids(&d).0, 1);
        assert_eq!(d.route().map(|r| r.reused_blocks()), Some(16));
        // A request without a session goes to the least loaded.
        assert_eq!(ids(&policy.route(&s, &request(1), &mut rng)).0, 0);
        // One microsecond more queue than the cache saves: the session moves, and stays moved.
        inst[1].queued_prefill_us = 11 + saves;
        let s = snap(inst.clone(), &trees, &cost);
        assert_eq!(ids(&policy.route(&s, &req, &mut rng)).0, 0);
        // Instance 0 now caches the whole conversation; instance 1 is a little less busy.
        trees.predict(InstanceId(0), &req.block_hashes, 0);
        inst[1].queued_prefill_us = 0;
        inst[0].queued_prefill_us = 20;
        let s = snap(inst.clone(), &trees, &cost);
        assert_eq!(ids(&policy.route(&s, &req, &mut rng)).0, 0, "sticks to its new instance");
    }

    #[test]
    fn session_affinity_moves_when_the_instance_leaves() {
        let cost = CostProfile::llama2_70b_8xa800();
        let mut inst = instances(2, 1);
        inst[0].queued_prefill_us = 10;
        let trees = trees_for(&inst);
        let mut policy = SessionAffinity::default();
        let mut rng = StdRng::seed_from_u64(0);
        let mut req = request(1);
        req.session = Some(SessionId(9));
        assert_eq!(ids(&policy.route(&snap(inst.clone(), &trees, &cost), &req, &mut rng)).0, 1);
        inst[1].accepting = false;
        assert_eq!(ids(&policy.route(&snap(inst, &trees, &cost), &req, &mut rng)).0, 0);
    }
}
