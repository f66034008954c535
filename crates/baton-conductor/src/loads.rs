//! The conductor's ledger of one worker as plain data, and the [`WorkerLoad`] it becomes: the
//! figures baton-sched's [`ClusterSnapshot::from_workers`](baton_sched::ClusterSnapshot::from_workers)
//! takes, the builder the simulator uses too, so every policy sees the one snapshot type.
//!
//! [`WorkerFigures`] is internal to the conductor (its ledger's entries and the worker's last load
//! report, gathered under the ledger's lock); no policy sees it. [`WorkerFigures::load`] turns it
//! into a [`WorkerLoad`]: queued prefills with their predicted compute time, running decodes with
//! their contexts, decodes routed to it and not begun (coming), device blocks in use, and the
//! ledger's own counts ([`Ledger`]). Load reports, when a worker has sent one, replace the
//! ledger's guesses of its decode batch and memory; the prefill queue and the decodes coming are
//! the larger of the ledger's and the report's (a report lags the routing).

use baton_kv::InstanceId;
use baton_protocol::wire::LoadReport;
use baton_sched::{CostProfile, DecodeSeq, IncomingSeq, Ledger, Micros, PendingPrefill, TierUsage, WorkerLoad};

use crate::Role;

/// What the conductor's ledger knows of one worker.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct WorkerFigures {
    /// A stable id of the worker for as long as the conductor knows it.
    pub(crate) instance: u32,
    /// Its role.
    pub(crate) role: Role,
    /// Requests in flight on it.
    pub(crate) in_flight: usize,
    /// Each request waiting for or in prefill on it: (when it was sent there, µs since the
    /// conductor started; prompt tokens it computes, net of its cached prefix).
    pub(crate) prefilling: Vec<(u64, usize)>,
    /// Each request decoding on it: (when decoding started, µs since the conductor started;
    /// context tokens).
    pub(crate) decoding: Vec<(u64, usize)>,
    /// The KV tokens of each request admitted to decode here that has not started decoding yet
    /// (still in prefill, or handing over): claimed against its room, and coming to it.
    pub(crate) bound: Vec<usize>,
    /// KV blocks of its pool (0: unknown).
    pub(crate) capacity_blocks: usize,
    /// Tokens a KV block of its pool holds.
    pub(crate) block_tokens: usize,
    /// Its last load report (`None` before the first arrives).
    pub(crate) report: Option<LoadReport>,
    /// Its KV group ([`baton_sched::InstanceSnapshot::kv_group`]).
    pub(crate) kv_group: Option<u32>,
}

impl WorkerFigures {
    /// A worker with only a load figure.
    #[cfg(test)]
    pub(crate) fn new(instance: u32, role: Role, in_flight: usize) -> Self {
        Self {
            instance,
            role,
            in_flight,
            prefilling: Vec::new(),
            decoding: Vec::new(),
            bound: Vec::new(),
            capacity_blocks: 0,
            block_tokens: 16,
            report: None,
            kv_group: None,
        }
    }

    /// The figures baton-sched's snapshot builder takes, at `now`, with queued prompts costed by
    /// `cost`.
    pub(crate) fn load(mut self, cost: &CostProfile, now: Micros) -> WorkerLoad {
        let block_tokens = self.block_tokens.max(1);
        let mut load = WorkerLoad::idle(InstanceId(self.instance), self.role);
        load.kv_group = self.kv_group;
        self.prefilling.sort_unstable();
        load.prefills = prefill_queue(&self.prefilling, cost, now);
        load.decode_running =
            self.decoding.iter().map(|&(started_at, ctx)| DecodeSeq::new(started_at, ctx as u64)).collect();
        // Requests routed here to decode count as coming from the moment they are routed (as the
        // simulator counts them), with their prompts as context; when their KV will be ready is
        // not known here, so now.
        load.decode_incoming = self.bound.iter().map(|&tokens| IncomingSeq::new(now, tokens as u64)).collect();
        let decoding_tokens: usize = self.decoding.iter().map(|d| d.1).sum();
        let tokens: usize = self.prefilling.iter().map(|p| p.1).sum::<usize>() + decoding_tokens;
        load.kv_device = TierUsage {
            used: tokens.div_ceil(block_tokens) as u64,
            total: if self.capacity_blocks == 0 { u64::MAX } else { self.capacity_blocks as u64 },
        };
        load.ledger = Ledger {
            in_flight: u32::try_from(self.in_flight).unwrap_or(u32::MAX),
            decoding_tokens: decoding_tokens as u64,
            bound_tokens: self.bound.iter().sum::<usize>() as u64,
            capacity_tokens: (self.capacity_blocks * block_tokens) as u64,
        };
        // What the worker measured replaces the ledger's guesses of its decode batch and memory,
        // and adds to its queue and the decodes coming what the ledger does not know of.
        if let Some(r) = &self.report {
            // The ledger's queue is this conductor's estimate of the prefills it sent; the report
            // says what the worker has still to compute, whoever sent it (another conductor
            // replica too) and however long it really takes (the cost profile may under-predict
            // the worker). The queue is the longer of the two: what the report has beyond the
            // ledger waits as one more prefill.
            let ledger_us = load.queued_prefill_us(now);
            let reported_us = reported_prefill_us(cost, r);
            if reported_us > ledger_us {
                load.prefills.push(PendingPrefill { est_us: reported_us - ledger_us, started_at: None });
            }
            // The report has the contexts, the ledger when this conductor's decodes began: the
            // oldest sequences get the oldest start times; any more (another replica's) began
            // now, as far as this conductor knows.
            let mut starts: Vec<u64> = self.decoding.iter().map(|d| d.0).collect();
            starts.sort_unstable();
            load.decode_running = r
                .decode_contexts
                .iter()
                .enumerate()
                .map(|(i, &c)| DecodeSeq::new(starts.get(i).copied().unwrap_or(now), c as u64))
                .collect();
            load.decode_waiting = u32::try_from(r.waiting).unwrap_or(u32::MAX);
            // The worker's count of sequences coming to it includes this conductor's that it has
            // heard of; any beyond the ledger's are another replica's. The ledger's come first:
            // the report lags the routing (a burst's requests are invisible to it until the
            // worker's next report, and the lowest-id decode worker took the whole burst).
            // A request the report already shows decoding while the ledger still has it bound
            // counts twice until the ledger hears: an over-count, briefly, not an under-count.
            let reported = r.incoming + r.receiving;
            let others = reported.saturating_sub(self.bound.len());
            load.decode_incoming.extend((0..others).map(|_| IncomingSeq::new(now, 0)));
            if let Some(scale) = decode_step_scale(cost, r) {
                load.decode_step_scale = scale;
            }
            load.mean_step_us = r.step_time_us;
            if r.total_blocks > 0 {
                let reclaimable = r.free_blocks + r.evictable_blocks;
                load.kv_device =
                    TierUsage { used: r.total_blocks.saturating_sub(reclaimable) as u64, total: r.total_blocks as u64 };
            }
        }
        load
    }
}

/// How a worker's decode steps compare with the cost profile's, from its load report: its
/// measured decode-only steps (moving means of time, batch and context: the model is linear in
/// batch and context, so the prediction for the mean work is the mean prediction), or, from a
/// worker that predates those, its mean over every step against the batch it reports now (which
/// a colocated worker's prefill chunks inflate). Clamped to [0.25, 4]; `None` before a measure.
fn decode_step_scale(cost: &CostProfile, r: &LoadReport) -> Option<f64> {
    let (measured, predicted) = if r.decode_step_us > 0 && r.decode_step_batch > 0.0 {
        let d = &cost.decode;
        let predicted =
            d.fixed_us + d.per_seq_us * r.decode_step_batch + d.per_context_token_us * r.decode_step_context;
        (r.decode_step_us as f64, predicted)
    } else if r.step_time_us > 0 && !r.decode_contexts.is_empty() {
        let ctx: usize = r.decode_contexts.iter().sum();
        (r.step_time_us as f64, cost.decode_step(r.decode_contexts.len() as u64, ctx as u64) as f64)
    } else {
        return None;
    };
    (predicted > 0.0).then(|| (measured / predicted).clamp(0.25, 4.0))
}

/// The compute time of the prompt tokens a worker reports still to compute, as prefills of
/// their mean length (the report has their sum and the number of waiting sequences).
fn reported_prefill_us(cost: &CostProfile, r: &LoadReport) -> Micros {
    let tokens = r.queued_prefill_tokens as u64;
    if tokens == 0 {
        return 0;
    }
    let prompts = (r.waiting as u64).clamp(1, tokens);
    cost.prefill_time(tokens / prompts, 0.0) * prompts
}

/// A worker's queued prefills as the policies see them: each costs its estimate, and the worker
/// runs them one after another in the order they were sent, so the oldest started when it was
/// sent (or when the one before it ended) and only its remainder is still to wait for. Without
/// start times every prefill counted whole, and a worker about to finish one looked as busy as
/// one that had just begun it: cache-affine policies sent the next turn of a conversation away
/// from the worker holding its cache (the simulator always knew how far a prefill had got).
/// `sent` is in the order sent (by time).
pub(crate) fn prefill_queue(sent: &[(u64, usize)], cost: &CostProfile, now: Micros) -> Vec<PendingPrefill> {
    let mut free_at = 0;
    sent.iter()
        .map(|&(at, tokens)| {
            let est_us = cost.prefill_time(tokens as u64, 0.0);
            let start = free_at.max(at);
            free_at = start + est_us;
            PendingPrefill { est_us, started_at: (start <= now).then_some(start) }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker runs its prefills in the order they were sent: the oldest has been running since
    /// it was sent and only its remainder is left; the others wait whole, each after the one
    /// before it.
    #[test]
    fn a_prefill_sent_long_ago_counts_only_what_is_left_of_it() {
        let cost = CostProfile::llama2_70b_8xh100();
        let full = cost.prefill_time(4000, 0.0);
        let now = 10 * full;
        let queue = |prefilling: &[(u64, usize)]| {
            WorkerLoad {
                prefills: prefill_queue(prefilling, &cost, now),
                ..WorkerLoad::idle(InstanceId(0), Role::Prefill)
            }
            .queued_prefill_us(now)
        };
        assert_eq!(queue(&[(now, 4000)]), full, "sent just now: all of it");
        assert_eq!(queue(&[(now - full / 2, 4000)]), full - full / 2, "half done");
        assert_eq!(queue(&[(now - 2 * full, 4000)]), 0, "overdue: nothing left to wait for");
        // Sent one after the other half a prefill ago: the first is half done, the second waits.
        assert_eq!(queue(&[(now - full / 2, 4000), (now - full / 2, 4000)]), full - full / 2 + full);
    }

    /// Decodes just routed to a worker count as coming to it at once, with their prompts as
    /// context, whether or not its last load report has heard of them (a report lags the
    /// routing: a burst routed before the next report all went to the lowest-id decode worker);
    /// a report that shows them does not count them twice; a report's count beyond the ledger's
    /// (another replica's) adds to them.
    #[test]
    fn decodes_routed_here_count_before_the_worker_reports_them() {
        use baton_protocol::wire::LoadReport;
        let cost = CostProfile::llama2_70b_8xh100();
        let mut w = WorkerFigures::new(0, Role::Decode, 2);
        w.bound = vec![1000, 3000];
        let load = |w: &WorkerFigures| w.clone().load(&cost, 5);
        let coming = |w: &WorkerFigures| load(w).decode_incoming.len();
        assert_eq!(coming(&w), 2, "no report yet");
        let contexts: u64 = load(&w).decode_incoming.iter().map(|s| s.context).sum();
        assert_eq!((contexts, load(&w).ledger.bound_tokens), (4000, 4000));
        w.report = Some(LoadReport::default());
        assert_eq!(coming(&w), 2, "a report from before the routing does not hide them");
        w.report = Some(LoadReport { incoming: 1, receiving: 1, ..Default::default() });
        assert_eq!(coming(&w), 2, "a report that shows them: counted once");
        w.report = Some(LoadReport { incoming: 3, receiving: 1, ..Default::default() });
        assert_eq!(coming(&w), 4, "two more from another replica");
        w.bound.clear();
        assert_eq!(coming(&w), 4, "the ledger's done: the report's");
    }

    /// A worker's load report shows prompt tokens it has yet to compute: beyond the prefills
    /// this conductor sent it (another replica's), or left of prefills the ledger thinks done
    /// (the worker is slower than the cost profile). The queue is the longer of the ledger's and
    /// the report's; what the ledger already counts is not counted twice.
    #[test]
    fn prefills_another_conductor_sent_queue_too() {
        let cost = CostProfile::llama2_70b_8xh100();
        let mut w = WorkerFigures::new(0, Role::Prefill, 0);
        let report =
            |tokens| Some(baton_protocol::wire::LoadReport { queued_prefill_tokens: tokens, ..Default::default() });
        let queued = |w: &WorkerFigures| w.clone().load(&cost, 0).queued_prefill_us(0);
        assert_eq!(queued(&w), 0);
        w.report = report(3000);
        assert_eq!(queued(&w), cost.prefill_time(3000, 0.0), "another replica's prefill");
        w.prefilling = vec![(0, 3000)];
        assert_eq!(queued(&w), cost.prefill_time(3000, 0.0), "its own: counted once");
        w.report = report(5000);
        assert_eq!(queued(&w), cost.prefill_time(5000, 0.0), "the report's, the longer");
        // Sent long ago: the ledger thinks it done, the worker says it is not.
        w.prefilling = vec![(0, 3000)];
        w.report = report(3000);
        assert_eq!(w.clone().load(&cost, 100_000_000).queued_prefill_us(100_000_000), cost.prefill_time(3000, 0.0));
    }
}
