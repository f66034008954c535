//! The percentile definition and the statistics of a set of samples.

use serde::{Deserialize, Serialize};

/// A sample value: what [`percentile`] can read (floating-point figures, or whole
/// microseconds of virtual time).
pub trait Sample: Copy {
    /// The value, as a float.
    fn value(self) -> f64;
}

impl Sample for f64 {
    fn value(self) -> f64 {
        self
    }
}

impl Sample for u64 {
    fn value(self) -> f64 {
        self as f64
    }
}

/// The `q`-th percentile (`q` in 0..=100, clamped) of samples sorted in ascending order,
/// interpolating linearly between the two closest ranks: with `h = (n − 1) · q / 100`, it is
/// `x[⌊h⌋] + (h − ⌊h⌋) · (x[⌈h⌉] − x[⌊h⌋])`. This is Hyndman and Fan's type 7: numpy's
/// `percentile` default, R's `quantile` default, Excel's `PERCENTILE.INC`; the median of an even
/// count is the mean of the middle two, as Python's `statistics.median` has it.
///
/// Why this one and not nearest rank (`x[⌈q·n/100⌉ − 1]`, which the simulator used before, or the
/// floored and rounded ranks some benches used): Baton's live figures are set beside other
/// tools' on the same server, and those interpolate — `vllm bench serve` takes `np.percentile`,
/// aiperf (`scripts/bench-crosscheck.sh`) numpy too. With one definition everywhere, a live p90
/// and a simulated p90 of the same samples are the same number. Its cost: a percentile may fall
/// between two samples, so of whole microseconds it can be fractional (the simulator rounds it
/// to the microsecond, its clock's resolution).
///
/// # Panics
///
/// If `sorted` is empty. Debug builds also check that it is sorted.
pub fn percentile<T: Sample>(sorted: &[T], q: f64) -> f64 {
    assert!(!sorted.is_empty(), "the percentile of no samples");
    debug_assert!(sorted.windows(2).all(|w| w[0].value() <= w[1].value()), "samples not sorted");
    let rank = (q / 100.0).clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    let (a, b) = (sorted[lo].value(), sorted[hi].value());
    a + (b - a) * (rank - lo as f64)
}

/// The distribution of one metric: count, mean, the p50 / p90 / p99 of [`percentile`], min and
/// max.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// Values.
    pub count: usize,
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
}

impl Stats {
    /// Statistics of `values`, in any order (all zero when empty).
    pub fn of(values: &[f64]) -> Stats {
        if values.is_empty() {
            return Stats::default();
        }
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        Stats::of_sorted(&v)
    }

    /// Statistics of samples sorted in ascending order (all zero when empty).
    pub fn of_sorted<T: Sample>(sorted: &[T]) -> Stats {
        let (Some(&first), Some(&last)) = (sorted.first(), sorted.last()) else {
            return Stats::default();
        };
        Stats {
            count: sorted.len(),
            mean: sorted.iter().map(|x| x.value()).sum::<f64>() / sorted.len() as f64,
            p50: percentile(sorted, 50.0),
            p90: percentile(sorted, 90.0),
            p99: percentile(sorted, 99.0),
            min: first.value(),
            max: last.value(),
        }
    }
}

/// At most about `n` points of the empirical CDF of samples sorted in ascending order, as
/// (value, fraction of the samples up to it), for plots: every k-th sample (k = ⌈len / n⌉) and
/// the last, at fraction 1.
pub fn cdf_points<T: Sample>(sorted: &[T], n: usize) -> Vec<(f64, f64)> {
    let len = sorted.len();
    let step = len.div_ceil(n.max(1)).max(1);
    let mut points: Vec<(f64, f64)> =
        (0..len).step_by(step).map(|i| (sorted[i].value(), (i + 1) as f64 / len as f64)).collect();
    if len > 0 && !(len - 1).is_multiple_of(step) {
        points.push((sorted[len - 1].value(), 1.0));
    }
    points
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    /// Small inputs whose percentiles are known by hand (and agree with numpy's
    /// `np.percentile`).
    #[test]
    fn percentiles_interpolate_between_the_closest_ranks() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert!(close(percentile(&v, 50.0), 2.5), "mean of the middle two");
        assert!(close(percentile(&v, 0.0), 1.0));
        assert!(close(percentile(&v, 100.0), 4.0));
        assert!(close(percentile(&v, 90.0), 3.7), "h = 2.7: 3 + 0.7 · (4 − 3)");
        assert!(close(percentile(&v, 25.0), 1.75));
        let ten: Vec<f64> = (1..=10).map(f64::from).collect();
        assert!(close(percentile(&ten, 99.0), 9.91));
        assert!(close(percentile(&ten, 90.0), 9.1), "nearest rank would say 9");
        assert!(close(percentile(&[5.0], 90.0), 5.0), "one sample is every percentile");
        // Whole microseconds read the same as their floats.
        let us: Vec<u64> = (1..=100).collect();
        assert!(close(percentile(&us, 50.0), 50.5));
        assert!(close(percentile(&us, 90.0), 90.1));
        assert!(close(percentile(&us, 99.0), 99.01));
        // Out-of-range q is clamped.
        assert!(close(percentile(&v, -5.0), 1.0) && close(percentile(&v, 150.0), 4.0));
        // Equal samples: that value.
        assert!(close(percentile(&[7u64, 7, 7], 90.0), 7.0));
    }

    #[test]
    #[should_panic(expected = "no samples")]
    fn no_samples_have_no_percentile() {
        percentile::<f64>(&[], 50.0);
    }

    #[test]
    fn cdf_points_thin_the_samples_and_end_at_one() {
        let v: Vec<u64> = (1..=10).collect();
        assert_eq!(cdf_points(&v, 4), [(1.0, 0.1), (4.0, 0.4), (7.0, 0.7), (10.0, 1.0)]);
        assert_eq!(cdf_points(&v, 3), [(1.0, 0.1), (5.0, 0.5), (9.0, 0.9), (10.0, 1.0)], "the last added");
        assert_eq!(cdf_points(&v[..2], 2000), [(1.0, 0.5), (2.0, 1.0)]);
        assert!(cdf_points::<f64>(&[], 10).is_empty());
    }

    #[test]
    fn stats_of_unsorted_values() {
        let s = Stats::of(&[4.0, 1.0, 3.0, 2.0]);
        assert_eq!((s.count, s.min, s.max), (4, 1.0, 4.0));
        assert!(close(s.mean, 2.5) && close(s.p50, 2.5) && close(s.p90, 3.7) && close(s.p99, 3.97));
        assert_eq!(Stats::of(&[]), Stats::default());
        assert_eq!(Stats::of_sorted::<u64>(&[]), Stats::default());
        let u = Stats::of_sorted(&[1u64, 2, 3, 4]);
        assert_eq!(u, s, "whole numbers and floats give the same statistics");
    }
}
