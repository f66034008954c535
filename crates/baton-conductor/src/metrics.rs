//! The conductor's metrics, rendered in Prometheus' text format at `GET /metrics`.
//!
//! Counters and fixed-bucket histograms on atomics: recording never blocks a request.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// A histogram with fixed upper bounds (seconds).
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    /// Sum in microseconds.
    sum_us: AtomicU64,
    count: AtomicU64,
}

const LATENCY_BOUNDS: &[f64] = &[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

impl Histogram {
    fn latency() -> Self {
        Self {
            bounds: LATENCY_BOUNDS,
            counts: LATENCY_BOUNDS.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_us: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    /// Records one observation in seconds.
    pub fn observe(&self, seconds: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| seconds <= b) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
        self.sum_us.fetch_add((seconds * 1e6) as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cumulative += c.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cumulative}");
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_sum {}", self.sum_us.load(Ordering::Relaxed) as f64 / 1e6);
        let _ = writeln!(out, "{name}_count {count}");
    }
}

/// The elastic controller's view of the prefill and decode pools (`--elastic`): each pool's
/// mean load, 1.0 being at its SLO; it switches a worker when one pool stays over 0.7 while
/// the other stays under 0.3.
pub fn render_pool_loads(prefill: f64, decode: f64) -> String {
    format!(
        "# HELP baton_elastic_pool_load Mean load of a role's workers as elastic switching weighs it (1 = at the SLO).\n\
         # TYPE baton_elastic_pool_load gauge\n\
         baton_elastic_pool_load{{pool=\"prefill\"}} {prefill}\n\
         baton_elastic_pool_load{{pool=\"decode\"}} {decode}\n"
    )
}

/// How long requests stay on their decode worker, on average (an exponential moving mean the
/// conductor measures; predictive admission's `t_d`).
pub fn render_decode_time(us: u64) -> String {
    format!(
        "# HELP baton_decode_residency_seconds Mean time a request stays on its decode worker (moving mean; predictive admission's t_d).\n\
         # TYPE baton_decode_residency_seconds gauge\nbaton_decode_residency_seconds {}\n",
        us as f64 / 1e6
    )
}

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

/// All of the conductor's metrics.
#[derive(Debug)]
pub struct Metrics {
    /// Time to first token.
    pub ttft: Histogram,
    /// Time between tokens.
    pub tbt: Histogram,
    /// Request latency, end to end.
    pub e2e: Histogram,
    /// From handing a request to its decode worker to that worker's first token: the KV
    /// hand-off, joining the batch and one decode step.
    pub transfer: Histogram,
    outcomes: [AtomicU64; 5],
    /// Requests routed colocated.
    pub routed_colocated: AtomicU64,
    /// Requests routed prefill → decode.
    pub routed_disaggregated: AtomicU64,
    /// KV bytes handed between workers (the model's bytes per token times the tokens moved).
    pub transfer_bytes: AtomicU64,
    /// KV tokens handed between workers (a decode worker's cached prefix is not moved).
    pub transfer_tokens: AtomicU64,
    /// KV tokens decode workers sent back into prefill workers' caches (PD-Caching-3).
    pub return_tokens: AtomicU64,
    /// Prompt tokens.
    pub prompt_tokens: AtomicU64,
    /// Generated tokens.
    pub generation_tokens: AtomicU64,
    /// Prompt tokens prefill computed (not served from a prefix cache): a request with `n`
    /// choices adds its prompt once, plus the partial last block of each later choice.
    pub prefill_tokens: AtomicU64,
    /// Requests routed again after their worker was lost, or handed over again after a failed
    /// layer-wise hand-off.
    pub retries: AtomicU64,
    /// Hand-offs whose KV was pushed layer by layer while the prompt computed, and arrived.
    pub layerwise_handoffs: AtomicU64,
    /// Workers taken out of routing after a failure (circuit breaker trips).
    pub breaker_trips: AtomicU64,
    /// Requests continued on another worker after tokens were streamed.
    pub migrations: AtomicU64,
    /// Cached prefixes fetched from another worker: how long each pull took.
    pub kv_fetch: Histogram,
    /// Bytes of cached prefixes fetched from another worker.
    pub kv_fetch_bytes: AtomicU64,
    /// Tokens of cached prefixes fetched from another worker.
    pub kv_fetch_tokens: AtomicU64,
    kv_fetches: [AtomicU64; 3],
    /// Per prefill (or colocated) worker: prompt tokens looked up in its prefix cache, and
    /// those it found.
    cache: std::sync::Mutex<std::collections::BTreeMap<String, (u64, u64)>>,
    /// Role switches (elastic prefill/decode), by (from, to).
    role_switches: std::sync::Mutex<std::collections::BTreeMap<(&'static str, &'static str), u64>>,
    role_switch_failures: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            ttft: Histogram::latency(),
            tbt: Histogram::latency(),
            e2e: Histogram::latency(),
            transfer: Histogram::latency(),
            outcomes: Default::default(),
            routed_colocated: AtomicU64::new(0),
            routed_disaggregated: AtomicU64::new(0),
            transfer_bytes: AtomicU64::new(0),
            transfer_tokens: AtomicU64::new(0),
            return_tokens: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            prefill_tokens: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            layerwise_handoffs: AtomicU64::new(0),
            breaker_trips: AtomicU64::new(0),
            migrations: AtomicU64::new(0),
            kv_fetch: Histogram::latency(),
            kv_fetch_bytes: AtomicU64::new(0),
            kv_fetch_tokens: AtomicU64::new(0),
            kv_fetches: Default::default(),
            cache: std::sync::Mutex::default(),
            role_switches: std::sync::Mutex::default(),
            role_switch_failures: AtomicU64::new(0),
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
}

impl Metrics {
    /// Counts a prefill's prompt tokens and the cache hits among them on `worker`.
    pub fn prefix_cache(&self, worker: &str, prompt_tokens: usize, cached_tokens: usize) {
        let mut cache = self.cache.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let e = cache.entry(worker.to_owned()).or_default();
        e.0 += prompt_tokens as u64;
        e.1 += cached_tokens as u64;
    }

    fn render_cache(&self, out: &mut String) {
        let cache = self.cache.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let _ = writeln!(
            out,
            "# HELP baton_prefix_cache_queries_tokens_total Prompt tokens looked up in a worker's prefix cache.\n# TYPE baton_prefix_cache_queries_tokens_total counter"
        );
        for (w, (q, _)) in cache.iter() {
            let _ = writeln!(out, "baton_prefix_cache_queries_tokens_total{{worker=\"{w}\"}} {q}");
        }
        let _ = writeln!(
            out,
            "# HELP baton_prefix_cache_hits_tokens_total Prompt tokens a worker's prefix cache served (not prefilled).\n# TYPE baton_prefix_cache_hits_tokens_total counter"
        );
        for (w, (_, h)) in cache.iter() {
            let _ = writeln!(out, "baton_prefix_cache_hits_tokens_total{{worker=\"{w}\"}} {h}");
        }
    }

    /// Counts a worker's role switch.
    pub fn role_switch(&self, from: &'static str, to: &'static str) {
        let mut switches = self.role_switches.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        *switches.entry((from, to)).or_default() += 1;
    }

    /// Counts a role switch the conductor ordered and the worker did not carry out in time.
    pub fn role_switch_failed(&self) {
        self.role_switch_failures.fetch_add(1, Ordering::Relaxed);
    }

    fn render_role_switches(&self, out: &mut String) {
        let switches = self.role_switches.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let _ = writeln!(
            out,
            "# HELP baton_role_switches_total Workers switched from one role to another (--elastic).\n# TYPE baton_role_switches_total counter"
        );
        for ((from, to), n) in switches.iter() {
            let _ = writeln!(out, "baton_role_switches_total{{from=\"{from}\",to=\"{to}\"}} {n}");
        }
        let _ = writeln!(
            out,
            "# HELP baton_role_switch_failures_total Role switches ordered that the worker did not carry out (--elastic).\n# TYPE baton_role_switch_failures_total counter\nbaton_role_switch_failures_total {}",
            self.role_switch_failures.load(Ordering::Relaxed)
        );
    }

    /// Counts a planned fetch's end (with what arrived, for `Fetched`).
    pub fn fetch(&self, outcome: FetchOutcome, received: Option<baton_protocol::wire::Received>) {
        self.kv_fetches[outcome as usize].fetch_add(1, Ordering::Relaxed);
        if let Some(r) = received {
            self.kv_fetch_bytes.fetch_add(r.bytes, Ordering::Relaxed);
            self.kv_fetch_tokens.fetch_add(r.tokens as u64, Ordering::Relaxed);
            self.kv_fetch.observe(r.micros as f64 / 1e6);
        }
    }

    /// Counts a request's outcome.
    pub fn outcome(&self, o: Outcome) {
        self.outcomes[o as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Prometheus text exposition.
    pub fn render(&self, workers: &[WorkerGauges], index: &[crate::view::IndexGauges]) -> String {
        let mut out = String::new();
        self.ttft.render(&mut out, "baton_time_to_first_token_seconds", "Time to first token.");
        self.tbt.render(&mut out, "baton_time_between_tokens_seconds", "Time between consecutive tokens.");
        self.e2e.render(&mut out, "baton_request_duration_seconds", "Request latency, end to end.");
        self.transfer.render(
            &mut out,
            "baton_kv_transfer_seconds",
            "From handing a request to its decode worker to that worker's first token \
             (KV hand-off, joining the batch, one decode step).",
        );
        let _ = writeln!(
            out,
            "# HELP baton_requests_total Requests by outcome (each of a request's n choices counts once; refusals once).\n# TYPE baton_requests_total counter"
        );
        for (name, c) in OUTCOMES.iter().zip(&self.outcomes) {
            let _ = writeln!(out, "baton_requests_total{{outcome=\"{name}\"}} {}", c.load(Ordering::Relaxed));
        }
        let _ = writeln!(
            out,
            "# HELP baton_routing_decisions_total Routing decisions.\n# TYPE baton_routing_decisions_total counter"
        );
        let _ = writeln!(
            out,
            "baton_routing_decisions_total{{route=\"colocated\"}} {}",
            self.routed_colocated.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "baton_routing_decisions_total{{route=\"disaggregated\"}} {}",
            self.routed_disaggregated.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP baton_retries_total Requests routed again after their worker was lost, or handed to their decode worker again after a failed layer-wise hand-off.\n# TYPE baton_retries_total counter\nbaton_retries_total {}",
            self.retries.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP baton_kv_layerwise_handoffs_total Hand-offs whose KV was pushed layer by layer while the prompt computed, and arrived.\n# TYPE baton_kv_layerwise_handoffs_total counter\nbaton_kv_layerwise_handoffs_total {}",
            self.layerwise_handoffs.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP baton_worker_breaker_trips_total Workers taken out of routing after a failed connect or request.\n# TYPE baton_worker_breaker_trips_total counter\nbaton_worker_breaker_trips_total {}",
            self.breaker_trips.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP baton_migrations_total Requests continued on another worker after their worker was lost mid-stream.\n# TYPE baton_migrations_total counter\nbaton_migrations_total {}",
            self.migrations.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP baton_kv_transfer_bytes_total KV bytes handed between workers.\n# TYPE baton_kv_transfer_bytes_total counter"
        );
        let _ = writeln!(out, "baton_kv_transfer_bytes_total {}", self.transfer_bytes.load(Ordering::Relaxed));
        let _ = writeln!(
            out,
            "# HELP baton_kv_transfer_tokens_total KV tokens handed from prefill to decode workers (those a decode worker cached already are not moved).\n# TYPE baton_kv_transfer_tokens_total counter\nbaton_kv_transfer_tokens_total {}",
            self.transfer_tokens.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP baton_kv_return_tokens_total KV tokens decode workers sent back into prefill workers' caches after a request (PD-Caching-3).\n# TYPE baton_kv_return_tokens_total counter\nbaton_kv_return_tokens_total {}",
            self.return_tokens.load(Ordering::Relaxed)
        );
        self.render_role_switches(&mut out);
        self.kv_fetch.render(
            &mut out,
            "baton_kv_fetch_seconds",
            "Time to pull a cached prefix from another worker's pool before computing the rest of a prompt.",
        );
        let _ = writeln!(
            out,
            "# HELP baton_kv_fetch_bytes_total KV bytes of cached prefixes fetched from another worker.\n# TYPE baton_kv_fetch_bytes_total counter\nbaton_kv_fetch_bytes_total {}",
            self.kv_fetch_bytes.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP baton_kv_fetch_tokens_total KV tokens of cached prefixes fetched from another worker.\n# TYPE baton_kv_fetch_tokens_total counter\nbaton_kv_fetch_tokens_total {}",
            self.kv_fetch_tokens.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP baton_kv_fetches_total Planned fetches of a cached prefix from another worker, by how they ended.\n# TYPE baton_kv_fetches_total counter"
        );
        for (name, c) in FETCH_OUTCOMES.iter().zip(&self.kv_fetches) {
            let _ = writeln!(out, "baton_kv_fetches_total{{outcome=\"{name}\"}} {}", c.load(Ordering::Relaxed));
        }
        let _ = writeln!(
            out,
            "# TYPE baton_prompt_tokens_total counter\nbaton_prompt_tokens_total {}",
            self.prompt_tokens.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# TYPE baton_generation_tokens_total counter\nbaton_generation_tokens_total {}",
            self.generation_tokens.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP baton_prefill_tokens_total Prompt tokens computed by prefill (not served from a prefix cache).\n# TYPE baton_prefill_tokens_total counter\nbaton_prefill_tokens_total {}",
            self.prefill_tokens.load(Ordering::Relaxed)
        );
        let _ =
            writeln!(out, "# HELP baton_queue_length Requests per worker and state.\n# TYPE baton_queue_length gauge");
        for w in workers {
            let _ = writeln!(
                out,
                "baton_queue_length{{worker=\"{}\",role=\"{}\",state=\"running\"}} {}",
                w.name, w.role, w.running
            );
            let _ = writeln!(
                out,
                "baton_queue_length{{worker=\"{}\",role=\"{}\",state=\"waiting\"}} {}",
                w.name, w.role, w.waiting
            );
        }
        let _ =
            writeln!(out, "# HELP baton_kv_blocks KV blocks per worker, tier and state.\n# TYPE baton_kv_blocks gauge");
        for w in workers {
            let _ = writeln!(
                out,
                "baton_kv_blocks{{worker=\"{}\",tier=\"device\",state=\"used\"}} {}",
                w.name, w.blocks_used
            );
            let _ = writeln!(
                out,
                "baton_kv_blocks{{worker=\"{}\",tier=\"device\",state=\"total\"}} {}",
                w.name, w.blocks_total
            );
        }
        let _ = writeln!(
            out,
            "# HELP baton_kv_index_blocks KV blocks the conductor's index holds per worker and tier (from the workers' KV events).\n# TYPE baton_kv_index_blocks gauge"
        );
        for g in index {
            for (tier, n) in ["device", "host", "disk"].iter().zip(g.blocks) {
                let _ = writeln!(out, "baton_kv_index_blocks{{worker=\"{}\",tier=\"{tier}\"}} {n}", g.name);
            }
        }
        let _ = writeln!(
            out,
            "# HELP baton_kv_events_total KV events the conductor applied, per worker.\n# TYPE baton_kv_events_total counter"
        );
        for g in index {
            let _ = writeln!(out, "baton_kv_events_total{{worker=\"{}\"}} {}", g.name, g.events);
        }
        let _ = writeln!(
            out,
            "# HELP baton_kv_index_resyncs_total Snapshots taken to resynchronise a worker's index after lost events.\n# TYPE baton_kv_index_resyncs_total counter"
        );
        for g in index {
            let _ = writeln!(out, "baton_kv_index_resyncs_total{{worker=\"{}\"}} {}", g.name, g.resyncs);
        }
        let _ = writeln!(
            out,
            "# HELP baton_kv_index_lag_seconds Age of a worker's last state update when the conductor applied it.\n# TYPE baton_kv_index_lag_seconds gauge"
        );
        for g in index {
            let _ = writeln!(out, "baton_kv_index_lag_seconds{{worker=\"{}\"}} {}", g.name, g.lag_s);
        }
        self.render_cache(&mut out);
        out
    }
}
