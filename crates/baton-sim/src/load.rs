//! The load over time (`baton sim --load-trace`): every instance's queue and decode batch at a
//! fixed interval of virtual time, and every decode check admission made, to see what early
//! and predictive admission predicted beside what the decode instances then carried (Mooncake
//! §6.3–6.4, Figures 7–9).
//!
//! Sampling reads the instances between events and adds none, so a run with a load trace
//! reports exactly what it reports without one.

use std::fmt::Write as _;

use baton_sched::Micros;

/// One instance at one sample time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadSample {
    /// Virtual time.
    pub at_us: Micros,
    /// Instance id.
    pub instance: u32,
    /// Whether it decodes (decode or colocated role).
    pub decodes: bool,
    /// Whether it prefills (prefill or colocated role).
    pub prefills: bool,
    /// Prefill work queued, the running prefill's remainder included (µs, as the scheduler
    /// estimates it).
    pub prefill_queue_us: Micros,
    /// Sequences in its running decode batch.
    pub decode_running: u32,
    /// Sequences whose KV has arrived, waiting to join the batch.
    pub decode_waiting: u32,
    /// Requests routed here whose KV has not arrived.
    pub decode_incoming: u32,
    /// The decode step of its running batch (µs; 0 with none): the TBT its decodes get now.
    pub step_us: Micros,
}

/// One decode check admission made at an arrival (see [`baton_sched::DecodeCheck`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionSample {
    /// Arrival (virtual time).
    pub at_us: Micros,
    /// The request's index in the workload.
    pub request: usize,
    /// The decode instance weighed.
    pub decode: u32,
    /// The time the load was predicted for.
    pub horizon_us: Micros,
    /// The predicted decode step with the request.
    pub predicted_us: Micros,
    /// Admission's limit.
    pub limit_us: Micros,
    /// Whether the request was admitted.
    pub admitted: bool,
}

/// A run's load trace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadTrace {
    /// Sample interval (µs).
    pub every_us: Micros,
    /// Samples, by time then instance.
    pub samples: Vec<LoadSample>,
    /// Decode checks, by arrival.
    pub admissions: Vec<AdmissionSample>,
}

impl LoadTrace {
    /// `time_s,instance,role,prefill_queue_s,decode_running,decode_waiting,decode_incoming,step_ms`.
    pub fn samples_csv(&self) -> String {
        let mut out = String::from(
            "time_s,instance,role,prefill_queue_s,decode_running,decode_waiting,decode_incoming,step_ms\n",
        );
        for s in &self.samples {
            let role = match (s.prefills, s.decodes) {
                (true, true) => "colocated",
                (true, false) => "prefill",
                (false, true) => "decode",
                (false, false) => "none",
            };
            let _ = writeln!(
                out,
                "{:.3},{},{},{:.3},{},{},{},{:.3}",
                s.at_us as f64 / 1e6,
                s.instance,
                role,
                s.prefill_queue_us as f64 / 1e6,
                s.decode_running,
                s.decode_waiting,
                s.decode_incoming,
                s.step_us as f64 / 1e3
            );
        }
        out
    }

    /// `time_s,request,decode,horizon_s,predicted_ms,limit_ms,admitted`.
    pub fn admissions_csv(&self) -> String {
        let mut out = String::from("time_s,request,decode,horizon_s,predicted_ms,limit_ms,admitted\n");
        for a in &self.admissions {
            let _ = writeln!(
                out,
                "{:.6},{},{},{:.6},{:.3},{:.3},{}",
                a.at_us as f64 / 1e6,
                a.request,
                a.decode,
                a.horizon_us as f64 / 1e6,
                a.predicted_us as f64 / 1e3,
                a.limit_us as f64 / 1e3,
                u8::from(a.admitted)
            );
        }
        out
    }

    /// The pools' mean load per sample time, as Mooncake's Figures 7–9 draw it: the prefill
    /// pool's queued prefill time over the TTFT target, and the decode pool's step time over
    /// the TBT target (1.0: at the target).
    pub fn pool_load(&self, ttft_slo_us: Micros, tbt_slo_us: Micros) -> Vec<(f64, f64, f64)> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.samples.len() {
            let at = self.samples[i].at_us;
            let (mut p, mut np, mut d, mut nd) = (0.0, 0u32, 0.0, 0u32);
            while i < self.samples.len() && self.samples[i].at_us == at {
                let s = &self.samples[i];
                if s.prefills {
                    p += s.prefill_queue_us as f64 / ttft_slo_us.max(1) as f64;
                    np += 1;
                }
                if s.decodes {
                    d += s.step_us as f64 / tbt_slo_us.max(1) as f64;
                    nd += 1;
                }
                i += 1;
            }
            out.push((at as f64 / 1e6, p / f64::from(np.max(1)), d / f64::from(nd.max(1))));
        }
        out
    }
}
