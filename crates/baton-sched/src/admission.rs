//! Admission control (Mooncake §6) and the [`Scheduler`] that puts policy and admission together.
//!
//! - [`AdmissionKind::None`]: every request is admitted.
//! - [`AdmissionKind::Baseline`]: Mooncake Table 2's baseline: the prefill side checks its TTFT
//!   before the prefill, the decode side checks its own load only when the KV arrives (the
//!   executor does that check; a rejection there wastes the prefill).
//! - [`AdmissionKind::EarlyRejection`] (§6.2): before the prefill, reject if the predicted TTFT or
//!   the chosen decode instance's *current* load (its TBT with its running and waiting requests
//!   and this one) is over the SLO.
//! - [`AdmissionKind::Predictive`] (§6.4): like early rejection, but the decode load is
//!   predicted over the time the request would decode, from when its KV arrives (its predicted
//!   TTFT and the transfer): a running sequence leaves after its remaining output when that is
//!   known ([`DecodeSeq::remaining`](crate::DecodeSeq): request-level prediction; the simulator
//!   knows it), else after a uniform `t_d` from when it joined (Mooncake's system level: the
//!   conductor's measured mean stay); requests already routed to the instance join when their
//!   KV is due and leave after their output if known. The load when this request's KV arrives
//!   must be within the limit (the target less the headroom), and the peak over its stay within
//!   the target, so that none admitted before it is turned away after its prefill by the decode
//!   side's own check ([`predicted_peak_tbt`]).
//!
//! Mooncake states both checks for the decode *pool*. Early rejection checks the policy's
//! decode instance (with least-loaded decode selection the pool's best now, and what the decode
//! instance itself will check when the KV arrives); predictive admission, when that instance
//! fails, moves the request to the pool's decode instance that passes with the least predicted
//! load (the policy's choice weighs load now, not when the KV gets there).

use rand::RngCore;
use serde::{Deserialize, Serialize};

use crate::policy::Policy;
use crate::snapshot::{ClusterSnapshot, Decision, Estimate, InstanceSnapshot, RejectReason, Request, Reuse, Route};
use baton_kv::InstanceId;

use crate::{Micros, RoleChange};

/// Latency targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slo {
    /// Time to first token.
    pub ttft_us: Micros,
    /// Time between tokens.
    pub tbt_us: Micros,
}

impl Default for Slo {
    /// Mooncake §7.1.3's real-workload limits: 30 s TTFT, 0.1 s per token.
    fn default() -> Self {
        Self { ttft_us: 30_000_000, tbt_us: 100_000 }
    }
}

/// Which admission control.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AdmissionKind {
    /// Admit everything.
    None,
    /// TTFT check before prefill, decode check after it.
    Baseline,
    /// TTFT and current decode load before prefill.
    EarlyRejection,
    /// TTFT and predicted decode load before prefill.
    Predictive,
}

impl AdmissionKind {
    /// Every kind.
    pub const ALL: [AdmissionKind; 4] =
        [AdmissionKind::None, AdmissionKind::Baseline, AdmissionKind::EarlyRejection, AdmissionKind::Predictive];

    /// Its command-line name.
    pub fn name(self) -> &'static str {
        match self {
            AdmissionKind::None => "none",
            AdmissionKind::Baseline => "baseline",
            AdmissionKind::EarlyRejection => "early",
            AdmissionKind::Predictive => "predictive",
        }
    }

    /// Whether the decode side checks its load when the KV arrives (and may waste a prefill).
    pub fn decode_checks_on_arrival(self) -> bool {
        !matches!(self, AdmissionKind::None)
    }
}

/// An unknown admission name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown admission {0:?} (expected none, baseline, early or predictive)")]
pub struct UnknownAdmission(pub String);

impl std::str::FromStr for AdmissionKind {
    type Err = UnknownAdmission;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| UnknownAdmission(s.to_owned()))
    }
}

/// Admission settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdmissionConfig {
    /// Which control.
    pub kind: AdmissionKind,
    /// The SLOs.
    pub slo: Slo,
    /// Predictive: the uniform decode duration `t_d` of a request.
    pub decode_time_us: Micros,
    /// Fraction of the TBT target that early and predictive admission keep free: a request is
    /// admitted while the decode step it predicts stays under `(1 − tbt_headroom) × tbt_us`.
    /// Admitting up to the target itself fills the decode batch until its steps sit at the
    /// target, and a request's mean TBT is then over it about half the time (measured in
    /// `scripts/overload.sh`). The decode side's own check when the KV arrives stays at the
    /// target.
    #[serde(default)]
    pub tbt_headroom: f64,
}

/// The default [`AdmissionConfig::tbt_headroom`]: a tenth of the TBT target.
pub const DEFAULT_TBT_HEADROOM: f64 = 0.1;

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            kind: AdmissionKind::None,
            slo: Slo::default(),
            decode_time_us: 10_000_000,
            tbt_headroom: DEFAULT_TBT_HEADROOM,
        }
    }
}

/// Current TBT of a decode instance with `extra` more sequences of `extra_context` tokens.
fn tbt_now(snap: &ClusterSnapshot<'_>, d: &InstanceSnapshot, extra: u64, extra_context: u64) -> Micros {
    let batch = d.decode_batch() + u64::from(d.decode_waiting) + extra;
    let ctx = d.decode_context() + extra_context;
    d.decode_step(snap.cost, batch, ctx)
}

/// Predicted TBT of a decode instance at time `at`, with `extra` more sequences of
/// `extra_context` tokens in all: [`predicted_peak_tbt`] over `at..=at`.
pub fn predicted_tbt_at(
    snap: &ClusterSnapshot<'_>,
    d: &InstanceSnapshot,
    at: Micros,
    t_d: Micros,
    extra: u64,
    extra_context: u64,
) -> Micros {
    predicted_peak_tbt(snap, d, (at, at), t_d, extra, extra_context)
}

/// The highest TBT a decode instance is predicted to have over `window` (`from..=until`), with
/// `extra` more sequences of `extra_context` tokens in all decoding throughout.
///
/// Each sequence decodes from when it joins to when it leaves: a running one from now, a request
/// already routed here from when its KV is expected (`ready_at`). One whose output is known
/// ([`DecodeSeq::remaining`](crate::DecodeSeq), [`IncomingSeq::output`](crate::IncomingSeq))
/// leaves after that many steps of the instance's current step; a running one whose output is
/// not known, once the uniform decode time `t_d` has passed since it joined (Mooncake's
/// system-level prediction); an incoming one whose output is not known stays. Requests waiting
/// to join the batch stay.
///
/// Predictive admission asks it for the window a request would decode in: a request admitted
/// later whose KV gets here sooner is then weighed against this one's whole stay, not only the
/// moment it arrives.
pub fn predicted_peak_tbt(
    snap: &ClusterSnapshot<'_>,
    d: &InstanceSnapshot,
    window: (Micros, Micros),
    t_d: Micros,
    extra: u64,
    extra_context: u64,
) -> Micros {
    let (from, until) = (window.0, window.1.max(window.0));
    // Outputs count down at the current step, and no faster than a lone sequence's (an idle
    // instance's next step is not free).
    let step = tbt_now(snap, d, 0, 0).max(d.decode_step(snap.cost, 1, 0)).max(1);
    let now = snap.now;
    let running = d.decode_running.iter().map(|s| {
        let leaves = match s.remaining {
            Some(left) => now.saturating_add(left.saturating_mul(step)),
            None => s.started_at.saturating_add(t_d),
        };
        (now, leaves, s.context)
    });
    let incoming = d.decode_incoming.iter().map(|s| {
        let leaves = s.output.map_or(Micros::MAX, |o| s.ready_at.saturating_add(o.saturating_mul(step)));
        (s.ready_at, leaves, s.context)
    });
    // Who decodes at `from`, then every join and departure up to `until`.
    let (mut batch, mut ctx) = (i128::from(d.decode_waiting) + i128::from(extra), i128::from(extra_context));
    let mut changes: Vec<(Micros, i128, i128)> = Vec::new();
    for (joins, leaves, context) in running.chain(incoming) {
        let context = i128::from(context);
        let there = joins <= from && leaves > from;
        if there {
            batch += 1;
            ctx += context;
        } else if joins > from && joins <= until && leaves > joins {
            changes.push((joins, 1, context));
        } else {
            continue;
        }
        if leaves <= until {
            changes.push((leaves, -1, -context));
        }
    }
    changes.sort_unstable();
    let step_of = |batch: i128, ctx: i128| d.decode_step(snap.cost, batch.max(0) as u64, ctx.max(0) as u64);
    let mut peak = step_of(batch, ctx);
    let mut i = 0;
    while i < changes.len() {
        let t = changes[i].0;
        while let Some(&(at, n, c)) = changes.get(i).filter(|c| c.0 == t) {
            debug_assert_eq!(at, t);
            batch += n;
            ctx += c;
            i += 1;
        }
        peak = peak.max(step_of(batch, ctx));
    }
    peak
}

/// What early or predictive admission weighed on a request's decode instance: the load it
/// predicted, for when, against what limit. The simulator's `--load-trace` records one per
/// arrival, to set beside the load that instance then had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeCheck {
    /// The decode instance the route chose.
    pub decode: InstanceId,
    /// The time the load is predicted for (now for early rejection; the request's KV on the
    /// decode instance for predictive).
    pub at: Micros,
    /// The predicted decode step (TBT) with this request at `at`, µs.
    pub load_us: Micros,
    /// The most admission allows at `at`, µs (the TBT target less its headroom).
    pub limit_us: Micros,
    /// Predictive: the highest step predicted while the request decodes (requests already
    /// admitted whose KV comes later join, others leave), µs; early: `load_us`.
    pub peak_us: Micros,
    /// The most `peak_us` may be: the TBT target itself, what the decode side checks when a
    /// request's KV arrives, so that admitting this one makes no request admitted before it
    /// turned away after its prefill.
    pub target_us: Micros,
}

impl DecodeCheck {
    /// Whether the request passes.
    pub fn passes(&self) -> bool {
        self.load_us <= self.limit_us && self.peak_us <= self.target_us
    }
}

/// The decode-side check of early or predictive admission for a routed request (`None` for the
/// controls that make none before the prefill, or when the route's decode instance is unknown).
pub fn decode_check(
    cfg: &AdmissionConfig,
    snap: &ClusterSnapshot<'_>,
    req: &Request,
    route: &Route,
) -> Option<DecodeCheck> {
    let d = snap.instance(route.decode)?;
    let (at, load_us, peak_us) = match cfg.kind {
        AdmissionKind::None | AdmissionKind::Baseline => return None,
        AdmissionKind::EarlyRejection => {
            let load = tbt_now(snap, d, 1, req.prompt_tokens);
            (snap.now, load, load)
        }
        AdmissionKind::Predictive => {
            let at = kv_in_at(snap, req, route.prefill, d.id, route.estimate.ttft_us);
            let t_d = cfg.decode_time_us;
            (at, predicted_tbt_at(snap, d, at, t_d, 1, req.prompt_tokens), predicted_stay_tbt(cfg, snap, d, req, at))
        }
    };
    Some(DecodeCheck { decode: d.id, at, load_us, limit_us: tbt_limit(cfg), peak_us, target_us: cfg.slo.tbt_us })
}

/// When a request's KV would be in on decode instance `decode`: its prefill done (`ttft_us` from
/// now) and its prompt's KV moved over the link.
fn kv_in_at(
    snap: &ClusterSnapshot<'_>,
    req: &Request,
    prefill: InstanceId,
    decode: InstanceId,
    ttft_us: Micros,
) -> Micros {
    let transfer =
        if prefill == decode { 0 } else { snap.cost.kv_transfer_time(req.prompt_tokens, snap.link(prefill, decode)) };
    snap.now + ttft_us + transfer
}

/// Predictive admission's figure: the highest TBT decode instance `d` is predicted to have
/// while `req` decodes there, from `at`, when its KV is in, for its expected output at steps of
/// the limit (no slower, if admitted).
fn predicted_stay_tbt(
    cfg: &AdmissionConfig,
    snap: &ClusterSnapshot<'_>,
    d: &InstanceSnapshot,
    req: &Request,
    at: Micros,
) -> Micros {
    let stay = req.expected_output.saturating_sub(1).saturating_mul(tbt_limit(cfg));
    predicted_peak_tbt(snap, d, (at, at.saturating_add(stay)), cfg.decode_time_us, 1, req.prompt_tokens)
}

/// Predictive admission over the decode pool: when the route's decode instance fails the
/// check, the decode instance of the pool that passes it with the lowest predicted load, if
/// any (Mooncake §6.4 predicts the pool's load, not one instance's). `None` when none passes, or
/// the route runs whole on one instance.
fn predictive_reroute(
    cfg: &AdmissionConfig,
    snap: &ClusterSnapshot<'_>,
    req: &Request,
    route: &Route,
) -> Option<Route> {
    if route.prefill == route.decode {
        return None;
    }
    snap.decode_pool()
        .filter(|d| d.id != route.decode && d.id != route.prefill && d.role == crate::Role::Decode)
        .filter_map(|d| {
            let other = Route { decode: d.id, ..route.clone() };
            decode_check(cfg, snap, req, &other).filter(DecodeCheck::passes).map(|c| (c.load_us, c.peak_us, other))
        })
        .min_by_key(|(load, peak, r)| (*load, *peak, r.decode))
        .map(|(load, _, r)| Route { estimate: Estimate { tbt_us: load, ..r.estimate }, ..r })
}

/// The most decode step early and predictive admission allow: the TBT target less its headroom.
fn tbt_limit(cfg: &AdmissionConfig) -> Micros {
    (cfg.slo.tbt_us as f64 * (1.0 - cfg.tbt_headroom.clamp(0.0, 0.9))) as Micros
}

/// The admission check of a routed request.
pub fn admit(
    cfg: &AdmissionConfig,
    snap: &ClusterSnapshot<'_>,
    req: &Request,
    route: &Route,
) -> Result<(), RejectReason> {
    admit_checked(cfg, snap, req, route).0
}

/// [`admit`], with the decode check it made.
fn admit_checked(
    cfg: &AdmissionConfig,
    snap: &ClusterSnapshot<'_>,
    req: &Request,
    route: &Route,
) -> (Result<(), RejectReason>, Option<DecodeCheck>) {
    let slo = cfg.slo;
    if cfg.kind == AdmissionKind::None {
        return (Ok(()), None);
    }
    if route.estimate.ttft_us > slo.ttft_us {
        return (Err(RejectReason::Ttft { predicted_us: route.estimate.ttft_us, slo_us: slo.ttft_us }), None);
    }
    if snap.instance(route.decode).is_none() {
        return (Err(RejectReason::NoInstance), None);
    }
    let check = decode_check(cfg, snap, req, route);
    match check {
        Some(c) if !c.passes() => (Err(RejectReason::Tbt { predicted_us: c.load_us, slo_us: c.limit_us }), check),
        _ => (Ok(()), check),
    }
}

/// Conditional disaggregation's choice: `route` carried out whole on its decode instance, if at
/// most `max` of the prompt's tokens are not cached there and that is predicted no slower: the
/// decode instance computes them in its next step (after what is left of the current one, half
/// a step on average; none when idle), where the split route waits for its prefill and then
/// moves the KV the decode instance lacks before decoding starts.
fn run_on_decode(snap: &ClusterSnapshot<'_>, req: &Request, route: &Route, max: u64) -> Option<Route> {
    let d = snap.instance(route.decode)?;
    if route.prefill == route.decode || d.role != crate::Role::Decode {
        return None;
    }
    let cached = snap.trees.prefix_len(d.id, &req.block_hashes, snap.now);
    let cached_tokens = req.cached_tokens(cached);
    let uncached = req.prompt_tokens.saturating_sub(cached_tokens);
    if uncached > max {
        return None;
    }
    let step_left =
        if d.decode_batch() == 0 { 0 } else { snap.cost.decode_step(d.decode_batch(), d.decode_context()) / 2 };
    let local = step_left + snap.cost.prefill_time_cached(req.prompt_tokens, cached_tokens);
    let split = route.estimate.ttft_us + snap.cost.kv_transfer_time(uncached, snap.link(route.prefill, d.id));
    (local <= split).then(|| Route {
        prefill: d.id,
        decode: d.id,
        reuse: if cached > 0 { vec![Reuse { from: d.id, start: 0, end: cached as u32 }] } else { Vec::new() },
        migrate: false,
        estimate: Estimate { ttft_us: local, tbt_us: route.estimate.tbt_us },
    })
}

/// A policy and an admission control: what the conductor (and the simulator) call per request.
pub struct Scheduler {
    /// The routing policy.
    pub policy: Box<dyn Policy>,
    /// The admission control.
    pub admission: AdmissionConfig,
    /// Conditional disaggregation: the most prompt tokens not cached on a request's decode
    /// instance that it may compute itself (`None`: never; see [`Scheduler::with_conditional`]).
    pub conditional: Option<u64>,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler").field("policy", &self.policy.name()).field("admission", &self.admission).finish()
    }
}

impl Scheduler {
    /// A scheduler.
    pub fn new(policy: Box<dyn Policy>, admission: AdmissionConfig) -> Self {
        Self { policy, admission, conditional: None }
    }

    /// Conditional disaggregation (DistServe's and Mooncake's): a request whose prompt has at
    /// most `max_tokens` tokens not cached on the decode instance the policy chose (a short
    /// prompt, or a session's next turn where its history is) runs whole there, without a
    /// hand-off, when the cost model predicts that is no slower than prefilling on the chosen
    /// prefill instance and moving the KV. Bounding the tokens bounds how long the prefill
    /// stalls the decode instance's batch.
    #[must_use]
    pub fn with_conditional(mut self, max_tokens: Option<u64>) -> Self {
        self.conditional = max_tokens;
        self
    }

    /// The decision for one request: route by the policy, then admit or reject.
    pub fn decide(&mut self, snap: &ClusterSnapshot<'_>, req: &Request, rng: &mut dyn RngCore) -> Decision {
        self.decide_explained(snap, req, rng).0
    }

    /// [`Scheduler::decide`], with the decode check admission made (if it made one), whatever
    /// the decision.
    pub fn decide_explained(
        &mut self,
        snap: &ClusterSnapshot<'_>,
        req: &Request,
        rng: &mut dyn RngCore,
    ) -> (Decision, Option<DecodeCheck>) {
        // Every cache-affine policy looks the prompt up in each instance's tree: start loading
        // the slots of its first block in all of them at once.
        snap.trees.prefetch_prompt(&req.block_hashes);
        let mut d = self.policy.route(snap, req, rng);
        if let (Some(max), Decision::Route(r)) = (self.conditional, &mut d)
            && let Some(local) = run_on_decode(snap, req, r, max)
        {
            *r = local;
        }
        let Decision::Route(r) = &d else { return (d, None) };
        match admit_checked(&self.admission, snap, req, r) {
            (Ok(()), check) => (d, check),
            (Err(RejectReason::Tbt { .. }), _)
                if self.admission.kind == AdmissionKind::Predictive
                    && let Some(other) = predictive_reroute(&self.admission, snap, req, r) =>
            {
                let check = decode_check(&self.admission, snap, req, &other);
                (Decision::Route(other), check)
            }
            (Err(reason), check) => (Decision::Reject { reason }, check),
        }
    }

    /// A role change to make now, if the policy wants one.
    pub fn rebalance(&mut self, snap: &ClusterSnapshot<'_>) -> Option<RoleChange> {
        self.policy.rebalance(snap)
    }
}

#[cfg(test)]
mod tests {
    use baton_kv::InstanceId;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;
    use crate::policy::testutil::{instances, request, snap, trees_for};
    use crate::policy::{LeastLoad, Policy, PolicyKind};
    use crate::{CostProfile, DecodeSeq, IncomingSeq};

    fn sched(kind: AdmissionKind) -> Scheduler {
        let cfg = AdmissionConfig {
            kind,
            slo: Slo { ttft_us: 5_000_000, tbt_us: 40_000 },
            decode_time_us: 10_000_000,
            tbt_headroom: 0.0,
        };
        Scheduler::new(Box::new(LeastLoad), cfg)
    }

    /// Conditional disaggregation: a prompt with few tokens not cached on its decode instance
    /// runs whole there; a long uncached one, or any with the option off, is split.
    #[test]
    fn short_or_mostly_cached_prompts_run_whole_on_their_decode_instance() {
        let cost = CostProfile::llama2_70b_8xa800();
        let inst = instances(1, 1);
        let mut trees = trees_for(&inst);
        let s = snap(inst, &trees, &cost);
        let mut rng = StdRng::seed_from_u64(0);
        let mut route = |sched: &mut Scheduler, s: &ClusterSnapshot<'_>, blocks| {
            let d = sched.decide(s, &request(blocks), &mut rng);
            let r = d.route().expect("routed");
            (r.prefill, r.decode, r.reused_blocks())
        };
        let mut split = Scheduler::new(Box::new(LeastLoad), AdmissionConfig::default());
        assert_eq!(route(&mut split, &s, 1), (InstanceId(0), InstanceId(1), 0), "off: always split");
        let mut conditional =
            Scheduler::new(Box::new(LeastLoad), AdmissionConfig::default()).with_conditional(Some(1024));
        assert_eq!(route(&mut conditional, &s, 1), (InstanceId(1), InstanceId(1), 0), "a short prompt");
        assert_eq!(route(&mut conditional, &s, 8).0, InstanceId(0), "4,096 tokens: split");
        // The decode instance caches 7 of the 8 blocks (a session's history): one is left.
        trees.predict(InstanceId(1), &request(8).block_hashes[..7], 0);
        let s = snap(instances(1, 1), &trees, &cost);
        assert_eq!(route(&mut conditional, &s, 8), (InstanceId(1), InstanceId(1), 7), "mostly cached there");
    }

    #[test]
    fn ttft_over_slo_is_rejected_by_every_control_but_none() {
        let cost = CostProfile::llama2_70b_8xa800();
        let mut inst = instances(1, 1);
        inst[0].queued_prefill_us = 10_000_000;
        let trees = trees_for(&inst);
        let s = snap(inst, &trees, &cost);
        let mut rng = StdRng::seed_from_u64(0);
        assert!(sched(AdmissionKind::None).decide(&s, &request(4), &mut rng).route().is_some());
        for k in [AdmissionKind::Baseline, AdmissionKind::EarlyRejection, AdmissionKind::Predictive] {
            let d = sched(k).decide(&s, &request(4), &mut rng);
            assert!(matches!(d, Decision::Reject { reason: RejectReason::Ttft { .. } }), "{k:?}: {d:?}");
        }
    }

    #[test]
    fn early_rejection_looks_at_current_decode_load_and_predictive_at_future_load() {
        let cost = CostProfile::llama2_70b_8xa800();
        // The decode instance is busy now (64 sequences of 20k), but all of them started long
        // ago and will be gone by the time this prefill finishes.
        let mut inst = instances(1, 1);
        inst[1].decode_running = vec![DecodeSeq::new(0, 20_000); 64];
        let trees = trees_for(&inst);
        let mut s = snap(inst.clone(), &trees, &cost);
        s.now = 9_999_000;
        let mut rng = StdRng::seed_from_u64(0);
        let req = request(4);
        assert!(matches!(
            sched(AdmissionKind::EarlyRejection).decide(&s, &req, &mut rng),
            Decision::Reject { reason: RejectReason::Tbt { .. } }
        ));
        assert!(sched(AdmissionKind::Baseline).decide(&s, &req, &mut rng).route().is_some());
        assert!(sched(AdmissionKind::Predictive).decide(&s, &req, &mut rng).route().is_some());

        // Conversely: idle now, but many requests are about to arrive from prefill.
        inst[1].decode_running.clear();
        inst[1].decode_incoming = vec![IncomingSeq::new(10_000_000, 20_000); 64].into();
        let mut s = snap(inst, &trees, &cost);
        s.now = 9_999_000;
        assert!(matches!(
            sched(AdmissionKind::Predictive).decide(&s, &req, &mut rng),
            Decision::Reject { reason: RejectReason::Tbt { .. } }
        ));
        let d = &s.instances[1];
        assert!(predicted_tbt_at(&s, d, 9_999_999, 1, 0, 0) < predicted_tbt_at(&s, d, 10_000_000, 1, 0, 0));
    }

    /// Admission keeps `tbt_headroom` of the TBT target free: a decode step predicted just
    /// under the target is admitted without headroom and refused with a tenth kept free.
    #[test]
    fn admission_keeps_the_tbt_headroom_free() {
        let cost = CostProfile::llama2_70b_8xa800();
        let mut inst = instances(1, 1);
        inst[1].decode_running = vec![DecodeSeq::new(0, 2_000); 16];
        let trees = trees_for(&inst);
        let s = snap(inst, &trees, &cost);
        let req = request(4);
        let step = tbt_now(&s, &s.instances[1], 1, req.prompt_tokens);
        let mut rng = StdRng::seed_from_u64(0);
        for kind in [AdmissionKind::EarlyRejection, AdmissionKind::Predictive] {
            // The target 5% above the predicted step.
            let slo = Slo { ttft_us: 60_000_000, tbt_us: step + step / 20 };
            let cfg = |tbt_headroom| AdmissionConfig { kind, slo, decode_time_us: 600_000_000, tbt_headroom };
            let mut bare = Scheduler::new(Box::new(LeastLoad), cfg(0.0));
            assert!(bare.decide(&s, &req, &mut rng).route().is_some(), "{kind:?}: under the target");
            let mut kept = Scheduler::new(Box::new(LeastLoad), cfg(0.1));
            let d = kept.decide(&s, &req, &mut rng);
            assert!(matches!(d, Decision::Reject { reason: RejectReason::Tbt { .. } }), "{kind:?}: {d:?}");
        }
    }

    /// A decode instance full now whose batch will have finished by the time this request's
    /// KV gets there (two tokens left each, a quarter of a second of prefill ahead): early
    /// rejection refuses, predictive admission admits. Without the remaining output (the
    /// uniform `t_d` of 10 s, all of them just started) predictive refuses too.
    #[test]
    fn load_high_now_but_drained_by_arrival_predictive_admits_early_rejects() {
        let cost = CostProfile::llama2_70b_8xa800();
        let mut inst = instances(1, 1);
        let busy = DecodeSeq { started_at: 0, context: 20_000, remaining: Some(2) };
        inst[1].decode_running = vec![busy; 64];
        let trees = trees_for(&inst);
        let s = snap(inst.clone(), &trees, &cost);
        let mut rng = StdRng::seed_from_u64(0);
        let req = request(4);
        assert!(tbt_now(&s, &s.instances[1], 1, req.prompt_tokens) > 40_000, "over the target now");
        let d = sched(AdmissionKind::EarlyRejection).decide(&s, &req, &mut rng);
        assert!(matches!(d, Decision::Reject { reason: RejectReason::Tbt { .. } }), "{d:?}");
        let d = sched(AdmissionKind::Predictive).decide(&s, &req, &mut rng);
        assert_eq!(d.route().map(|r| r.decode), Some(InstanceId(1)), "{d:?}");

        inst[1].decode_running = vec![DecodeSeq::new(0, 20_000); 64];
        let s = snap(inst, &trees, &cost);
        let d = sched(AdmissionKind::Predictive).decide(&s, &req, &mut rng);
        assert!(matches!(d, Decision::Reject { reason: RejectReason::Tbt { .. } }), "{d:?}");
    }

    /// The converse: a decode instance idle now, but requests admitted before this one are on
    /// their way, long to decode. Early rejection admits; predictive refuses, both when they
    /// arrive before this request's KV and when they arrive while it would still be decoding
    /// (the decode side would then turn them away after their prefill).
    #[test]
    fn load_low_now_but_admitted_requests_arriving_predictive_rejects_early_admits() {
        let cost = CostProfile::llama2_70b_8xa800();
        let mut rng = StdRng::seed_from_u64(0);
        let req = request(4);
        // Before this request's KV (a quarter of a second of prefill), and 2 s later: within
        // its 100 tokens at up to 40 ms.
        for ready_at in [100_000, 2_000_000] {
            let mut inst = instances(1, 1);
            let coming = IncomingSeq { ready_at, context: 20_000, output: Some(1_000) };
            inst[1].decode_incoming = vec![coming; 64].into();
            let trees = trees_for(&inst);
            let s = snap(inst, &trees, &cost);
            assert!(sched(AdmissionKind::EarlyRejection).decide(&s, &req, &mut rng).route().is_some());
            let d = sched(AdmissionKind::Predictive).decide(&s, &req, &mut rng);
            assert!(matches!(d, Decision::Reject { reason: RejectReason::Tbt { .. } }), "{ready_at}: {d:?}");
        }
        // Arriving after it would have finished: no matter.
        let mut inst = instances(1, 1);
        inst[1].decode_incoming = vec![IncomingSeq { ready_at: 60_000_000, context: 20_000, output: None }; 64].into();
        let trees = trees_for(&inst);
        let s = snap(inst, &trees, &cost);
        assert!(sched(AdmissionKind::Predictive).decide(&s, &req, &mut rng).route().is_some());
    }

    /// Predictive admission weighs the decode pool: when the policy's decode instance stays
    /// full, the one that will have drained takes the request. Early rejection, seeing both
    /// full now, refuses.
    #[test]
    fn predictive_admission_moves_the_decode_to_the_instance_that_will_have_room() {
        let cost = CostProfile::llama2_70b_8xa800();
        let mut inst = instances(1, 2);
        inst[1].decode_running = vec![DecodeSeq { started_at: 0, context: 20_000, remaining: Some(1_000) }; 64];
        inst[2].decode_running = vec![DecodeSeq { started_at: 0, context: 20_000, remaining: Some(2) }; 64];
        let trees = trees_for(&inst);
        let s = snap(inst, &trees, &cost);
        let mut rng = StdRng::seed_from_u64(0);
        let req = request(4);
        assert_eq!(LeastLoad.route(&s, &req, &mut rng).route().map(|r| r.decode), Some(InstanceId(1)));
        let d = sched(AdmissionKind::EarlyRejection).decide(&s, &req, &mut rng);
        assert!(matches!(d, Decision::Reject { reason: RejectReason::Tbt { .. } }), "{d:?}");
        let d = sched(AdmissionKind::Predictive).decide(&s, &req, &mut rng);
        assert_eq!(d.route().map(|r| r.decode), Some(InstanceId(2)), "{d:?}");
    }

    /// The peak over a window: sequences leave after their remaining output at the current
    /// step, incoming ones join at their ready time and leave after theirs.
    #[test]
    fn predicted_peak_follows_joins_and_departures() {
        let cost = CostProfile::llama2_70b_8xa800();
        let mut inst = instances(0, 1);
        inst[0].decode_running = vec![DecodeSeq { started_at: 0, context: 1_000, remaining: Some(10) }];
        inst[0].decode_incoming = vec![IncomingSeq { ready_at: 1_000_000, context: 1_000, output: Some(10) }].into();
        let trees = trees_for(&inst);
        let s = snap(inst, &trees, &cost);
        let d = &s.instances[0];
        let one = cost.decode_step(1, 1_000);
        // The running one leaves after 10 steps (~110 ms); the incoming one joins at 1 s.
        assert_eq!(predicted_tbt_at(&s, d, 0, 0, 0, 0), one);
        assert_eq!(predicted_tbt_at(&s, d, 500_000, 0, 0, 0), 0, "nobody between");
        assert_eq!(predicted_tbt_at(&s, d, 1_000_000, 0, 0, 0), one);
        assert_eq!(predicted_peak_tbt(&s, d, (500_000, 2_000_000), 0, 0, 0), one, "the incoming one");
        assert_eq!(predicted_peak_tbt(&s, d, (0, 2_000_000), 0, 1, 0), cost.decode_step(2, 1_000));
        assert_eq!(predicted_tbt_at(&s, d, 3_000_000, 0, 0, 0), 0, "both gone");
    }

    #[test]
    fn names_parse() {
        for k in AdmissionKind::ALL {
            assert_eq!(k.name().parse::<AdmissionKind>(), Ok(k));
        }
        for k in PolicyKind::ALL {
            assert_eq!(k.name().parse::<PolicyKind>().ok(), Some(k));
        }
        assert!("nope".parse::<PolicyKind>().is_err());
        let _ = InstanceId(0);
    }
}
