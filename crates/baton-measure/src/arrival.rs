//! Poisson arrivals: the open-loop process both the load generator and the simulator send
//! requests by.

/// A Poisson arrival process on a clock of seconds: arrivals `rate` per second on average, the
/// gaps between them exponential, drawn by inverse transform (`−ln(u) / rate`) from uniforms
/// the caller draws.
///
/// The caller draws because each side has its own seeded stream and keeps it, so that a seed
/// gives the arrivals it gave before: `baton bench serve` a SplitMix64 stream (stable across
/// platforms and library versions), `baton sim` a `rand::StdRng` it also draws lengths from.
/// And this way the process holds no RNG of its own.
///
/// ```
/// use baton_measure::Poisson;
///
/// let mut p = Poisson::new(2.0);
/// assert_eq!(p.advance(1.0), 0.0, "u = 1: no wait");
/// let t = p.advance((-1.0f64).exp());
/// assert!((t - 0.5).abs() < 1e-12, "u = 1/e: one mean gap, 1/rate");
/// assert_eq!(p.now_s(), t);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Poisson {
    rate: f64,
    now_s: f64,
}

impl Poisson {
    /// A process of `rate` arrivals per second, its clock at 0.
    ///
    /// # Panics
    ///
    /// If `rate` is not positive (or is NaN): a caller validates its configuration first.
    pub fn new(rate: f64) -> Self {
        assert!(rate > 0.0, "a Poisson rate must be positive, got {rate}");
        Self { rate, now_s: 0.0 }
    }

    /// Moves the clock on by one gap, drawn from `u`, a uniform in (0, 1]; returns the time of
    /// the arrival it ends at, in seconds from the start.
    pub fn advance(&mut self, u: f64) -> f64 {
        self.now_s += -u.ln() / self.rate;
        self.now_s
    }

    /// The time of the last arrival (0 before the first gap), seconds from the start.
    pub fn now_s(&self) -> f64 {
        self.now_s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gaps of evenly spread uniforms average 1 / rate.
    #[test]
    fn gaps_average_one_over_the_rate() {
        let mut p = Poisson::new(4.0);
        let n = 100_000;
        for i in 0..n {
            p.advance((i as f64 + 0.5) / n as f64);
        }
        let mean_gap = p.now_s() / n as f64;
        assert!((mean_gap - 0.25).abs() < 1e-3, "{mean_gap}");
    }

    #[test]
    #[should_panic(expected = "positive")]
    fn a_rate_of_zero_is_refused() {
        Poisson::new(0.0);
    }
}
