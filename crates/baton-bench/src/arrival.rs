//! Arrival processes, pure: when each chain of a workload starts, as µs offsets from the start
//! of a run.

use baton_measure::Poisson;
use serde::{Deserialize, Serialize};

use crate::BenchError;
use crate::text::{mix, splitmix};
use crate::workload::Workload;

/// How requests arrive.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Arrival {
    /// Open loop: chains start at Poisson arrivals of this rate per second.
    Poisson {
        /// Arrivals per second.
        rate: f64,
    },
    /// Open loop: every chain starts at once (a rate of infinity).
    Burst,
    /// Open loop: chains start at the trace's timestamps divided by `time_scale` (2.0 replays
    /// twice as fast).
    Trace {
        /// Speed-up of the trace's clock.
        time_scale: f64,
    },
    /// Closed loop: at most this many requests in flight; the next is sent when one ends.
    Closed {
        /// Requests in flight.
        concurrency: usize,
    },
}

impl Arrival {
    /// A short name for tables and plots (`rate 2/s`, `concurrency 4`, ...).
    pub fn label(&self) -> String {
        match *self {
            Arrival::Poisson { rate } => format!("rate {rate}/s"),
            Arrival::Burst => "burst".into(),
            Arrival::Trace { time_scale } => format!("trace x{time_scale}"),
            Arrival::Closed { concurrency } => format!("concurrency {concurrency}"),
        }
    }

    /// The in-flight limit this process implies, combined with a cap for open loops.
    pub fn concurrency_limit(&self, open_loop_cap: Option<usize>) -> Option<usize> {
        match *self {
            Arrival::Closed { concurrency } => Some(concurrency),
            _ => open_loop_cap,
        }
    }

    /// Checks the parameters.
    pub fn validate(&self) -> Result<(), BenchError> {
        match *self {
            Arrival::Poisson { rate } if !(rate.is_finite() && rate > 0.0) => {
                Err(BenchError::Config(format!("a rate must be positive and finite, got {rate}")))
            }
            Arrival::Trace { time_scale } if !(time_scale.is_finite() && time_scale > 0.0) => {
                Err(BenchError::Config(format!("a time scale must be positive, got {time_scale}")))
            }
            Arrival::Closed { concurrency: 0 } => Err(BenchError::Config("concurrency must be at least 1".into())),
            _ => Ok(()),
        }
    }
}

/// Start offsets (µs) of the workload's chains, deterministic for `seed`. Poisson arrivals
/// ([`Poisson`], on a SplitMix64 stream) start the first chain at 0 and space the rest by
/// exponential gaps.
pub fn schedule(arrival: &Arrival, workload: &Workload, seed: u64) -> Result<Vec<u64>, BenchError> {
    arrival.validate()?;
    let n = workload.chains.len();
    match *arrival {
        Arrival::Burst | Arrival::Closed { .. } => Ok(vec![0; n]),
        Arrival::Poisson { rate } => {
            let mut state = mix(&[seed, 0xA11]);
            let mut clock = Poisson::new(rate);
            Ok((0..n)
                .map(|i| {
                    if i > 0 {
                        // A uniform in (0, 1] from the stream's top 53 bits.
                        clock.advance(((splitmix(&mut state) >> 11) as f64 + 1.0) / (1u64 << 53) as f64);
                    }
                    (clock.now_s() * 1e6).round() as u64
                })
                .collect())
        }
        Arrival::Trace { time_scale } => {
            let times: Option<Vec<u64>> = workload.chains.iter().map(|c| c.arrival_us).collect();
            let times = times.ok_or_else(|| {
                BenchError::Config("trace arrivals need a workload with timestamps (a Mooncake trace)".into())
            })?;
            let first = times.iter().copied().min().unwrap_or(0);
            Ok(times.iter().map(|&t| ((t - first) as f64 / time_scale).round() as u64).collect())
        }
    }
}
