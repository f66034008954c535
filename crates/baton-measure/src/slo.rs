//! Latency targets (SLOs) and what meeting them means, for a live run and a simulated one alike.

use serde::{Deserialize, Serialize};

/// Which per-request time between tokens the TBT target bounds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TbtStat {
    /// TPOT, the request's mean time between tokens (DistServe, vLLM's goodput; the simulator's
    /// only one).
    #[default]
    Mean,
    /// The request's 90th-percentile gap between chunks.
    P90,
    /// The request's longest gap between chunks (the strictest reading).
    Max,
}

impl std::str::FromStr for TbtStat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "mean" | "tpot" => Ok(TbtStat::Mean),
            "p90" => Ok(TbtStat::P90),
            "max" => Ok(TbtStat::Max),
            _ => Err(format!("expected mean, p90 or max, got {s:?}")),
        }
    }
}

/// Latency targets; a target not set is met by every request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    /// Time to first token, ms.
    pub ttft_ms: Option<f64>,
    /// Time between tokens, ms.
    pub tbt_ms: Option<f64>,
    /// Which per-request statistic `tbt_ms` bounds.
    pub tbt_stat: TbtStat,
}

impl Slo {
    /// Whether any target is set.
    pub fn is_set(&self) -> bool {
        self.ttft_ms.is_some() || self.tbt_ms.is_some()
    }

    /// Whether a *completed* request met every target set, given its time to first token and
    /// its time between tokens as [`Slo::tbt_stat`] reads it, both µs. A request without a first
    /// token misses a TTFT target; one of a single token has no time between tokens
    /// (`tbt_us: None`), so nothing to miss. (A request that did not complete met nothing: the
    /// caller does not ask.)
    pub fn met_by(&self, ttft_us: Option<u64>, tbt_us: Option<f64>) -> bool {
        let ttft_ok = match (self.ttft_ms, ttft_us) {
            (None, _) => true,
            (Some(limit), Some(t)) => t as f64 / 1e3 <= limit,
            (Some(_), None) => false,
        };
        let tbt_ok = match (self.tbt_ms, tbt_us) {
            (Some(limit), Some(t)) => t / 1e3 <= limit,
            _ => true,
        };
        ttft_ok && tbt_ok
    }
}

/// SLO attainment: the requests that completed and met every target, over all requests sent
/// (rejected and failed ones included: Mooncake's definition, where such a request counts for
/// nothing); 0 of none.
pub fn attainment(met: usize, sent: usize) -> f64 {
    if sent == 0 { 0.0 } else { met as f64 / sent as f64 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_met_at_the_limit_and_unset_ones_always() {
        let slo = Slo { ttft_ms: Some(200.0), tbt_ms: Some(25.0), tbt_stat: TbtStat::Mean };
        assert!(slo.met_by(Some(200_000), Some(25_000.0)), "at the limit is within it");
        assert!(!slo.met_by(Some(200_001), Some(1.0)));
        assert!(!slo.met_by(Some(1), Some(25_000.5)));
        assert!(!slo.met_by(None, None), "no first token misses a TTFT target");
        assert!(slo.met_by(Some(1), None), "one token: no time between tokens to miss");
        assert!(Slo::default().met_by(None, Some(1e12)) && !Slo::default().is_set());
        assert_eq!("tpot".parse::<TbtStat>(), Ok(TbtStat::Mean));
        assert!("p99".parse::<TbtStat>().is_err());
        assert_eq!((attainment(3, 4), attainment(0, 0)), (0.75, 0.0));
    }
}
