//! Admission control (Mooncake §6) and the [`Scheduler`] that puts policy and admission together.
//!
//! - [`AdmissionKind::None`]: every request is admitted.
//! - [`AdmissionKind::Baseline`]: Mooncake Table 2's baseline: the prefill side checks its TTFT
//!   before the prefill, the decode side checks its own load only when the KV arrives (the
//!   executor does that check; a rejection there wastes the prefill).
//! - [`AdmissionKind::EarlyRejection`] (§6.2): before the prefill, reject if the predicted TTFT or
//!   the chosen decode instance's *current* load (its TBT with its running and waiting requests
//!   and this one) is over the SLO.
//! - [`AdmissionKind::Predictive`] (§6.4, system level): like early rejection, but the decode load
//!   is predicted for the moment the prefill finishes: every running decode is assumed to take a
//!   uniform `t_d` and leaves when that has passed; requests already routed to the instance whose
//!   KV is ready by then join.
//!
//! Mooncake states both checks for the decode *pool*; with least-loaded decode selection the
//! chosen instance is the pool's best, and checking it is what the decode instance itself will
//! check when the KV arrives.

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

/// Predicted TBT of a decode instance at time `at` (system-level, uniform decode time `t_d`),
/// with `extra` more sequences of `extra_context` tokens in all.
pub fn predicted_tbt_at(
    snap: &ClusterSnapshot<'_>,
    d: &InstanceSnapshot,
    at: Micros,
    t_d: Micros,
    extra: u64,
    extra_context: u64,
) -> Micros {
    let staying = d.decode_running.iter().filter(|s| s.started_at + t_d > at);
    let (joining, joining_ctx) = d.decode_incoming.ready_by(at);
    let (mut batch, mut ctx) = (u64::from(d.decode_waiting) + extra + joining, extra_context + joining_ctx);
    for s in staying {
        batch += 1;
        ctx += s.context;
    }
    d.decode_step(snap.cost, batch, ctx)
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
    /// The predicted decode step (TBT) with this request, µs.
    pub load_us: Micros,
    /// The most admission allows, µs (the TBT target less its headroom).
    pub limit_us: Micros,
}

impl DecodeCheck {
    /// Whether the request passes.
    pub fn passes(&self) -> bool {
        self.load_us <= self.limit_us
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
    let (at, load_us) = match cfg.kind {
        AdmissionKind::None | AdmissionKind::Baseline => return None,
        AdmissionKind::EarlyRejection => (snap.now, tbt_now(snap, d, 1, req.prompt_tokens)),
        AdmissionKind::Predictive => {
            let at = snap.now + route.estimate.ttft_us;
            (at, predicted_tbt_at(snap, d, at, cfg.decode_time_us, 1, req.prompt_tokens))
        }
    };
    let limit_us = (cfg.slo.tbt_us as f64 * (1.0 - cfg.tbt_headroom.clamp(0.0, 0.9))) as Micros;
    Some(DecodeCheck { decode: d.id, at, load_us, limit_us })
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
        let mut d = self.policy.route(snap, req, rng);
        if let (Some(max), Decision::Route(r)) = (self.conditional, &mut d)
            && let Some(local) = run_on_decode(snap, req, r, max)
        {
            *r = local;
        }
        match &d {
            Decision::Route(r) => match admit_checked(&self.admission, snap, req, r) {
                (Ok(()), check) => (d, check),
                (Err(reason), check) => (Decision::Reject { reason }, check),
            },
            Decision::Reject { .. } => (d, None),
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
    use crate::policy::{LeastLoad, PolicyKind};
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
        inst[1].decode_running = vec![DecodeSeq { started_at: 0, context: 20_000 }; 64];
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
        inst[1].decode_incoming = vec![IncomingSeq { ready_at: 10_000_000, context: 20_000 }; 64].into();
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
        inst[1].decode_running = vec![DecodeSeq { started_at: 0, context: 2_000 }; 16];
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
