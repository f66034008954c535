//! The conductor's metrics at `GET /metrics`, kept with the `prometheus` crate (its registry,
//! counters, histograms and text encoder; Prometheus' text format 0.0.4).
//!
//! Recording never blocks a request: counters and histograms are atomics. What is read at scrape
//! time — each worker's queue and blocks, the index's per-worker figures, predictive admission's
//! `t_d`, the elastic pools' loads — goes into a registry built for that scrape
//! ([`Scrape`]), so a worker that left leaves no stale series behind.

use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

/// Bounds of the latency histograms, seconds.
const LATENCY_BOUNDS: &[f64] = &[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// The content type of what [`Metrics::render`] writes.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4";

/// How a request ended, for the `requests_total` counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Completed.
    Ok,
    /// Refused as invalid (4xx).
    Invalid,
    /// Refused for load (429).
    Rejected,
    /// Failed on a worker (5xx).
    Failed,
    /// The client went away.
    Cancelled,
}

impl Outcome {
    /// How a request refused with `e` ended: 429 is a rejection for load, another 4xx an
    /// invalid request, the rest a failure.
    pub fn of_error(e: &baton_protocol::error::ApiError) -> Self {
        match e {
            baton_protocol::error::ApiError::Overloaded { .. } => Self::Rejected,
            e if e.status().is_client_error() => Self::Invalid,
            _ => Self::Failed,
        }
    }
}

const OUTCOMES: [&str; 5] = ["ok", "invalid", "rejected", "failed", "cancelled"];

/// How a planned fetch of a cached prefix from another worker ended.
#[derive(Debug, Clone, Copy)]
pub enum FetchOutcome {
    /// The prefix arrived; the worker computed only the rest of the prompt.
    Fetched,
    /// The holder offered it, but it did not arrive (a dead peer, an ended lease, no room in
    /// time): the worker recomputed it.
    Recomputed,
    /// The holder offered nothing in time (it evicted the prefix, left, or did not answer): the
    /// prompt ran as if no fetch was planned.
    Unavailable,
}

const FETCH_OUTCOMES: [&str; 3] = ["fetched", "recomputed", "unavailable"];

/// The transports KV moves by, in [`transport_series`] order.
const TRANSPORTS: [&str; 3] = ["device", "shm", "tcp"];

/// The index of `kind`'s series in [`TRANSPORTS`].
fn transport_series(kind: baton_transfer::TransportKind) -> usize {
    match kind {
        baton_transfer::TransportKind::Device => 0,
        baton_transfer::TransportKind::Shm => 1,
        baton_transfer::TransportKind::Tcp => 2,
    }
}

/// All of the conductor's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Time to first token.
    pub ttft: Histogram,
    /// Time between tokens.
    pub tbt: Histogram,
    /// Request latency, end to end.
    pub e2e: Histogram,
    /// From handing a request to its decode worker to that worker's first token: the KV
    /// hand-off, joining the batch and one decode step.
    pub transfer: Histogram,
    /// Requests by outcome, one series per [`Outcome`] (resolved once: no label lookup per request).
    outcomes: [IntCounter; 5],
    /// Requests routed colocated.
    pub routed_colocated: IntCounter,
    /// Requests routed prefill → decode.
    pub routed_disaggregated: IntCounter,
    /// KV bytes handed between workers (the model's bytes per token times the tokens moved).
    pub transfer_bytes: IntCounter,
    /// KV tokens handed between workers (a decode worker's cached prefix is not moved).
    pub transfer_tokens: IntCounter,
    /// KV tokens decode workers sent back into prefill workers' caches (PD-Caching-3).
    pub return_tokens: IntCounter,
    /// Prompt tokens.
    pub prompt_tokens: IntCounter,
    /// Generated tokens.
    pub generation_tokens: IntCounter,
    /// Prompt tokens prefill computed (not served from a prefix cache): a request with `n`
    /// choices adds its prompt once, plus the partial last block of each later choice.
    pub prefill_tokens: IntCounter,
    /// Requests routed again after their worker was lost, or handed over again after a failed
    /// layer-wise hand-off.
    pub retries: IntCounter,
    /// Hand-offs whose KV was pushed layer by layer while the prompt computed, and arrived.
    pub layerwise_handoffs: IntCounter,
    /// Requests run whole on their decode worker because its KV cache and the prefill worker's
    /// differ (type or shape): KV cannot move between them.
    pub kv_incompatible: IntCounter,
    /// Workers taken out of routing after a failure (circuit breaker trips).
    pub breaker_trips: IntCounter,
    /// Requests continued on another worker after tokens were streamed.
    pub migrations: IntCounter,
    /// Cached prefixes fetched from another worker: how long each pull took.
    pub kv_fetch: Histogram,
    /// Bytes of cached prefixes fetched from another worker.
    pub kv_fetch_bytes: IntCounter,
    /// Tokens of cached prefixes fetched from another worker.
    pub kv_fetch_tokens: IntCounter,
    /// Planned fetches by how they ended, one series per [`FetchOutcome`].
    kv_fetches: [IntCounter; 3],
    /// KV transfers that arrived (hand-offs and fetches), by the transport that moved them.
    transfers_by_transport: [IntCounter; 3],
    /// Per prefill (or colocated) worker: prompt tokens looked up in its prefix cache, and
    /// those it found.
    cache_queries: IntCounterVec,
    cache_hits: IntCounterVec,
    /// Role switches (elastic prefill/decode), by (from, to).
    role_switches: IntCounterVec,
    role_switch_failures: IntCounter,
}

/// Registers a metric in `r` (names are constants here: a clash is a bug, caught by the tests).
fn register<M: prometheus::core::Collector + Clone + 'static>(r: &Registry, m: M) -> M {
    r.register(Box::new(m.clone())).expect("a metric's name is registered once");
    m
}

fn counter(r: &Registry, name: &str, help: &str) -> IntCounter {
    register(r, IntCounter::new(name, help).expect("a valid metric name"))
}

fn counters(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    register(r, IntCounterVec::new(Opts::new(name, help), labels).expect("a valid metric name"))
}

/// One counter per value of a family's single label, every one present (at zero) from the start,
/// so a scraper sees each series before its first increase.
fn series<const N: usize>(family: IntCounterVec, values: [&str; N]) -> [IntCounter; N] {
    values.map(|v| family.with_label_values(&[v]))
}

fn latency(r: &Registry, name: &str, help: &str) -> Histogram {
    let opts = HistogramOpts::new(name, help).buckets(LATENCY_BOUNDS.to_vec());
    register(r, Histogram::with_opts(opts).expect("a valid metric name"))
}

impl Default for Metrics {
    fn default() -> Self {
        let r = Registry::new();
        let routes = counters(&r, "baton_routing_decisions_total", "Routing decisions.", &["route"]);
        Self {
            ttft: latency(&r, "baton_time_to_first_token_seconds", "Time to first token."),
            tbt: latency(&r, "baton_time_between_tokens_seconds", "Time between consecutive tokens."),
            e2e: latency(&r, "baton_request_duration_seconds", "Request latency, end to end."),
            transfer: latency(
                &r,
                "baton_kv_transfer_seconds",
                "From handing a request to its decode worker to that worker's first token (KV hand-off, joining the \
                 batch, one decode step).",
            ),
            outcomes: series(
                counters(
                    &r,
                    "baton_requests_total",
                    "Requests by outcome (each of a request's n choices counts once; refusals once).",
                    &["outcome"],
                ),
                OUTCOMES,
            ),
            routed_colocated: routes.with_label_values(&["colocated"]),
            routed_disaggregated: routes.with_label_values(&["disaggregated"]),
            transfer_bytes: counter(&r, "baton_kv_transfer_bytes_total", "KV bytes handed between workers."),
            transfers_by_transport: series(
                counters(
                    &r,
                    "baton_kv_transfers_total",
                    "KV transfers between workers that arrived (hand-offs and fetches), by the transport that moved \
                     them: device to device, shared memory or TCP.",
                    &["transport"],
                ),
                TRANSPORTS,
            ),
            transfer_tokens: counter(
                &r,
                "baton_kv_transfer_tokens_total",
                "KV tokens handed from prefill to decode workers (those a decode worker cached already are not moved).",
            ),
            return_tokens: counter(
                &r,
                "baton_kv_return_tokens_total",
                "KV tokens decode workers sent back into prefill workers' caches after a request (PD-Caching-3).",
            ),
            prompt_tokens: counter(&r, "baton_prompt_tokens_total", "Prompt tokens of the requests served."),
            generation_tokens: counter(&r, "baton_generation_tokens_total", "Tokens generated."),
            prefill_tokens: counter(
                &r,
                "baton_prefill_tokens_total",
                "Prompt tokens computed by prefill (not served from a prefix cache).",
            ),
            retries: counter(
                &r,
                "baton_retries_total",
                "Requests routed again after their worker was lost, or handed to their decode worker again after a \
                 failed layer-wise hand-off.",
            ),
            layerwise_handoffs: counter(
                &r,
                "baton_kv_layerwise_handoffs_total",
                "Hand-offs whose KV was pushed layer by layer while the prompt computed, and arrived.",
            ),
            kv_incompatible: counter(
                &r,
                "baton_kv_incompatible_routes_total",
                "Requests run whole on their decode worker because its KV cache differs from the prefill worker's \
                 (element type or shape: start every worker with the same --kv-dtype and --block-size).",
            ),
            breaker_trips: counter(
                &r,
                "baton_worker_breaker_trips_total",
                "Workers taken out of routing after a failed connect or request.",
            ),
            migrations: counter(
                &r,
                "baton_migrations_total",
                "Requests continued on another worker after their worker was lost mid-stream.",
            ),
            kv_fetch: latency(
                &r,
                "baton_kv_fetch_seconds",
                "Time to pull a cached prefix from another worker's pool before computing the rest of a prompt.",
            ),
            kv_fetch_bytes: counter(
                &r,
                "baton_kv_fetch_bytes_total",
                "KV bytes of cached prefixes fetched from another worker.",
            ),
            kv_fetch_tokens: counter(
                &r,
                "baton_kv_fetch_tokens_total",
                "KV tokens of cached prefixes fetched from another worker.",
            ),
            kv_fetches: series(
                counters(
                    &r,
                    "baton_kv_fetches_total",
                    "Planned fetches of a cached prefix from another worker, by how they ended.",
                    &["outcome"],
                ),
                FETCH_OUTCOMES,
            ),
            cache_queries: counters(
                &r,
                "baton_prefix_cache_queries_tokens_total",
                "Prompt tokens looked up in a worker's prefix cache.",
                &["worker"],
            ),
            cache_hits: counters(
                &r,
                "baton_prefix_cache_hits_tokens_total",
                "Prompt tokens a worker's prefix cache served (not prefilled).",
                &["worker"],
            ),
            role_switches: counters(
                &r,
                "baton_role_switches_total",
                "Workers switched from one role to another (--elastic).",
                &["from", "to"],
            ),
            role_switch_failures: counter(
                &r,
                "baton_role_switch_failures_total",
                "Role switches ordered that the worker did not carry out (--elastic).",
            ),
            registry: r,
        }
    }
}

/// A worker's gauges at render time.
#[derive(Debug, Clone)]
pub struct WorkerGauges {
    /// Worker name.
    pub name: String,
    /// Role label.
    pub role: &'static str,
    /// Running requests.
    pub running: usize,
    /// Waiting requests.
    pub waiting: usize,
    /// KV blocks in use (not free, not merely cached).
    pub blocks_used: usize,
    /// KV blocks in the device tier.
    pub blocks_total: usize,
    /// KV blocks that failed their checksum on the worker (its slower tiers, or received over
    /// TCP), since it started.
    pub corrupt_blocks: u64,
    /// Bytes copied into and out of the worker's device arena, by direction, since it started.
    pub kv_copy_bytes: baton_protocol::KvCopyBytes,
}

/// What is read at scrape time, beside the counters: a registry built for one scrape.
#[derive(Debug, Default)]
pub struct Scrape<'a> {
    /// Each worker's queue and blocks.
    pub workers: &'a [WorkerGauges],
    /// The conductor's index, per worker.
    pub index: &'a [crate::view::IndexGauges],
    /// Predictive admission's measured `t_d`, µs, once measured.
    pub decode_time_us: Option<u64>,
    /// The elastic controller's (prefill, decode) pool loads, with `--elastic`.
    pub pool_loads: Option<(f64, f64)>,
    /// Requests waiting in the conductor's admission queue for decode room.
    pub admission_queued: usize,
}

impl Scrape<'_> {
    fn registry(&self) -> prometheus::Result<Registry> {
        let r = Registry::new();
        let gauges = |name: &str, help: &str, labels: &[&str]| -> prometheus::Result<IntGaugeVec> {
            let g = IntGaugeVec::new(Opts::new(name, help), labels)?;
            r.register(Box::new(g.clone()))?;
            Ok(g)
        };
        let as_i64 = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        let queue = gauges(
            "baton_queue_length",
            "Requests per worker and state (worker \"conductor\", state \"admission\": waiting in the conductor's \
             queue for decode room).",
            &["worker", "role", "state"],
        )?;
        queue.with_label_values(&["conductor", "conductor", "admission"]).set(as_i64(self.admission_queued));
        let blocks = gauges("baton_kv_blocks", "KV blocks per worker, tier and state.", &["worker", "tier", "state"])?;
        // The worker counts; the conductor reports what it read (a counter whose value comes
        // from elsewhere, as the index's below).
        let corrupt = IntCounterVec::new(
            Opts::new(
                "baton_kv_corrupt_blocks_total",
                "KV blocks that failed their checksum on a worker, read back from its host or disk tier or received \
                 over TCP; each was dropped and its tokens computed again.",
            ),
            &["worker"],
        )?;
        r.register(Box::new(corrupt.clone()))?;
        let copies = IntCounterVec::new(
            Opts::new(
                "baton_kv_copy_bytes_total",
                "Bytes copied into and out of a worker's device arena: device_to_host (tier demotions, sends, a \
                 device's write-back), host_to_device (swap-ins, receives, uploads), device_to_device (same-host \
                 hand-offs over a device link).",
            ),
            &["worker", "direction"],
        )?;
        r.register(Box::new(copies.clone()))?;
        for w in self.workers {
            corrupt.with_label_values(&[&w.name]).inc_by(w.corrupt_blocks);
            let c = &w.kv_copy_bytes;
            for (direction, bytes) in [
                ("device_to_host", c.device_to_host),
                ("host_to_device", c.host_to_device),
                ("device_to_device", c.device_to_device),
            ] {
                copies.with_label_values(&[&w.name, direction]).inc_by(bytes);
            }
            queue.with_label_values(&[&w.name, w.role, "running"]).set(as_i64(w.running));
            queue.with_label_values(&[&w.name, w.role, "waiting"]).set(as_i64(w.waiting));
            blocks.with_label_values(&[&w.name, "device", "used"]).set(as_i64(w.blocks_used));
            blocks.with_label_values(&[&w.name, "device", "total"]).set(as_i64(w.blocks_total));
        }
        let index_blocks = gauges(
            "baton_kv_index_blocks",
            "KV blocks the conductor's index holds per worker and tier (from the workers' KV events).",
            &["worker", "tier"],
        )?;
        // Counted by the conductor's view, read here: counters whose values come from elsewhere.
        let events = IntCounterVec::new(
            Opts::new("baton_kv_events_total", "KV events the conductor applied, per worker."),
            &["worker"],
        )?;
        let resyncs = IntCounterVec::new(
            Opts::new(
                "baton_kv_index_resyncs_total",
                "Snapshots taken to resynchronise a worker's index after lost events.",
            ),
            &["worker"],
        )?;
        let lag = GaugeVec::new(
            Opts::new(
                "baton_kv_index_lag_seconds",
                "Age of a worker's last state update when the conductor applied it.",
            ),
            &["worker"],
        )?;
        for m in [
            Box::new(events.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(resyncs.clone()),
            Box::new(lag.clone()),
        ] {
            r.register(m)?;
        }
        for g in self.index {
            for (tier, n) in ["device", "host", "disk"].iter().zip(g.blocks) {
                index_blocks.with_label_values(&[g.name.as_str(), tier]).set(as_i64(n));
            }
            events.with_label_values(&[&g.name]).inc_by(g.events);
            resyncs.with_label_values(&[&g.name]).inc_by(g.resyncs);
            lag.with_label_values(&[&g.name]).set(g.lag_s);
        }
        if let Some(us) = self.decode_time_us {
            let g = Gauge::new(
                "baton_decode_residency_seconds",
                "Mean time a request stays on its decode worker (moving mean; predictive admission's t_d).",
            )?;
            g.set(us as f64 / 1e6);
            r.register(Box::new(g))?;
        }
        if let Some((prefill, decode)) = self.pool_loads {
            // FlowKV's controller switches a worker when one pool stays over its high watermark
            // while the other stays under its low one.
            let g = GaugeVec::new(
                Opts::new(
                    "baton_elastic_pool_load",
                    "Mean load of a role's workers as elastic switching weighs it (1 = at the SLO).",
                ),
                &["pool"],
            )?;
            g.with_label_values(&["prefill"]).set(prefill);
            g.with_label_values(&["decode"]).set(decode);
            r.register(Box::new(g))?;
        }
        Ok(r)
    }
}

impl Metrics {
    /// Counts a prefill's prompt tokens and the cache hits among them on `worker`.
    pub fn prefix_cache(&self, worker: &str, prompt_tokens: usize, cached_tokens: usize) {
        self.cache_queries.with_label_values(&[worker]).inc_by(prompt_tokens as u64);
        self.cache_hits.with_label_values(&[worker]).inc_by(cached_tokens as u64);
    }

    /// Counts a worker's role switch.
    pub fn role_switch(&self, from: &'static str, to: &'static str) {
        self.role_switches.with_label_values(&[from, to]).inc();
    }

    /// Counts a role switch the conductor ordered and the worker did not carry out in time.
    pub fn role_switch_failed(&self) {
        self.role_switch_failures.inc();
    }

    /// Counts a planned fetch's end (with what arrived, for `Fetched`).
    pub fn fetch(&self, outcome: FetchOutcome, received: Option<baton_protocol::wire::Received>) {
        self.kv_fetches[outcome as usize].inc();
        if let Some(r) = received {
            self.transferred(&r);
            self.kv_fetch_bytes.inc_by(r.bytes);
            self.kv_fetch_tokens.inc_by(r.tokens as u64);
            self.kv_fetch.observe(r.micros as f64 / 1e6);
        }
    }

    /// Counts a transfer that arrived by the transport that moved it (one of a worker that
    /// does not say is not counted).
    pub fn transferred(&self, received: &baton_protocol::wire::Received) {
        if let Some(kind) = received.transport {
            self.transfers_by_transport[transport_series(kind)].inc();
        }
    }

    /// Counts a request's outcome.
    pub fn outcome(&self, o: Outcome) {
        self.outcomes[o as usize].inc();
    }

    /// Requests that ended as `o` so far.
    pub fn outcomes(&self, o: Outcome) -> u64 {
        self.outcomes[o as usize].get()
    }

    /// The metrics in Prometheus' text format, with what `scrape` read.
    pub fn render(&self, scrape: &Scrape<'_>) -> String {
        let mut families = self.registry.gather();
        match scrape.registry() {
            Ok(r) => families.extend(r.gather()),
            Err(e) => tracing::warn!(error = %e, "the scrape-time metrics could not be built"),
        }
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&families, &mut out) {
            tracing::warn!(error = %e, "the metrics could not be encoded");
        }
        String::from_utf8(out).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_series_renders_in_the_text_format_with_its_labels() {
        let m = Metrics::default();
        m.ttft.observe(0.02);
        m.outcome(Outcome::Ok);
        m.retries.inc();
        m.prefix_cache("prefill-0", 100, 64);
        m.role_switch("prefill", "decode");
        m.fetch(
            FetchOutcome::Fetched,
            Some(baton_protocol::wire::Received { tokens: 32, bytes: 4096, micros: 1500, transport: None }),
        );
        let workers = [WorkerGauges {
            name: "decode-1".into(),
            role: "decode",
            running: 3,
            waiting: 1,
            blocks_used: 10,
            blocks_total: 64,
            corrupt_blocks: 2,
            kv_copy_bytes: baton_protocol::KvCopyBytes { device_to_host: 4096, ..Default::default() },
        }];
        let scrape = Scrape { workers: &workers, decode_time_us: Some(2_500_000), ..Scrape::default() };
        let text = m.render(&scrape);
        for line in [
            "# TYPE baton_time_to_first_token_seconds histogram",
            "baton_time_to_first_token_seconds_bucket{le=\"0.025\"} 1",
            "baton_time_to_first_token_seconds_count 1",
            "baton_requests_total{outcome=\"ok\"} 1",
            "baton_requests_total{outcome=\"cancelled\"} 0",
            "baton_retries_total 1",
            "baton_routing_decisions_total{route=\"colocated\"} 0",
            "baton_prefix_cache_hits_tokens_total{worker=\"prefill-0\"} 64",
            "baton_role_switches_total{from=\"prefill\",to=\"decode\"} 1",
            "baton_kv_fetches_total{outcome=\"fetched\"} 1",
            "baton_kv_fetch_tokens_total 32",
            "baton_queue_length{role=\"decode\",state=\"running\",worker=\"decode-1\"} 3",
            "baton_kv_blocks{state=\"total\",tier=\"device\",worker=\"decode-1\"} 64",
            "baton_kv_corrupt_blocks_total{worker=\"decode-1\"} 2",
            "baton_kv_copy_bytes_total{direction=\"device_to_host\",worker=\"decode-1\"} 4096",
            "baton_decode_residency_seconds 2.5",
        ] {
            assert!(text.lines().any(|l| l == line), "`{line}` missing from:\n{text}");
        }
        assert!(!text.contains("baton_elastic_pool_load"), "no elastic gauge without --elastic");
        assert_eq!(m.outcomes(Outcome::Ok), 1);
    }
}
