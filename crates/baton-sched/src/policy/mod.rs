//! Global routing policies: `route(&snapshot, &request, rng) -> Decision`.
//!
//! Every policy is a small struct implementing [`Policy`]. State a policy needs across requests
//! (the round-robin cursor, session stickiness, FlowKV's imbalance timer) lives in that struct and
//! nowhere else; time, load, cache contents and randomness come in as arguments, so the conductor
//! and the simulator get the same decision from the same inputs.
//!
//! | policy | prefill instance | decode instance |
//! |---|---|---|
//! | [`RoundRobin`] | next in turn | next in turn |
//! | [`RandomPolicy`] | uniform | uniform |
//! | [`LeastLoad`] | least queued prefill time | least predicted TBT |
//! | [`SessionAffinity`] | the session's instance (least load on first sight) unless another's predicted TTFT is lower | least predicted TBT |
//! | [`PromptTree`] | least predicted TTFT (queue + eq. 2 fetch + prefill); ties: longest cached prefix (MemServe Table 6), then least load | least predicted TBT |
//! | [`KvCentric`] | Mooncake Algorithm 1 (cache-aware / cache-balancing, hot-spot migration) | least predicted TBT |
//! | [`LoadAware`] | argmin queue + exec(x, y) (MemServe eq. 1), role switching under persistent imbalance (FlowKV) | least predicted TBT |

mod baselines;
mod kv_centric;
mod load_aware;
mod prompt_tree;

use std::str::FromStr;

use baton_kv::InstanceId;
use rand::RngCore;
use serde::{Deserialize, Serialize};

pub use baselines::{LeastLoad, RandomPolicy, RoundRobin, SessionAffinity};
pub use kv_centric::KvCentric;
pub use load_aware::{LoadAware, LoadAwareConfig, MAX_PACE, MIN_PACE};
pub use prompt_tree::PromptTree;

use crate::snapshot::{ClusterSnapshot, Decision, Estimate, InstanceSnapshot, RejectReason, Request, Reuse, Route};
use crate::{Micros, RoleChange};

/// A global routing policy.
pub trait Policy: Send {
    /// Its name (as on the command line).
    fn name(&self) -> &'static str;

    /// Routes one request. Must not reject for load: admission does that (a policy rejects only
    /// when no instance can take the request at all).
    fn route(&mut self, snap: &ClusterSnapshot<'_>, req: &Request, rng: &mut dyn RngCore) -> Decision;

    /// Called periodically: a role change the cluster should make now, if any.
    fn rebalance(&mut self, _snap: &ClusterSnapshot<'_>) -> Option<RoleChange> {
        None
    }
}

/// The policies by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyKind {
    /// [`RoundRobin`].
    RoundRobin,
    /// [`RandomPolicy`].
    Random,
    /// [`LeastLoad`].
    LeastLoad,
    /// [`SessionAffinity`].
    SessionAffinity,
    /// [`PromptTree`].
    PromptTree,
    /// [`KvCentric`].
    KvCentric,
    /// [`LoadAware`].
    LoadAware,
}

impl PolicyKind {
    /// Every policy, in the order above.
    pub const ALL: [PolicyKind; 7] = [
        PolicyKind::RoundRobin,
        PolicyKind::Random,
        PolicyKind::LeastLoad,
        PolicyKind::SessionAffinity,
        PolicyKind::PromptTree,
        PolicyKind::KvCentric,
        PolicyKind::LoadAware,
    ];

    /// Its command-line name.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round-robin",
            PolicyKind::Random => "random",
            PolicyKind::LeastLoad => "least-load",
            PolicyKind::SessionAffinity => "session-affinity",
            PolicyKind::PromptTree => "prompt-tree",
            PolicyKind::KvCentric => "kv-centric",
            PolicyKind::LoadAware => "load-aware",
        }
    }

    /// A fresh policy of this kind.
    pub fn build(self, cfg: &PolicyConfig) -> Box<dyn Policy> {
        match self {
            PolicyKind::RoundRobin => Box::new(RoundRobin::default()),
            PolicyKind::Random => Box::new(RandomPolicy),
            PolicyKind::LeastLoad => Box::new(LeastLoad),
            PolicyKind::SessionAffinity => Box::new(SessionAffinity::default()),
            PolicyKind::PromptTree => Box::new(PromptTree),
            PolicyKind::KvCentric => {
                Box::new(KvCentric { kvcache_balancing_threshold: cfg.kvcache_balancing_threshold })
            }
            PolicyKind::LoadAware => Box::new(LoadAware::new(cfg.load_aware)),
        }
    }
}

/// An unknown policy name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown policy {0:?} (expected one of round-robin, random, least-load, session-affinity, prompt-tree, kv-centric, load-aware)"
)]
pub struct UnknownPolicy(pub String);

impl FromStr for PolicyKind {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| UnknownPolicy(s.to_owned()))
    }
}

/// Parameters of the policies.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PolicyConfig {
    /// Mooncake's `kvcache_balancing_threshold`: an instance whose local prefix is shorter than
    /// the best one by this factor or more considers fetching the best instance's blocks.
    pub kvcache_balancing_threshold: f64,
    /// FlowKV's load-aware policy.
    pub load_aware: LoadAwareConfig,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self { kvcache_balancing_threshold: 1.5, load_aware: LoadAwareConfig::default() }
    }
}

// ---- shared estimates ----------------------------------------------------------------------

/// Predicted TTFT on `inst` with its first `cached_blocks` blocks reused: queue + prefill.
pub(crate) fn ttft_on(
    snap: &ClusterSnapshot<'_>,
    inst: &InstanceSnapshot,
    req: &Request,
    cached_blocks: usize,
) -> Micros {
    inst.queued_prefill_us + local_prefill_us(snap, inst, req, cached_blocks)
}

/// Prefill time on `inst` reusing the first `cached_blocks` blocks of the prompt from its own
/// cache. Blocks the index places on a slower tier are copied back first, over the profile's
/// host or disk link, as far as that beats computing them again, which is the engine's own
/// rule (`worth_taking` in baton-engine). A prefix spilled to a slow disk then counts for what
/// it saves, not as if it sat on the device.
pub(crate) fn local_prefill_us(
    snap: &ClusterSnapshot<'_>,
    inst: &InstanceSnapshot,
    req: &Request,
    cached_blocks: usize,
) -> Micros {
    let cost = snap.cost;
    let prefill = |blocks: usize| cost.prefill_time_cached(req.prompt_tokens, req.cached_tokens(blocks));
    let (host, disk) = slower_tiers(snap, inst.id, req, cached_blocks);
    if host + disk == 0 {
        return prefill(cached_blocks);
    }
    let device = cached_blocks - host - disk;
    let with_host = copy_back_us(snap, req, device + host, (host, 0)) + prefill(device + host);
    let with_disk = copy_back_us(snap, req, cached_blocks, (host, disk)) + prefill(cached_blocks);
    prefill(device).min(with_host).min(with_disk)
}

/// Of the first `blocks` blocks of the prompt that `id` caches, how many the index places on
/// the host tier and on the disk tier. Along a cached prefix the tiers only get slower, so they
/// are counted from its end, and a prefix all on the device costs one lookup.
fn slower_tiers(snap: &ClusterSnapshot<'_>, id: InstanceId, req: &Request, blocks: usize) -> (usize, usize) {
    let (mut host, mut disk) = (0, 0);
    for h in req.block_hashes[..blocks.min(req.block_hashes.len())].iter().rev() {
        match snap.trees.tier_of(id, *h) {
            Some(baton_kv::Tier::Disk) if host == 0 => disk += 1,
            Some(baton_kv::Tier::Host) => host += 1,
            _ => break,
        }
    }
    (host, disk)
}

/// The copy of the blocks `slower_tiers` counts back to the device, over the profile's links.
fn copy_back_us(snap: &ClusterSnapshot<'_>, req: &Request, blocks: usize, (host, disk): (usize, usize)) -> Micros {
    let cost = snap.cost;
    let tokens = |from: usize, to: usize| req.cached_tokens(to) - req.cached_tokens(from);
    let device = blocks - host - disk;
    let link = |n: usize, from: usize, l| if n == 0 { 0 } else { cost.kv_transfer_time(tokens(from, from + n), l) };
    link(host, device, cost.host_to_device) + link(disk, device + host, cost.disk_to_device)
}

/// Predicted TBT on a decode instance once this request joins (its running batch, the requests
/// already routed to it, and this one).
pub(crate) fn tbt_with(snap: &ClusterSnapshot<'_>, inst: &InstanceSnapshot, req: &Request) -> Micros {
    let incoming = &inst.decode_incoming;
    let batch = inst.decode_batch() + incoming.len() + u64::from(inst.decode_waiting) + 1;
    snap.cost.decode_step(batch, inst.decode_context() + incoming.context() + req.prompt_tokens)
}

/// The plan of least predicted TTFT, ties spread by [`spread`]: how every cache-affine policy
/// picks its prefill instance among plans it weighs alike.
pub(crate) fn least_ttft<'s>(plans: impl Iterator<Item = PrefillPlan<'s>>, req: &Request) -> Option<PrefillPlan<'s>> {
    plans.min_by_key(|p| (p.ttft, spread(req, p.inst.id)))
}

/// A tie-breaker that spreads requests over instances: a hash of the request and the instance,
/// so each request prefers its own order of instances, the same in every run. Breaking ties by
/// the lowest id instead sends every request that finds the cluster idle and its prompt cached
/// nowhere (a new conversation) to one instance, whose cache then evicts the others'
/// conversations while the other instances' caches stay empty.
pub(crate) fn spread(req: &Request, inst: InstanceId) -> u64 {
    // splitmix64's finaliser over the pair.
    let mut z = req.id.0 ^ u64::from(inst.0).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// How much slower than the fastest a decode instance may be predicted to be and still be
/// chosen for the prompt's prefix it caches ([`ClusterSnapshot::decode_affinity`]): a quarter.
const AFFINITY_SLACK_DIV: u64 = 4;

/// The decode instance with the least predicted TBT (ties by id), with that TBT. A colocated
/// prefill instance decodes its own requests (no hand-off) unless a single-role decode instance
/// would be faster by more than a quarter: beside decode instances (an elastic pair's middle
/// state, 1C+1D) it hands them the decode of what it prefills while they are the lighter,
/// instead of leaving them idle; colocated instances never hand decodes to one another (a
/// colocated cluster runs every request whole, as vLLM does). With decode affinity, the instance caching the
/// longest prefix of the prompt among those within a quarter of the least TBT: a session's next
/// turn goes where its history is, so the hand-off moves only the blocks it lacks.
pub(crate) fn least_loaded_decode(
    snap: &ClusterSnapshot<'_>,
    req: &Request,
    prefill: &InstanceSnapshot,
) -> Option<(InstanceId, Micros)> {
    let colocated = prefill.role == crate::Role::Colocated;
    let pool: Vec<(InstanceId, Micros)> = snap
        .decode_pool()
        .filter(|d| (!colocated || d.role == crate::Role::Decode) && d.shares_kv(prefill))
        .map(|d| (d.id, tbt_with(snap, d, req)))
        .collect();
    let own = colocated.then(|| tbt_with(snap, prefill, req));
    let fastest = match (pool.iter().map(|&(_, t)| t).min(), own) {
        (Some(f), Some(own)) if own <= f + f / AFFINITY_SLACK_DIV => return Some((prefill.id, own)),
        (None, Some(own)) => return Some((prefill.id, own)),
        (Some(f), _) => f,
        (None, None) => return None,
    };
    let cached = |id: InstanceId| {
        if snap.decode_affinity { snap.trees.prefix_len(id, &req.block_hashes, snap.now) } else { 0 }
    };
    pool.into_iter()
        .filter(|&(_, t)| t <= fastest + fastest / AFFINITY_SLACK_DIV)
        .max_by_key(|&(id, t)| (cached(id), std::cmp::Reverse(t), std::cmp::Reverse(id)))
}

/// What one prefill instance would do with a request, and the TTFT it would give (Mooncake's
/// Algorithm 1, lines 7–25): wait for its queue, fetch the blocks its cache lacks and another
/// instance holds when that beats recomputing them (MemServe eq. 2), prefill the rest.
///
/// Every cache-affine policy compares instances by [`PrefillPlan::ttft`], so a cache hit is
/// worth exactly the prefill time it saves and never more than the queue it costs (issue #18).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PrefillPlan<'s> {
    /// The prefill instance.
    pub(crate) inst: &'s InstanceSnapshot,
    /// Leading blocks it reuses from its own cache.
    pub(crate) local: usize,
    /// Blocks `local..end` fetched from another instance, as `(from, end)`.
    pub(crate) fetch: Option<(InstanceId, usize)>,
    /// Predicted TTFT: queue + transfer + prefill of what is not cached.
    pub(crate) ttft: Micros,
}

impl<'s> PrefillPlan<'s> {
    /// The plan of `inst`, which caches the first `local` blocks of the prompt, given the
    /// instance holding the longest prefix (`holder`: its id and blocks), if it may fetch from it.
    pub(crate) fn new(
        snap: &ClusterSnapshot<'_>,
        req: &Request,
        inst: &'s InstanceSnapshot,
        local: usize,
        holder: Option<(InstanceId, usize)>,
    ) -> Self {
        let mut plan = Self { inst, local, fetch: None, ttft: ttft_on(snap, inst, req, local) };
        let holder = holder.filter(|&(from, end)| {
            snap.kv_fetch && end > local && from != inst.id && snap.instance(from).is_some_and(|h| h.shares_kv(inst))
        });
        if let Some((from, end)) = holder {
            let tokens = req.cached_tokens(end) - req.cached_tokens(local);
            // The holder brings the prefix onto its device to export it.
            let at_holder = copy_back_us(snap, req, end, slower_tiers(snap, from, req, end));
            let remote = inst.queued_prefill_us
                + at_holder
                + snap.cost.kv_transfer_time(tokens, snap.link(from, inst.id))
                + snap.cost.prefill_time_cached(req.prompt_tokens, req.cached_tokens(end));
            if remote <= plan.ttft {
                plan.fetch = Some((from, end));
                plan.ttft = remote;
            }
        }
        plan
    }

    /// The route carrying out this plan, with `decode` (instance and predicted TBT). Fetched
    /// blocks are kept at the prefill instance (`migrate`: the hot prefix gets a replica).
    pub(crate) fn route(&self, decode: (InstanceId, Micros)) -> Route {
        let mut reuse = Vec::new();
        if self.local > 0 {
            reuse.push(Reuse { from: self.inst.id, start: 0, end: self.local as u32 });
        }
        if let Some((from, end)) = self.fetch {
            reuse.push(Reuse { from, start: self.local as u32, end: end as u32 });
        }
        Route {
            prefill: self.inst.id,
            decode: decode.0,
            reuse,
            migrate: self.fetch.is_some(),
            estimate: Estimate { ttft_us: self.ttft, tbt_us: decode.1 },
        }
    }
}

/// Builds a route that reuses only `prefill`'s own first `local` blocks.
pub(crate) fn local_route(
    snap: &ClusterSnapshot<'_>,
    req: &Request,
    prefill: &InstanceSnapshot,
    decode: (InstanceId, Micros),
    local: usize,
) -> Route {
    PrefillPlan::new(snap, req, prefill, local, None).route(decode)
}

/// Routes to `prefill` (local cache only) and the least-loaded decode instance.
pub(crate) fn route_to(snap: &ClusterSnapshot<'_>, req: &Request, prefill: &InstanceSnapshot) -> Decision {
    match least_loaded_decode(snap, req, prefill) {
        Some(d) => {
            let local = snap.trees.prefix_len(prefill.id, &req.block_hashes, snap.now);
            Decision::Route(local_route(snap, req, prefill, d, local))
        }
        None => Decision::Reject { reason: RejectReason::NoInstance },
    }
}

#[cfg(test)]
pub(crate) mod testutil {
    //! Hand-built snapshots.
    use baton_kv::{BlockHash, InstanceId};

    use crate::snapshot::{ClusterSnapshot, InstanceSnapshot, Request, RequestId, Role};
    use crate::{CostProfile, GlobalPromptTrees};

    /// `p` prefill instances (ids 0..p) and `d` decode instances (ids p..p+d).
    pub(crate) fn instances(p: u32, d: u32) -> Vec<InstanceSnapshot> {
        (0..p)
            .map(|i| InstanceSnapshot::idle(InstanceId(i), Role::Prefill))
            .chain((p..p + d).map(|i| InstanceSnapshot::idle(InstanceId(i), Role::Decode)))
            .collect()
    }

    pub(crate) fn trees_for(instances: &[InstanceSnapshot]) -> GlobalPromptTrees {
        let mut t = GlobalPromptTrees::new(60_000_000);
        for i in instances {
            t.set_role(i.id, i.role);
        }
        t
    }

    pub(crate) fn snap<'a>(
        instances: Vec<InstanceSnapshot>,
        trees: &'a GlobalPromptTrees,
        cost: &'a CostProfile,
    ) -> ClusterSnapshot<'a> {
        ClusterSnapshot { now: 0, instances, trees, cost, links: Vec::new(), kv_fetch: true, decode_affinity: false }
    }

    /// A request of `blocks` full 512-token blocks with hashes 1..=blocks.
    pub(crate) fn request(blocks: u64) -> Request {
        Request {
            id: RequestId(1),
            prompt_tokens: blocks * 512,
            block_hashes: (1..=blocks).map(BlockHash).collect(),
            block_tokens: 512,
            expected_output: 100,
            session: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::testutil::{instances, request, snap, trees_for};
    use super::*;
    use crate::{CostProfile, PolicyConfig, RequestId};

    /// PD-Caching-2: with decode affinity, the decode instance caching the prompt's history
    /// takes the request when it is about as fast as the fastest; a much busier one does not, and
    /// without affinity the fastest (lowest id on ties) always does.
    #[test]
    fn decode_affinity_prefers_the_history_while_it_is_about_as_fast() {
        let cost = CostProfile::llama2_70b_8xa800();
        let mut inst = instances(1, 2);
        let mut trees = trees_for(&inst);
        let req = request(8);
        trees.predict(InstanceId(2), &req.block_hashes[..6], 0);
        let prefill = |s: &ClusterSnapshot<'_>| s.instances[0].clone();
        let s = snap(inst.clone(), &trees, &cost);
        assert_eq!(least_loaded_decode(&s, &req, &prefill(&s)).map(|d| d.0), Some(InstanceId(1)), "affinity off");
        let s = s.with_decode_affinity(true);
        assert_eq!(
            least_loaded_decode(&s, &req, &prefill(&s)).map(|d| d.0),
            Some(InstanceId(2)),
            "the history's holder"
        );
        // The holder decodes a large batch: far slower than the idle one, so the idle one decodes.
        inst[2].decode_running = (0..64).map(|_| crate::DecodeSeq::new(0, 8192)).collect();
        let s = snap(inst, &trees, &cost).with_decode_affinity(true);
        assert_eq!(least_loaded_decode(&s, &req, &prefill(&s)).map(|d| d.0), Some(InstanceId(1)), "too busy");
    }

    /// Workers whose KV caches differ (a CPU worker's float32 arena, a GPU worker's bfloat16
    /// one) cannot hand KV to each other. Every policy pairs a prefill instance only with a
    /// decode instance of its group, never picks a prefill instance no decode instance can take
    /// from, and fetches a cached prefix only within the group: instances 0 and 3 are group 0,
    /// 1 and 4 group 1, prefill instance 2 has a group no decode instance shares, and the
    /// prompt's prefix sits on instance 1 (group 1), behind a long queue.
    #[test]
    fn every_policy_pairs_and_fetches_only_within_a_kv_group() {
        let cost = CostProfile::llama2_70b_8xa800();
        let mut inst = instances(3, 2);
        for (i, group) in [0, 1, 2, 0, 1].into_iter().enumerate() {
            inst[i].kv_group = Some(group);
        }
        // Instance 1's queue is long: fetching its prefix would beat waiting for it.
        inst[1].queued_prefill_us = 100_000_000;
        let mut trees = trees_for(&inst);
        let hashes = request(8).block_hashes;
        trees.predict(InstanceId(1), &hashes[..6], 0);
        let s = snap(inst, &trees, &cost);
        assert_eq!(s.prefill_pool().map(|i| i.id.0).collect::<Vec<_>>(), [0, 1], "no partner for instance 2");
        for kind in PolicyKind::ALL {
            let mut policy = kind.build(&PolicyConfig::default());
            let mut rng = StdRng::seed_from_u64(0);
            for id in 0..100 {
                let req = Request { id: RequestId(id), ..request(8) };
                let decision = policy.route(&s, &req, &mut rng);
                let route = decision.route().expect("routed");
                let group = |i: InstanceId| s.instance(i).and_then(|i| i.kv_group);
                assert_ne!(route.prefill, InstanceId(2), "{}: a prefill no decode can take", kind.name());
                assert_eq!(group(route.prefill), group(route.decode), "{}: {route:?}", kind.name());
                for reuse in &route.reuse {
                    assert_eq!(group(reuse.from), group(route.prefill), "{}: fetched across groups", kind.name());
                }
            }
        }
        // Unknown groups (`None`) share with every instance, as before groups existed.
        let mut inst = instances(1, 1);
        inst[1].kv_group = Some(5);
        let s = snap(inst, &trees, &cost);
        assert_eq!(least_loaded_decode(&s, &request(8), &s.instances[0]).map(|d| d.0), Some(InstanceId(1)));
    }

    /// The hand-off rule gathered once from the decode pool answers as asking every decode
    /// instance would: a prefill instance is in the pool only while an accepting decode
    /// instance of its group (or of none) is; a colocated one always.
    #[test]
    fn a_prefill_instance_is_in_the_pool_only_while_someone_decodes_for_it() {
        let cost = CostProfile::llama2_70b_8xa800();
        let pool = |inst: Vec<InstanceSnapshot>| {
            let trees = trees_for(&inst);
            snap(inst, &trees, &cost).prefill_pool().map(|i| i.id.0).collect::<Vec<_>>()
        };
        let mut inst = instances(2, 2);
        assert_eq!(pool(inst.clone()), [0, 1]);
        // Neither decode instance accepting: no one decodes for them.
        inst[2].accepting = false;
        inst[3].accepting = false;
        assert_eq!(pool(inst.clone()), Vec::<u32>::new());
        // A colocated instance decodes for itself, and takes the prefill instance's KV too.
        inst[1].role = crate::Role::Colocated;
        assert_eq!(pool(inst.clone()), [0, 1]);
        // Groups: instance 0 (group 3) has an accepting decode instance of group 3; an
        // ungrouped decode instance takes any group.
        let mut inst = instances(3, 2);
        for (i, g) in [Some(3), Some(4), None, Some(3), Some(5)].into_iter().enumerate() {
            inst[i].kv_group = g;
        }
        assert_eq!(pool(inst.clone()), [0, 2], "group 4 has no decode instance");
        inst[4].kv_group = None;
        assert_eq!(pool(inst), [0, 1, 2]);
    }

    /// Nothing cached, no queues: every instance ties, for every policy. Lowest-id-first sent
    /// every new conversation to instance 0, whose cache then thrashed while the others' stayed
    /// empty (live: one of four prefill workers took 64% of the prompt tokens).
    #[test]
    fn new_conversations_on_an_idle_cluster_spread_over_every_instance() {
        let cost = CostProfile::llama2_70b_8xa800();
        let inst = instances(4, 2);
        let trees = trees_for(&inst);
        let s = snap(inst, &trees, &cost);
        for kind in PolicyKind::ALL {
            let mut policy = kind.build(&PolicyConfig::default());
            let mut rng = StdRng::seed_from_u64(0);
            let mut per_instance = [0usize; 4];
            for id in 0..400 {
                let req = Request { id: RequestId(id), ..request(8) };
                let decision = policy.route(&s, &req, &mut rng);
                per_instance[decision.route().expect("routed").prefill.0 as usize] += 1;
            }
            for (i, &n) in per_instance.iter().enumerate() {
                assert!((60..=140).contains(&n), "{}: instance {i} took {n} of 400: {per_instance:?}", kind.name());
            }
        }
    }
}
