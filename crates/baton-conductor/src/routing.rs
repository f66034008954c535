//! The routing seam: a pure policy over a snapshot of the workers.
//!
//! The conductor builds baton-sched's [`ClusterSnapshot`] per request from its ledger (the type
//! the simulator's policies see, built by the same [`ClusterSnapshot::from_workers`]:
//! [`cluster_snapshot`]) and calls [`RoutePolicy::plan`]; the scheduling crate's policies plug in
//! here ([`crate::sched::SchedPolicy`]). A policy reads the snapshot and writes nothing shared:
//! the prompt it expects cached where it routed the request comes back in the [`Plan`] as a
//! [`Predict`], which the conductor applies to the global prompt trees after the decision. The
//! default is least-load: the prefill and decode workers (or the colocated worker) with the
//! fewest requests in flight.

use baton_sched::{ClusterSnapshot, CostProfile, GlobalPromptTrees, InstanceSnapshot, Micros, Predict, WorkerLoad};

/// What a policy sees of a request.
#[derive(Debug, Clone, Copy)]
pub struct RouteRequest<'a> {
    /// Prompt token ids.
    pub prompt: &'a [u32],
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// The session it belongs to (a hash of its key), if any.
    pub session: Option<u64>,
}

/// A session key's id for routing: FNV-1a of the key (stable across conductors and restarts).
pub fn session_id(key: &str) -> u64 {
    baton_kv::fnv1a_64(key.as_bytes())
}

/// A routing decision. Workers are named by their position in the snapshot's instances.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// One colocated worker does everything.
    Colocated(usize),
    /// Prefill on one worker, decode on another.
    Disaggregated {
        /// The prefill worker.
        prefill: usize,
        /// The decode worker.
        decode: usize,
    },
    /// Refuse the request (HTTP 429).
    Reject {
        /// For the client.
        reason: String,
    },
    /// The request would be disaggregated, but no decode worker has room for its KV now: it
    /// waits in the conductor's admission queue for room (or is refused there, HTTP 429, when
    /// the wait would be too long).
    NoRoom,
    /// No worker can take it (HTTP 503).
    NoWorkers,
}

/// A cached prefix the prefill (or colocated) worker fetches from another worker before it
/// computes the rest of the prompt (Mooncake's Algorithm 1, MemServe's eq. 2: when moving the
/// KV beats recomputing it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fetch {
    /// The worker holding it (its position in the snapshot's instances).
    pub from: usize,
    /// The prompt's first `tokens` tokens (whole blocks).
    pub tokens: usize,
}

/// A routing decision with the fetch it counts on and what it changes in the prompt trees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Where the request runs.
    pub decision: Decision,
    /// A prefix to fetch first, if the policy planned one.
    pub fetch: Option<Fetch>,
    /// The prompt the policy expects cached where it routed the request, for the conductor to
    /// apply to the global prompt trees after the decision (the policy never writes them).
    pub predict: Option<Predict>,
}

impl Plan {
    /// A decision alone: no fetch, no prediction.
    pub fn of(decision: Decision) -> Self {
        Self { decision, fetch: None, predict: None }
    }
}

/// How the conductor builds the snapshot a policy reads ([`RoutePolicy::snapshot_config`]).
#[derive(Debug, Clone)]
pub struct SnapshotConfig {
    /// The cost model that turns the ledger's queued prompts into time.
    pub cost: CostProfile,
    /// Whether a prompt's worker may fetch a prefix cached on another worker
    /// ([`ClusterSnapshot::kv_fetch`]).
    pub kv_fetch: bool,
    /// Whether a request prefers the decode worker caching its history
    /// ([`ClusterSnapshot::decode_affinity`]).
    pub decode_affinity: bool,
    /// Whether the policy reads the global prompt trees. The conductor then holds their lock
    /// around the decision, expiring old predictions first and applying the plan's [`Predict`]
    /// after; a policy that does not read them gets empty trees, and no lock is taken.
    pub prompt_trees: bool,
}

impl Default for SnapshotConfig {
    fn default() -> Self {
        Self { cost: CostProfile::llama2_70b_8xa800(), kv_fetch: false, decode_affinity: false, prompt_trees: true }
    }
}

/// The snapshot a policy sees at `now`: the workers' figures from the conductor's ledger through
/// [`ClusterSnapshot::from_workers`] (instances in id order), with `config`'s fetch and affinity.
pub fn cluster_snapshot<'a>(
    now: Micros,
    workers: &[WorkerLoad],
    trees: &'a GlobalPromptTrees,
    config: &'a SnapshotConfig,
) -> ClusterSnapshot<'a> {
    ClusterSnapshot::from_workers(now, workers, trees, &config.cost)
        .with_kv_fetch(config.kv_fetch)
        .with_decode_affinity(config.decode_affinity)
}

/// Readies the global prompt trees for a decision at `now` over `workers`: drops predictions
/// whose TTL has passed and registers each worker's role. The conductor calls it under the
/// trees' lock, then builds the snapshot ([`cluster_snapshot`]), asks the policy, and applies the
/// plan's [`Predict`] ([`GlobalPromptTrees::apply_predict`]).
pub fn ready_trees(trees: &mut GlobalPromptTrees, now: Micros, workers: &[WorkerLoad]) {
    trees.expire(now);
    for w in workers {
        trees.set_role(w.id, w.role);
    }
}

/// The worker to run a request whole on when a role has no live worker: with no worker that
/// prefills (prefill or colocated), or none that decodes (decode or colocated), the workers
/// left run requests whole (any worker's engine does both; a request without a KV source is
/// run whole whatever the worker's role), the least loaded first. `None` when both roles are
/// present (the policy decides) or no worker is (HTTP 503). So no role is a single point of
/// failure, and disaggregation resumes as soon as the missing role returns.
///
/// Both roles present but no prefill worker whose KV a decode worker can take (a CPU prefill
/// worker beside GPU decode workers: [`InstanceSnapshot::shares_kv`]) counts as a role missing
/// too, and the decode workers run requests whole ([`Fallback::KvMismatch`]): a prefill there
/// would be computed for nothing.
pub fn lone_role_fallback(snapshot: &ClusterSnapshot<'_>) -> Option<(usize, Fallback)> {
    use crate::Role;
    let workers = &snapshot.instances;
    let least = |ws: &mut dyn Iterator<Item = usize>| ws.min_by_key(|&i| (workers[i].ledger.in_flight, i));
    let prefills = workers.iter().any(|w| w.role != Role::Decode);
    let decodes = workers.iter().any(|w| w.role != Role::Prefill);
    if !(prefills && decodes) {
        return least(&mut (0..workers.len())).map(|w| (w, Fallback::LoneRole));
    }
    let hand_off = snapshot.hand_off();
    if workers.iter().any(|p| hand_off.hands_off(p)) {
        return None;
    }
    least(&mut (0..workers.len()).filter(|&i| workers[i].role != Role::Prefill)).map(|w| (w, Fallback::KvMismatch))
}

/// Why [`lone_role_fallback`] runs a request whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// No worker prefills, or none decodes.
    LoneRole,
    /// No prefill worker's KV can go to a decode worker.
    KvMismatch,
}

/// A routing policy: pure, a function of the snapshot and the request. It may keep state of its
/// own (a scheduler, a random stream) behind its own lock, but writes nothing the conductor
/// shares: what it expects of the prompt trees comes back in the [`Plan`].
pub trait RoutePolicy: Send + Sync {
    /// How the conductor builds the snapshot this policy reads (asked once, when the conductor is
    /// built). The default: the default cost profile, no fetch, no decode affinity, prompt trees
    /// read.
    fn snapshot_config(&self) -> SnapshotConfig {
        SnapshotConfig::default()
    }
    /// Decides where a request runs.
    fn route(&self, snapshot: &ClusterSnapshot<'_>, request: &RouteRequest<'_>) -> Decision;
    /// Decides where a request runs, whether its prompt's worker fetches a cached prefix from
    /// another worker first, and what the prompt trees should expect. The default plans no fetch
    /// and predicts nothing.
    fn plan(&self, snapshot: &ClusterSnapshot<'_>, request: &RouteRequest<'_>) -> Plan {
        Plan::of(self.route(snapshot, request))
    }
    /// Tells the policy how long a request now stays on its decode worker, on average, as the
    /// conductor measures it (predictive admission's `t_d`). The default ignores it.
    fn decode_time(&self, _mean_us: u64) {}
}

/// Least-load: fewest requests in flight, ties to the first worker. The prompt goes to the
/// least loaded worker that prefills (a prefill or colocated one). From a prefill worker it is
/// handed to the least loaded worker that decodes (a decode or colocated one); a colocated
/// worker keeps it and runs it whole unless a decode worker is less loaded than it, which then
/// takes the decode. So a cluster of colocated workers runs every request whole, one of
/// prefill and decode workers disaggregates every request, and a mixed one (an elastic pair
/// after a switch: a prefill and a colocated worker, or a colocated and a decode worker) uses
/// both of its workers. With `max_in_flight`, a request whose least-loaded worker already has
/// that many requests is rejected (HTTP 429): queueing it would only add latency the client
/// can spend retrying.
#[derive(Debug, Clone, Copy, Default)]
pub struct LeastLoad {
    /// Most requests in flight per worker before new ones are refused (`None`: no limit).
    pub max_in_flight: Option<usize>,
}

/// Whether a decode worker has room to start a request of `prompt` tokens now: the context of
/// every request decoding on it or bound to it (admitted, still in prefill), plus this prompt,
/// fits in its KV pool. When
/// it does not, the hand-off would have to wait for room after the prefill (and the client would
/// have its first token and then wait): refusing before the prefill is the honest answer.
pub fn decode_has_room(w: &InstanceSnapshot, prompt: usize) -> bool {
    let l = &w.ledger;
    room_for(l.capacity_tokens as usize, (l.decoding_tokens + l.bound_tokens) as usize, prompt)
}

/// The worker that decodes (a decode or colocated worker taking work) with the most KV room free
/// by the ledger (a capacity of 0 is unknown: the most). Where a request already under way goes
/// when no decode worker has room for it now — its decode worker died after its first token —
/// so it waits in that worker's queue rather than fail after its 200.
pub fn most_room_decoder(workers: &[WorkerLoad]) -> Option<usize> {
    let free = |w: &WorkerLoad| {
        let l = &w.ledger;
        if l.capacity_tokens == 0 {
            i64::MAX
        } else {
            l.capacity_tokens as i64 - (l.decoding_tokens + l.bound_tokens) as i64
        }
    };
    workers
        .iter()
        .enumerate()
        .filter(|(_, w)| w.role != baton_sched::Role::Prefill && w.accepting)
        .max_by_key(|&(i, w)| (free(w), std::cmp::Reverse(i)))
        .map(|(i, _)| i)
}

/// Whether `tokens` more fit a pool of `capacity` tokens holding `used` (0: capacity unknown,
/// always room): the one rule of [`decode_has_room`] and the conductor's claim on admission.
pub fn room_for(capacity: usize, used: usize, tokens: usize) -> bool {
    capacity == 0 || used + tokens < capacity
}

impl RoutePolicy for LeastLoad {
    /// Least-load reads the ledger's counts only: no prompt trees (and so no lock on them).
    fn snapshot_config(&self) -> SnapshotConfig {
        SnapshotConfig { prompt_trees: false, ..SnapshotConfig::default() }
    }

    fn route(&self, snapshot: &ClusterSnapshot<'_>, request: &RouteRequest<'_>) -> Decision {
        use crate::Role;
        // A worker is its position in the snapshot's instances.
        let workers: &[InstanceSnapshot] = &snapshot.instances;
        let in_flight = |i: usize| workers[i].ledger.in_flight as usize;
        let full = |i: usize| self.max_in_flight.is_some_and(|m| in_flight(i) >= m);
        let least = |ws: &mut dyn Iterator<Item = usize>| ws.min_by_key(|&i| (in_flight(i), i));
        let busy = || Decision::Reject {
            reason: format!(
                "every worker has {} requests in flight; retry later",
                self.max_in_flight.unwrap_or_default()
            ),
        };
        // Prefill workers whose KV some decode worker can take (`lone_role_fallback` runs
        // requests whole when there is none).
        let hand_off = snapshot.hand_off();
        let prefills = || (0..workers.len()).filter(|&i| hand_off.hands_off(&workers[i]));
        if prefills().next().is_none() {
            return Decision::NoWorkers;
        }
        let Some(prefill) = least(&mut prefills().filter(|&i| !full(i))) else { return busy() };
        let colocated = workers[prefill].role == Role::Colocated;
        // The decode: any worker that decodes, from a prefill worker; this one or a decode
        // worker, from a colocated one.
        let decodes = || {
            (0..workers.len()).filter(move |&i| match workers[i].role {
                Role::Decode => workers[i].shares_kv(&workers[prefill]),
                Role::Colocated => !colocated && workers[i].shares_kv(&workers[prefill]) || i == prefill,
                Role::Prefill => false,
            })
        };
        if decodes().next().is_none() {
            return Decision::NoWorkers;
        }
        let room = |i: &usize| *i == prefill || decode_has_room(&workers[*i], request.prompt.len());
        if !decodes().any(|i| room(&i)) {
            return Decision::NoRoom;
        }
        // Among decode workers, ties on requests in flight go to the one with the least KV bound
        // to it by requests still in prefill: a simultaneous burst finds every decode worker at
        // zero in flight (nothing has reached them yet) and would all go to the first.
        let decode = decodes()
            .filter(room)
            .filter(|&i| i == prefill || !full(i))
            .min_by_key(|&i| (in_flight(i), workers[i].ledger.bound_tokens, i));
        match decode {
            Some(decode) if decode == prefill => Decision::Colocated(prefill),
            Some(decode) => Decision::Disaggregated { prefill, decode },
            None => busy(),
        }
    }
}

#[cfg(test)]
mod tests {
    use baton_kv::InstanceId;
    use baton_sched::Ledger;

    use super::*;
    use crate::Role;

    /// Worker `index` (its instance id too) with `in_flight` requests.
    fn view(index: usize, role: Role, in_flight: usize) -> WorkerLoad {
        let mut w = WorkerLoad::idle(InstanceId(index as u32), role);
        w.ledger.in_flight = in_flight as u32;
        w
    }

    /// Worker `index` with `in_flight` requests and a pool of `capacity` tokens, `decoding` of
    /// them held by its decodes.
    fn with_room(index: usize, role: Role, in_flight: usize, capacity: u64, decoding: u64) -> WorkerLoad {
        let mut w = view(index, role, in_flight);
        w.ledger = Ledger { capacity_tokens: capacity, decoding_tokens: decoding, ..w.ledger };
        w
    }

    /// The conductor's snapshot of `workers` (no prompt trees: least-load reads none).
    fn snap<T>(workers: &[WorkerLoad], f: impl FnOnce(&ClusterSnapshot<'_>) -> T) -> T {
        let (trees, config) = (GlobalPromptTrees::new(0), SnapshotConfig::default());
        f(&cluster_snapshot(0, workers, &trees, &config))
    }

    fn route(policy: LeastLoad, workers: &[WorkerLoad], r: &RouteRequest<'_>) -> Decision {
        snap(workers, |s| policy.route(s, r))
    }

    fn fallback(workers: Vec<WorkerLoad>) -> Option<usize> {
        snap(&workers, |s| lone_role_fallback(s).map(|(w, _)| w))
    }

    #[test]
    fn least_load_picks_the_idlest_of_each_role() {
        let workers =
            [view(0, Role::Prefill, 3), view(1, Role::Prefill, 1), view(2, Role::Decode, 0), view(3, Role::Decode, 5)];
        let r = RouteRequest { prompt: &[1; 10], max_tokens: 10, session: None };
        assert_eq!(route(LeastLoad::default(), &workers, &r), Decision::Disaggregated { prefill: 1, decode: 2 });
    }

    /// A burst sees every decode worker at zero in flight; the KV bound to each by the burst's
    /// earlier requests spreads it (#37: the simple policy sent a burst of 6 all to one worker).
    #[test]
    fn a_burst_spreads_over_decode_workers_by_the_kv_bound_to_them() {
        let r = RouteRequest { prompt: &[1; 10], max_tokens: 10, session: None };
        let mut workers = vec![view(0, Role::Prefill, 0), view(1, Role::Decode, 0), view(2, Role::Decode, 0)];
        let mut split = [0; 3];
        for _ in 0..6 {
            let Decision::Disaggregated { decode, .. } = route(LeastLoad::default(), &workers, &r) else { panic!() };
            split[decode] += 1;
            workers[decode].ledger.bound_tokens += 10;
        }
        assert_eq!(split, [0, 3, 3]);
    }

    /// Worker `index` of KV group `group`.
    fn grouped(index: usize, role: Role, in_flight: usize, group: u32) -> WorkerLoad {
        WorkerLoad { kv_group: Some(group), ..view(index, role, in_flight) }
    }

    /// A prefill worker whose KV no decode worker can take is as good as none: with no such
    /// pair at all, the decode workers run requests whole; with one, least-load takes it even
    /// where another decode worker is idler.
    #[test]
    fn prefill_and_decode_pair_only_within_a_kv_group() {
        let r = RouteRequest { prompt: &[1; 10], max_tokens: 10, session: None };
        let mismatched =
            vec![grouped(0, Role::Prefill, 0, 0), grouped(1, Role::Decode, 3, 1), grouped(2, Role::Decode, 1, 1)];
        assert_eq!(snap(&mismatched, lone_role_fallback), Some((2, Fallback::KvMismatch)));
        let workers = vec![
            grouped(0, Role::Prefill, 0, 0),
            grouped(1, Role::Prefill, 0, 1),
            grouped(2, Role::Decode, 0, 1),
            grouped(3, Role::Decode, 5, 0),
        ];
        assert_eq!(fallback(workers.clone()), None);
        // Worker 2 is the idler decode worker, but only worker 3 takes worker 0's KV.
        assert_eq!(route(LeastLoad::default(), &workers, &r), Decision::Disaggregated { prefill: 0, decode: 3 });
        // Group 1's prefill worker idler: it hands to group 1's decode worker.
        let mut idle1 = workers;
        idle1[0].ledger.in_flight = 1;
        assert_eq!(route(LeastLoad::default(), &idle1, &r), Decision::Disaggregated { prefill: 1, decode: 2 });
    }

    #[test]
    fn with_a_role_missing_the_idlest_worker_left_runs_requests_whole() {
        // Both roles present (a colocated worker is both): the policy decides.
        assert_eq!(fallback(vec![view(0, Role::Prefill, 0), view(1, Role::Decode, 0)]), None);
        assert_eq!(fallback(vec![view(0, Role::Colocated, 0)]), None);
        assert_eq!(fallback(vec![view(0, Role::Prefill, 0), view(1, Role::Colocated, 0)]), None);
        // No prefill worker, or no decode worker: the least loaded of the rest.
        assert_eq!(fallback(vec![view(0, Role::Decode, 4), view(1, Role::Decode, 2)]), Some(1));
        assert_eq!(fallback(vec![view(0, Role::Prefill, 1), view(1, Role::Prefill, 1)]), Some(0));
        // None at all: nothing to fall back on (a 503).
        assert_eq!(fallback(Vec::new()), None);
    }

    #[test]
    fn colocated_workers_run_requests_whole_and_nothing_routes_when_empty() {
        let r = RouteRequest { prompt: &[1; 10], max_tokens: 10, session: None };
        let workers = [view(0, Role::Colocated, 3), view(1, Role::Colocated, 2)];
        assert_eq!(route(LeastLoad::default(), &workers, &r), Decision::Colocated(1));
        assert_eq!(route(LeastLoad::default(), &[], &r), Decision::NoWorkers);
        let workers = [view(0, Role::Prefill, 0)];
        assert_eq!(route(LeastLoad::default(), &workers, &r), Decision::NoWorkers, "nothing decodes");
    }

    /// An elastic pair after its switch uses both workers: with a prefill and a colocated
    /// worker, prompts go to the less loaded of the two and all decode on the colocated one;
    /// with a colocated and a decode worker, the colocated one prefills every prompt and keeps
    /// the decode unless the decode worker is less loaded.
    #[test]
    fn a_mixed_pair_uses_both_workers() {
        let r = RouteRequest { prompt: &[1; 10], max_tokens: 10, session: None };
        let route = |a: WorkerLoad, b: WorkerLoad| route(LeastLoad::default(), &[a, b], &r);
        assert_eq!(
            route(view(0, Role::Prefill, 0), view(1, Role::Colocated, 2)),
            Decision::Disaggregated { prefill: 0, decode: 1 }
        );
        assert_eq!(route(view(0, Role::Prefill, 3), view(1, Role::Colocated, 2)), Decision::Colocated(1));
        assert_eq!(
            route(view(0, Role::Colocated, 2), view(1, Role::Decode, 1)),
            Decision::Disaggregated { prefill: 0, decode: 1 }
        );
        assert_eq!(route(view(0, Role::Colocated, 1), view(1, Role::Decode, 2)), Decision::Colocated(0));
    }

    #[test]
    fn a_decode_worker_without_room_is_not_chosen_and_none_means_no_room() {
        let r = RouteRequest { prompt: &[1; 100], max_tokens: 10, session: None };
        let busy = with_room(1, Role::Decode, 0, 1000, 950);
        let idle = with_room(2, Role::Decode, 3, 1000, 300);
        let workers = [view(0, Role::Prefill, 0), busy.clone(), idle];
        assert_eq!(route(LeastLoad::default(), &workers, &r), Decision::Disaggregated { prefill: 0, decode: 2 });
        let workers = [view(0, Role::Prefill, 0), busy];
        assert!(matches!(route(LeastLoad::default(), &workers, &r), Decision::NoRoom));
    }

    #[test]
    fn a_request_under_way_goes_to_the_decoder_with_the_most_room_never_a_prefill_worker() {
        let prefill = with_room(0, Role::Prefill, 0, 10_000, 0);
        let fuller = with_room(1, Role::Decode, 1, 1000, 950);
        let emptier = with_room(2, Role::Decode, 1, 1000, 900);
        assert_eq!(most_room_decoder(&[prefill.clone(), fuller.clone(), emptier.clone()]), Some(2));
        // A pool of unknown size (0) is taken to have the most room.
        let unknown = with_room(3, Role::Colocated, 4, 0, 0);
        assert_eq!(most_room_decoder(&[fuller.clone(), emptier, unknown]), Some(2));
        let mut leaving = fuller;
        leaving.accepting = false;
        assert_eq!(most_room_decoder(&[prefill, leaving]), None, "no decoder taking work");
    }

    #[test]
    fn a_full_cluster_rejects_and_a_free_colocated_worker_still_prefills() {
        let r = RouteRequest { prompt: &[1; 10], max_tokens: 10, session: None };
        let capped = LeastLoad { max_in_flight: Some(2) };
        let workers = [view(0, Role::Prefill, 2), view(1, Role::Decode, 0)];
        assert!(matches!(route(capped, &workers, &r), Decision::Reject { .. }));
        // The prefill worker is full: the colocated one prefills, and the idle decode worker
        // decodes.
        let workers = [view(0, Role::Prefill, 2), view(1, Role::Decode, 0), view(2, Role::Colocated, 1)];
        assert_eq!(route(capped, &workers, &r), Decision::Disaggregated { prefill: 2, decode: 1 });
        let workers = [view(0, Role::Colocated, 2)];
        assert!(matches!(route(capped, &workers, &r), Decision::Reject { .. }));
        assert_eq!(route(LeastLoad::default(), &workers, &r), Decision::Colocated(0));
    }
}
