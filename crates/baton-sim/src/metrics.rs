//! The report: the benchmark's metrics schema (TTFT, TBT, JCT percentiles, SLO attainment,
//! goodput, rejections, wasted prefill), as JSON.

use baton_measure::{TbtStat, attainment, percentile};
use baton_sched::{Micros, RoleChange, Slo};
use serde::Serialize;

/// Mean and percentiles of a latency, microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Samples.
    pub count: usize,
    /// Mean.
    pub mean: Micros,
    /// Median.
    pub p50: Micros,
    /// 90th percentile.
    pub p90: Micros,
    /// 99th percentile.
    pub p99: Micros,
    /// Maximum.
    pub max: Micros,
}

impl Percentiles {
    /// Of a set of samples, in any order. The percentiles are [`baton_measure::percentile`]'s,
    /// the definition `baton bench serve` reports live, rounded to the microsecond of the
    /// simulator's clock; the mean is truncated to it.
    pub fn of(mut v: Vec<Micros>) -> Self {
        if v.is_empty() {
            return Self::default();
        }
        v.sort_unstable();
        let n = v.len();
        let at = |q: f64| percentile(&v, q).round() as Micros;
        let sum: u128 = v.iter().map(|&x| u128::from(x)).sum();
        Self { count: n, mean: (sum / n as u128) as Micros, p50: at(50.0), p90: at(90.0), p99: at(99.0), max: v[n - 1] }
    }
}

/// A role change the simulated cluster made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RoleChangeAt {
    /// When.
    pub at_us: Micros,
    /// Instance id.
    pub instance: u32,
    /// Old role.
    pub from: String,
    /// New role.
    pub to: String,
}

impl RoleChangeAt {
    pub(crate) fn new(at_us: Micros, c: RoleChange) -> Self {
        Self { at_us, instance: c.instance.0, from: format!("{:?}", c.from), to: format!("{:?}", c.to) }
    }
}

/// What one simulation measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// Policy name.
    pub policy: String,
    /// Admission control name.
    pub admission: String,
    /// Instances per role at the start: (prefill, decode, colocated).
    pub instances: (usize, usize, usize),
    /// Seed.
    pub seed: u64,
    /// The SLOs attainment is measured against.
    pub slo_ttft_us: Micros,
    /// TBT SLO.
    pub slo_tbt_us: Micros,
    /// Requests in the workload.
    pub requests: usize,
    /// Requests that produced every token.
    pub completed: usize,
    /// Turned away at arrival by the scheduler (no work done).
    pub rejected_early: usize,
    /// Turned away by the decode instance after their prefill ran (work wasted).
    pub rejected_after_prefill: usize,
    /// Time to first token of completed requests.
    pub ttft: Percentiles,
    /// Mean time between tokens of each completed request, as its client sees them: first
    /// token to last, over the tokens after the first (`baton bench serve`'s per-request TPOT).
    /// A disaggregated request's KV transfer and its wait to join the decode batch fall between
    /// its first and second tokens, so they count here.
    pub tbt: Percentiles,
    /// Arrival to last token of completed requests.
    pub jct: Percentiles,
    /// Fraction of *all* requests completed with TTFT within the SLO.
    pub ttft_slo_attainment: f64,
    /// Fraction of *all* requests completed within both SLOs.
    pub slo_attainment: f64,
    /// Requests completed within both SLOs.
    pub completed_within_slo: usize,
    /// Requests completed within both SLOs per second of makespan.
    pub goodput_rps: f64,
    /// Output tokens of requests completed within both SLOs, per second of makespan.
    pub goodput_tokens_per_s: f64,
    /// Prefill compute spent on requests later rejected.
    pub wasted_prefill_us: Micros,
    /// Prompt tokens computed for requests later rejected.
    pub wasted_prefill_tokens: u64,
    /// Prompt tokens reused from a cache (local or fetched) over prompt tokens of started prefills.
    pub cache_hit_ratio: f64,
    /// KV fetched from another instance's cache before a prefill: count.
    pub cache_transfers: usize,
    /// Requests run whole on a decode instance (conditional disaggregation).
    pub run_on_decode: usize,
    /// Role changes made (load-aware policy).
    pub role_changes: Vec<RoleChangeAt>,
    /// Virtual time from the first arrival to the last completion.
    pub makespan_us: Micros,
    /// Events processed.
    pub events: u64,
    /// One record per request, in workload order, when [`SimConfig::records`](crate::SimConfig)
    /// asks (else empty, and absent from the JSON): where it ran and what it found cached, to
    /// set beside a live run's per-request records.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub records: Vec<RequestRecord>,
    /// Every completed request's TTFT, sorted (for CDF plots; not in the JSON).
    #[serde(skip)]
    pub ttft_samples_us: Vec<Micros>,
    /// Every completed request's JCT, sorted (not in the JSON).
    #[serde(skip)]
    pub jct_samples_us: Vec<Micros>,
    /// The load over time, when [`SimConfig::load_trace_us`](crate::SimConfig) asks (not in
    /// the JSON: see [`LoadTrace::samples_csv`](crate::LoadTrace::samples_csv)).
    #[serde(skip)]
    pub load_trace: crate::LoadTrace,
}

/// What happened to one request of the workload (times in µs of virtual time).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RequestRecord {
    /// Index in the workload.
    pub id: usize,
    /// Arrival.
    pub arrival_us: Micros,
    /// The prefill instance the policy chose (`None`: rejected at arrival).
    pub prefill: Option<u32>,
    /// The decode instance it chose.
    pub decode: Option<u32>,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens found in the prefill instance's own cache when its prefill began.
    pub cached_tokens: u64,
    /// Prompt tokens fetched from other instances' caches before the prefill.
    pub fetched_tokens: u64,
    /// When its prefill began (after its queue).
    pub prefill_start_us: Option<Micros>,
    /// Time to first token (the end of its prefill).
    pub ttft_us: Option<Micros>,
    /// Arrival to last token.
    pub jct_us: Option<Micros>,
}

/// Per-request outcome the simulator records.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Outcome {
    pub(crate) first_token_us: Option<Micros>,
    pub(crate) done_us: Option<Micros>,
    pub(crate) decode_start_us: Option<Micros>,
    pub(crate) rejected_early: bool,
    pub(crate) rejected_late: bool,
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn summarise(
    policy: &str,
    admission: &str,
    instances: (usize, usize, usize),
    seed: u64,
    slo: Slo,
    arrivals: &[(Micros, u64)],
    outcomes: &[Outcome],
    extra: Extra,
    records: Vec<RequestRecord>,
) -> Report {
    let (mut ttft, mut tbt, mut jct) = (Vec::new(), Vec::new(), Vec::new());
    let (mut ttft_ok, mut both_ok, mut good_tokens) = (0usize, 0usize, 0u64);
    // The scheduler's targets, met as `baton bench serve` meets them live.
    let ms = |us: Micros| Some(us as f64 / 1e3);
    let both = baton_measure::Slo { ttft_ms: ms(slo.ttft_us), tbt_ms: ms(slo.tbt_us), tbt_stat: TbtStat::Mean };
    let ttft_only = baton_measure::Slo { tbt_ms: None, ..both };
    let mut last = 0;
    for (o, &(arrival, output)) in outcomes.iter().zip(arrivals) {
        let (Some(first), Some(done)) = (o.first_token_us, o.done_us) else { continue };
        last = last.max(done);
        let t = first - arrival;
        let b = if output > 1 && o.decode_start_us.is_some() { (done - first) / (output - 1) } else { 0 };
        ttft.push(t);
        tbt.push(b);
        jct.push(done - arrival);
        ttft_ok += usize::from(ttft_only.met_by(Some(t), None));
        if both.met_by(Some(t), Some(b as f64)) {
            both_ok += 1;
            good_tokens += output;
        }
    }
    let n = outcomes.len();
    let first = arrivals.first().map_or(0, |a| a.0);
    let makespan = last.saturating_sub(first);
    let secs = (makespan as f64 / 1e6).max(1e-9);
    let sorted = |v: &[Micros]| {
        let mut v = v.to_vec();
        v.sort_unstable();
        v
    };
    let (ttft_samples_us, jct_samples_us) = (sorted(&ttft), sorted(&jct));
    Report {
        policy: policy.to_owned(),
        admission: admission.to_owned(),
        instances,
        seed,
        slo_ttft_us: slo.ttft_us,
        slo_tbt_us: slo.tbt_us,
        requests: outcomes.len(),
        completed: jct.len(),
        rejected_early: outcomes.iter().filter(|o| o.rejected_early).count(),
        rejected_after_prefill: outcomes.iter().filter(|o| o.rejected_late).count(),
        ttft: Percentiles::of(ttft),
        tbt: Percentiles::of(tbt),
        jct: Percentiles::of(jct),
        ttft_slo_attainment: attainment(ttft_ok, n),
        slo_attainment: attainment(both_ok, n),
        completed_within_slo: both_ok,
        goodput_rps: both_ok as f64 / secs,
        goodput_tokens_per_s: good_tokens as f64 / secs,
        wasted_prefill_us: extra.wasted_prefill_us,
        wasted_prefill_tokens: extra.wasted_prefill_tokens,
        cache_hit_ratio: if extra.prefilled_tokens == 0 {
            0.0
        } else {
            extra.reused_tokens as f64 / extra.prefilled_tokens as f64
        },
        cache_transfers: extra.cache_transfers,
        run_on_decode: extra.run_on_decode,
        role_changes: extra.role_changes,
        makespan_us: makespan,
        events: extra.events,
        records,
        ttft_samples_us,
        jct_samples_us,
        load_trace: crate::LoadTrace::default(),
    }
}

/// Counters the simulator keeps besides per-request outcomes.
#[derive(Debug, Clone, Default)]
pub(crate) struct Extra {
    pub(crate) wasted_prefill_us: Micros,
    pub(crate) wasted_prefill_tokens: u64,
    pub(crate) prefilled_tokens: u64,
    pub(crate) reused_tokens: u64,
    pub(crate) cache_transfers: usize,
    pub(crate) run_on_decode: usize,
    pub(crate) role_changes: Vec<RoleChangeAt>,
    pub(crate) events: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shared definition, rounded to the microsecond: of 1..=100, p50 is 50.5 (51), p90 90.1
    /// and p99 99.01 (nearest rank said 50, 90, 99).
    #[test]
    fn percentiles_interpolate_and_round_to_the_microsecond() {
        let p = Percentiles::of((1..=100).rev().collect());
        assert_eq!((p.count, p.mean, p.p50, p.p90, p.p99, p.max), (100, 50, 51, 90, 99, 100));
        let p = Percentiles::of(vec![100, 200, 1_000]);
        assert_eq!((p.p50, p.p90, p.p99), (200, 840, 984), "200 + 0.8 · 800; 200 + 0.98 · 800");
        assert_eq!(Percentiles::of(vec![]), Percentiles::default());
    }

    /// A request's TBT is its client's: the wait between its first token (from the prefill
    /// instance) and joining the decode batch counts, as `baton bench serve` measures it live.
    /// Before, the simulator counted only the decode steps, and a decode instance whose queue
    /// grew without bound met any TBT target.
    #[test]
    fn tbt_counts_the_wait_after_the_first_token() {
        // First token at 100 µs; decoding starts 1 ms later; 9 more tokens 10 µs apart.
        let o = Outcome {
            first_token_us: Some(100),
            done_us: Some(1_190),
            decode_start_us: Some(1_100),
            ..Outcome::default()
        };
        let slo = Slo { ttft_us: 1_000, tbt_us: 100 };
        let r = summarise("p", "none", (1, 1, 0), 0, slo, &[(0, 10)], &[o], Extra::default(), Vec::new());
        assert_eq!(r.tbt.p50, 121, "(1,190 − 100) / 9");
        assert_eq!(r.completed_within_slo, 0, "121 µs is over the 100 µs target");
    }
}
