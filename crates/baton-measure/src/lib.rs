//! One measurement layer for everything Baton measures: `baton bench serve` (live, in
//! `baton-bench`), `baton sim` (virtual time, in `baton-sim`) and the binary's micro-benches
//! compute their figures here, so a table that sets a live p90 beside a simulated one
//! (`scripts/live-vs-sim.sh`) compares one definition with itself.
//!
//! - [`percentile`]: the one percentile definition (linear interpolation between the closest
//!   ranks, numpy's default, as `vllm bench serve` and aiperf report; why, on the function).
//! - [`Stats`]: count, mean, p50 / p90 / p99, min and max of a set of samples; [`cdf_points`],
//!   the empirical CDF the plots of both sides draw.
//! - [`Poisson`]: Poisson arrivals, on uniforms each side draws from its own seeded stream.
//! - [`Slo`]: TTFT and TBT targets, what meeting them means, [`attainment`].
//! - [`trace`]: the workload files both sides read, Mooncake-format traces and ShareGPT-format
//!   conversations.
//!
//! The crate is pure and small on purpose: no I/O, no clock, no RNG of its own; both the load
//! generator and the simulator depend on it, and it on neither.
//!
//! ```
//! use baton_measure::{Stats, percentile};
//!
//! let ttft_ms = [120.0, 80.0, 100.0, 300.0];
//! let s = Stats::of(&ttft_ms);
//! assert_eq!((s.count, s.min, s.max), (4, 80.0, 300.0));
//! assert_eq!(s.p50, 110.0, "the mean of the two middle samples");
//! assert_eq!(percentile(&[1u64, 2, 3, 4], 90.0), 3.7);
//! ```

mod arrival;
mod slo;
mod stats;
pub mod trace;

pub use arrival::Poisson;
pub use slo::{Slo, TbtStat, attainment};
pub use stats::{Sample, Stats, cdf_points, percentile};
