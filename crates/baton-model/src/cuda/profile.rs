//! Where a step's time goes: `--device-timing` (wall time by phase) and
//! `--device-profile` (GPU time by launch).

use super::*;

/// Where a step's time goes (`--device-timing`), decode steps and the others (prefill
/// and mixed) apart: printed when the engine's state drops.
#[derive(Debug, Default)]
pub(super) struct Timing {
    /// `[decode, other]`.
    pub(super) kinds: [StepTimes; 2],
}

#[derive(Debug, Default)]
pub(super) struct StepTimes {
    pub(super) steps: u64,
    /// Packing, stale uploads, the index upload.
    pub(super) prepare: std::time::Duration,
    /// Enqueueing the kernels (or launching the graph).
    pub(super) enqueue: std::time::Duration,
    /// Waiting for the GPU and the logits' and KV's copies down.
    pub(super) wait: std::time::Duration,
    /// Copying logits and KV out of pinned memory into the engine's buffers.
    pub(super) unpack: std::time::Duration,
}

/// Where a step's GPU time goes, launch by launch (`--device-profile`, which turns CUDA
/// graphs off): an event after every launch, read back once the step has synchronised, summed by
/// kernel name and step kind, printed when the engine's state drops.
#[derive(Default)]
pub(super) struct Profile {
    /// This step's events: a start, then one after each named launch.
    pub(super) marks: std::sync::Mutex<Vec<(&'static str, cudarc::driver::CudaEvent)>>,
    /// `[decode, other]`: steps, and each launch's totals in first-seen order.
    pub(super) totals: [(u64, Vec<LaunchTotal>); 2],
}

/// A kernel's (or GEMM's) name, total milliseconds and launches, over a profile's steps.
pub(super) type LaunchTotal = (&'static str, f64, u64);

impl Profile {
    /// Reads the step's events (the stream has synchronised) into the totals.
    pub(super) fn collect(&mut self, decode: bool) -> Result<()> {
        let marks = std::mem::take(&mut *self.marks.lock().map_err(|_| err("profile lock poisoned"))?);
        let (steps, totals) = &mut self.totals[usize::from(!decode)];
        *steps += 1;
        for pair in marks.windows(2) {
            let ms = f64::from(pair[0].1.elapsed_ms(&pair[1].1).map_err(err)?);
            match totals.iter_mut().find(|t| t.0 == pair[1].0) {
                Some(t) => {
                    t.1 += ms;
                    t.2 += 1;
                }
                None => totals.push((pair[1].0, ms, 1)),
            }
        }
        Ok(())
    }

    pub(super) fn print(&self) {
        for (kind, (steps, totals)) in ["decode", "prefill/mixed"].iter().zip(&self.totals) {
            if *steps == 0 {
                continue;
            }
            let sum: f64 = totals.iter().map(|t| t.1).sum();
            let mut rows: Vec<_> = totals.iter().collect();
            rows.sort_by(|a, b| b.1.total_cmp(&a.1));
            eprintln!(
                "baton cuda profile: {steps} {kind} steps, {:.3} ms of GPU time a step, by launch:",
                sum / *steps as f64
            );
            for (name, ms, launches) in rows {
                eprintln!(
                    "  {name:<18} {:>9.3} ms a step {:>5.1}%  {:>6.1} launches a step, {:>8.1} us each",
                    ms / *steps as f64,
                    100.0 * ms / sum,
                    *launches as f64 / *steps as f64,
                    1e3 * ms / *launches as f64
                );
            }
        }
    }
}
