//! The routing seam: a pure policy over a snapshot of the workers.
//!
//! The conductor builds a [`Snapshot`] per request and calls [`RoutePolicy::route`]; the
//! scheduling crate's policies plug in here. The default is least-load: the prefill and decode
//! workers (or the colocated worker) with the fewest requests in flight.

/// What a policy sees of one worker.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerView {
    /// Index into the snapshot's worker list.
    pub index: usize,
    /// A stable id of the worker for as long as the conductor knows it (policies with memory,
    /// such as prompt trees, key on it).
    pub instance: u32,
    /// Its role.
    pub role: crate::Role,
    /// Requests in flight on it.
    pub in_flight: usize,
    /// Each request waiting for or in prefill on it: (when it was sent there, µs since the
    /// conductor started; prompt tokens it computes, net of its cached prefix).
    pub prefilling: Vec<(u64, usize)>,
    /// Each request decoding on it: (when decoding started, µs since the conductor started;
    /// context tokens).
    pub decoding: Vec<(u64, usize)>,
    /// KV tokens claimed on it by requests admitted to decode here that have not started
    /// decoding yet (still in prefill, or handing over).
    pub bound_tokens: usize,
    /// KV blocks of its pool (0: unknown).
    pub capacity_blocks: usize,
    /// Tokens of KV its pool holds (0: unknown).
    pub capacity_tokens: usize,
    /// Its last load report (`None` before the first arrives).
    pub report: Option<baton_protocol::wire::LoadReport>,
}

impl WorkerView {
    /// A view with only a load figure.
    pub fn new(index: usize, role: crate::Role, in_flight: usize) -> Self {
        Self {
            index,
            instance: index as u32,
            role,
            in_flight,
            prefilling: Vec::new(),
            decoding: Vec::new(),
            bound_tokens: 0,
            capacity_blocks: 0,
            capacity_tokens: 0,
            report: None,
        }
    }
}

/// The cluster as a policy sees it.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// Every live worker.
    pub workers: Vec<WorkerView>,
    /// The conductor's clock when the snapshot was taken (µs since it started).
    pub now_us: u64,
}

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

/// A routing decision.
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
    /// No worker can take it (HTTP 503).
    NoWorkers,
}

/// A cached prefix the prefill (or colocated) worker fetches from another worker before it
/// computes the rest of the prompt (Mooncake's Algorithm 1, MemServe's eq. 2: when moving the
/// KV beats recomputing it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fetch {
    /// The worker holding it (index into the snapshot's worker list).
    pub from: usize,
    /// The prompt's first `tokens` tokens (whole blocks).
    pub tokens: usize,
}

/// A routing decision with the fetch it counts on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Where the request runs.
    pub decision: Decision,
    /// A prefix to fetch first, if the policy planned one.
    pub fetch: Option<Fetch>,
}

/// The worker to run a request whole on when a role has no live worker: with no worker that
/// prefills (prefill or colocated), or none that decodes (decode or colocated), the workers
/// left run requests whole (any worker's engine does both; a request without a KV source is
/// run whole whatever the worker's role), the least loaded first. `None` when both roles are
/// present (the policy decides) or no worker is (HTTP 503). So no role is a single point of
/// failure, and disaggregation resumes as soon as the missing role returns.
pub fn lone_role_fallback(snapshot: &Snapshot) -> Option<usize> {
    use crate::Role;
    let workers = &snapshot.workers;
    let prefills = workers.iter().any(|w| w.role != Role::Decode);
    let decodes = workers.iter().any(|w| w.role != Role::Prefill);
    if prefills && decodes {
        return None;
    }
    workers.iter().min_by_key(|w| (w.in_flight, w.index)).map(|w| w.index)
}

/// A routing policy: pure, a function of the snapshot and the request.
pub trait RoutePolicy: Send + Sync {
    /// Decides where a request runs.
    fn route(&self, snapshot: &Snapshot, request: &RouteRequest<'_>) -> Decision;
    /// Decides where a request runs and whether its prompt's worker fetches a cached prefix
    /// from another worker first. The default plans no fetch.
    fn plan(&self, snapshot: &Snapshot, request: &RouteRequest<'_>) -> Plan {
        Plan { decision: self.route(snapshot, request), fetch: None }
    }
    /// Hands the policy the conductor's global prompt trees (fed by the workers' KV events), for
    /// a policy that routes by where KV is cached. The default ignores them.
    fn attach_index(&self, _trees: crate::view::SharedTrees) {}
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
pub fn decode_has_room(w: &WorkerView, prompt: usize) -> bool {
    let used = w.decoding.iter().map(|&(_, ctx)| ctx).sum::<usize>() + w.bound_tokens;
    room_for(w.capacity_tokens, used, prompt)
}

/// Whether `tokens` more fit a pool of `capacity` tokens holding `used` (0: capacity unknown,
/// always room): the one rule of [`decode_has_room`] and the conductor's claim on admission.
pub fn room_for(capacity: usize, used: usize, tokens: usize) -> bool {
    capacity == 0 || used + tokens < capacity
}

impl RoutePolicy for LeastLoad {
    fn route(&self, snapshot: &Snapshot, request: &RouteRequest<'_>) -> Decision {
        use crate::Role;
        let full = |w: &WorkerView| self.max_in_flight.is_some_and(|m| w.in_flight >= m);
        let least =
            |ws: &mut dyn Iterator<Item = &WorkerView>| ws.min_by_key(|w| (w.in_flight, w.index)).map(|w| w.index);
        // (`index` names a worker; the snapshot may leave some out, so it is not a position.)
        let busy = || Decision::Reject {
            reason: format!(
                "every worker has {} requests in flight; retry later",
                self.max_in_flight.unwrap_or_default()
            ),
        };
        let workers = &snapshot.workers;
        let prefills = || workers.iter().filter(|w| w.role != Role::Decode);
        if prefills().next().is_none() {
            return Decision::NoWorkers;
        }
        let Some(prefill) = least(&mut prefills().filter(|w| !full(w))) else { return busy() };
        let colocated = workers.iter().any(|w| w.index == prefill && w.role == Role::Colocated);
        // The decode: any worker that decodes, from a prefill worker; this one or a decode
        // worker, from a colocated one.
        let decodes = || {
            workers.iter().filter(move |w| match w.role {
                Role::Decode => true,
                Role::Colocated => !colocated || w.index == prefill,
                Role::Prefill => false,
            })
        };
        if decodes().next().is_none() {
            return Decision::NoWorkers;
        }
        let room = |w: &&WorkerView| w.index == prefill || decode_has_room(w, request.prompt.len());
        if !decodes().any(|w| room(&w)) {
            return Decision::Reject {
                reason: "no decode worker has room for the request's KV now; retry later".to_owned(),
            };
        }
        // Among decode workers, ties on requests in flight go to the one with the least KV bound
        // to it by requests still in prefill: a simultaneous burst finds every decode worker at
        // zero in flight (nothing has reached them yet) and would all go to the first.
        let decode = decodes()
            .filter(room)
            .filter(|w| w.index == prefill || !full(w))
            .min_by_key(|w| (w.in_flight, w.bound_tokens, w.index))
            .map(|w| w.index);
        match decode {
            Some(decode) if decode == prefill => Decision::Colocated(prefill),
            Some(decode) => Decision::Disaggregated { prefill, decode },
            None => busy(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Role;

    fn view(index: usize, role: Role, in_flight: usize) -> WorkerView {
        WorkerView::new(index, role, in_flight)
    }

    #[test]
    fn least_load_picks_the_idlest_of_each_role() {
        let s = Snapshot {
            now_us: 0,
            workers: vec![
                view(0, Role::Prefill, 3),
                view(1, Role::Prefill, 1),
                view(2, Role::Decode, 0),
                view(3, Role::Decode, 5),
            ],
        };
        let r = RouteRequest { prompt: &[1; 10], max_tokens: 10, session: None };
        assert_eq!(LeastLoad::default().route(&s, &r), Decision::Disaggregated { prefill: 1, decode: 2 });
    }

    /// A burst sees every decode worker at zero in flight; the KV bound to each by the burst's
    /// earlier requests spreads it (#37: the simple policy sent a burst of 6 all to one worker).
    #[test]
    fn a_burst_spreads_over_decode_workers_by_the_kv_bound_to_them() {
        let r = RouteRequest { prompt: &[1; 10], max_tokens: 10, session: None };
        let mut s = Snapshot {
            now_us: 0,
            workers: vec![view(0, Role::Prefill, 0), view(1, Role::Decode, 0), view(2, Role::Decode, 0)],
        };
        let mut split = [0; 3];
        for _ in 0..6 {
            let Decision::Disaggregated { decode, .. } = LeastLoad::default().route(&s, &r) else { panic!() };
            split[decode] += 1;
            s.workers[decode].bound_tokens += 10;
        }
        assert_eq!(split, [0, 3, 3]);
    }

    #[test]
    fn with_a_role_missing_the_idlest_worker_left_runs_requests_whole() {
        let snap = |workers| Snapshot { now_us: 0, workers };
        // Both roles present (a colocated worker is both): the policy decides.
        assert_eq!(lone_role_fallback(&snap(vec![view(0, Role::Prefill, 0), view(1, Role::Decode, 0)])), None);
        assert_eq!(lone_role_fallback(&snap(vec![view(0, Role::Colocated, 0)])), None);
        assert_eq!(lone_role_fallback(&snap(vec![view(0, Role::Prefill, 0), view(1, Role::Colocated, 0)])), None);
        // No prefill worker, or no decode worker: the least loaded of the rest.
        assert_eq!(lone_role_fallback(&snap(vec![view(0, Role::Decode, 4), view(1, Role::Decode, 2)])), Some(1));
        assert_eq!(lone_role_fallback(&snap(vec![view(0, Role::Prefill, 1), view(1, Role::Prefill, 1)])), Some(0));
        // None at all: nothing to fall back on (a 503).
        assert_eq!(lone_role_fallback(&Snapshot::default()), None);
    }

    #[test]
    fn colocated_workers_run_requests_whole_and_nothing_routes_when_empty() {
        let r = RouteRequest { prompt: &[1; 10], max_tokens: 10, session: None };
        let s = Snapshot { now_us: 0, workers: vec![view(0, Role::Colocated, 3), view(1, Role::Colocated, 2)] };
        assert_eq!(LeastLoad::default().route(&s, &r), Decision::Colocated(1));
        assert_eq!(LeastLoad::default().route(&Snapshot::default(), &r), Decision::NoWorkers);
        let s = Snapshot { now_us: 0, workers: vec![view(0, Role::Prefill, 0)] };
        assert_eq!(LeastLoad::default().route(&s, &r), Decision::NoWorkers, "nothing decodes");
    }

    /// An elastic pair after its switch uses both workers: with a prefill and a colocated
    /// worker, prompts go to the less loaded of the two and all decode on the colocated one;
    /// with a colocated and a decode worker, the colocated one prefills every prompt and keeps
    /// the decode unless the decode worker is less loaded.
    #[test]
    fn a_mixed_pair_uses_both_workers() {
        let r = RouteRequest { prompt: &[1; 10], max_tokens: 10, session: None };
        let route =
            |a: WorkerView, b: WorkerView| LeastLoad::default().route(&Snapshot { now_us: 0, workers: vec![a, b] }, &r);
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
    fn a_decode_worker_without_room_is_not_chosen_and_none_means_429() {
        let r = RouteRequest { prompt: &[1; 100], max_tokens: 10, session: None };
        let busy = WorkerView { capacity_tokens: 1000, decoding: vec![(0, 950)], ..view(1, Role::Decode, 0) };
        let idle = WorkerView { capacity_tokens: 1000, decoding: vec![(0, 300)], ..view(2, Role::Decode, 3) };
        let s = Snapshot { now_us: 0, workers: vec![view(0, Role::Prefill, 0), busy.clone(), idle] };
        assert_eq!(LeastLoad::default().route(&s, &r), Decision::Disaggregated { prefill: 0, decode: 2 });
        let s = Snapshot { now_us: 0, workers: vec![view(0, Role::Prefill, 0), busy] };
        assert!(matches!(LeastLoad::default().route(&s, &r), Decision::Reject { reason } if reason.contains("room")));
    }

    #[test]
    fn a_full_cluster_rejects_and_a_free_colocated_worker_still_prefills() {
        let r = RouteRequest { prompt: &[1; 10], max_tokens: 10, session: None };
        let capped = LeastLoad { max_in_flight: Some(2) };
        let s = Snapshot { now_us: 0, workers: vec![view(0, Role::Prefill, 2), view(1, Role::Decode, 0)] };
        assert!(matches!(capped.route(&s, &r), Decision::Reject { .. }));
        // The prefill worker is full: the colocated one prefills, and the idle decode worker
        // decodes.
        let s = Snapshot {
            now_us: 0,
            workers: vec![view(0, Role::Prefill, 2), view(1, Role::Decode, 0), view(2, Role::Colocated, 1)],
        };
        assert_eq!(capped.route(&s, &r), Decision::Disaggregated { prefill: 2, decode: 1 });
        let s = Snapshot { now_us: 0, workers: vec![view(0, Role::Colocated, 2)] };
        assert!(matches!(capped.route(&s, &r), Decision::Reject { .. }));
        assert_eq!(LeastLoad::default().route(&s, &r), Decision::Colocated(0));
    }
}
