//! The conductor's live status page, `GET /dashboard`, and the JSON it polls,
//! `GET /dashboard/state`.
//!
//! The page is plain HTML and JavaScript embedded in the binary (`dashboard.html`, no build
//! step). It asks for [`State`] once a second and draws it: the workers (role, state, load, KV
//! blocks by tier, prefix-cache hit rate), the request counters and latency percentiles, KV
//! moved by transport, and the role switches and rejections it saw change while open (rates
//! and "recent" events are differences between two polls, computed in the browser as
//! Prometheus' `rate()` would be).
//!
//! Nothing here keeps state of its own. A [`State`] is gathered from the conductor's accessors
//! (its workers, their stats, the breaker, the KV index) and from its own `/metrics` text, parsed
//! back ([`parse_exposition`]), so the page and Prometheus never disagree on a figure.

use std::collections::BTreeMap;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::Conductor;
use crate::metrics::{Metrics, Scrape};

/// The page itself.
const PAGE: &str = include_str!("dashboard.html");

/// `GET /dashboard`: the page. It holds no data (that is `/dashboard/state`, behind the API
/// key), so a browser can open it without a header; with `--api-key` the page reads the key
/// from its URL's fragment (`/dashboard#key=KEY`, never sent to the server) and sends it as a
/// bearer token.
pub async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'",
            ),
        ],
        PAGE,
    )
        .into_response()
}

/// `GET /dashboard/state`, once the caller is authorised: the cluster as the page draws it.
pub async fn state(conductor: &Conductor, metrics: &Metrics) -> Response {
    let state = gather(conductor, metrics).await;
    ([(header::CACHE_CONTROL, "no-store")], axum::Json(state)).into_response()
}

/// What the page draws, one poll's worth.
#[derive(Debug, Clone, Serialize)]
pub struct State {
    /// The served model's id.
    pub model: String,
    /// The conductor's uptime, seconds (the page's clock for rates).
    pub uptime_s: f64,
    /// The workers, by name.
    pub workers: Vec<WorkerRow>,
    /// Requests waiting in the conductor's admission queue for decode room.
    pub admission_queue: usize,
    /// Counters, by `metric{label="value"}` as `/metrics` names them (cumulative).
    pub counters: BTreeMap<String, f64>,
    /// Latency percentiles from `/metrics`' histograms, seconds.
    pub latency: Latency,
}

/// One worker's row.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerRow {
    /// Its name.
    pub name: String,
    /// Its role now: `prefill`, `decode` or `colocated`.
    pub role: &'static str,
    /// `ready`, `draining` (finishing what it holds, taking nothing new), `suspected` (its
    /// breaker tripped: out of routing until a probe answers) or `unreachable` (no stats).
    pub state: &'static str,
    /// Its KV cache's kind (element type and shape) where it said one: KV moves only between
    /// equal kinds.
    pub kv: Option<String>,
    /// Requests running.
    pub running: usize,
    /// Requests waiting.
    pub waiting: usize,
    /// KV on its way in.
    pub pulling: usize,
    /// KV handed off and still leased.
    pub leased: usize,
    /// Device blocks in use and in all.
    pub blocks_used: usize,
    /// Device blocks in all.
    pub blocks_total: usize,
    /// Blocks the conductor's index holds for it, by tier: device, host, disk.
    pub cached_blocks: [usize; 3],
    /// Prompt tokens not computed yet, from its last load report.
    pub queued_prefill_tokens: usize,
    /// Its prefix cache's hit rate so far: prompt tokens served from cache over those looked up.
    pub hit_rate: Option<f64>,
}

/// Percentiles of the conductor's latency histograms, seconds (None before any sample).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Latency {
    /// Time to first token: p50, p90, p99.
    pub ttft: [Option<f64>; 3],
    /// Time between tokens: p50, p90, p99.
    pub tbt: [Option<f64>; 3],
    /// Request latency, end to end: p50, p90, p99.
    pub e2e: [Option<f64>; 3],
}

/// The quantiles [`Latency`] holds.
const QUANTILES: [f64; 3] = [0.5, 0.9, 0.99];

/// The counters the page shows, by metric name (every series of each).
const COUNTERS: &[&str] = &[
    "baton_requests_total",
    "baton_routing_decisions_total",
    "baton_prompt_tokens_total",
    "baton_generation_tokens_total",
    "baton_prefill_tokens_total",
    "baton_kv_transfers_total",
    "baton_kv_transfer_bytes_total",
    "baton_kv_transfer_tokens_total",
    "baton_kv_fetch_bytes_total",
    "baton_kv_fetches_total",
    "baton_kv_return_tokens_total",
    "baton_role_switches_total",
    "baton_role_switch_failures_total",
    "baton_retries_total",
    "baton_migrations_total",
    "baton_worker_breaker_trips_total",
];

async fn gather(conductor: &Conductor, metrics: &Metrics) -> State {
    let index = conductor.view().gauges();
    let text = metrics.render(&Scrape::default());
    let samples = parse_exposition(&text);
    let mut workers = Vec::new();
    for w in conductor.workers() {
        let name = w.name().to_owned();
        let stats = w.stats().await;
        let state = match &stats {
            _ if conductor.is_tripped(&name) => "suspected",
            None => "unreachable",
            Some(s) if s.draining => "draining",
            Some(_) => "ready",
        };
        let stats = stats.unwrap_or_default();
        let cached_blocks = index.iter().find(|g| g.name == name).map_or([0; 3], |g| g.blocks);
        let report = conductor.view().report(&name);
        let per_worker = |metric: &str| {
            samples.iter().find(|s| s.name == metric && s.label("worker") == Some(name.as_str())).map(|s| s.value)
        };
        let hit_rate = match (
            per_worker("baton_prefix_cache_hits_tokens_total"),
            per_worker("baton_prefix_cache_queries_tokens_total"),
        ) {
            (Some(hits), Some(queries)) if queries > 0.0 => Some(hits / queries),
            _ => None,
        };
        workers.push(WorkerRow {
            role: w.role().as_str(),
            state,
            kv: w.kv_kind().map(str::to_owned),
            running: stats.running,
            waiting: stats.waiting,
            pulling: stats.pulling,
            leased: stats.leased,
            blocks_used: stats.total_blocks.saturating_sub(stats.available_blocks),
            blocks_total: stats.total_blocks,
            cached_blocks,
            queued_prefill_tokens: report.map_or(0, |r| r.queued_prefill_tokens),
            hit_rate,
            name,
        });
    }
    workers.sort_by(|a, b| a.name.cmp(&b.name));
    let counters = samples.iter().filter(|s| COUNTERS.contains(&s.name.as_str())).map(|s| (s.key(), s.value)).collect();
    let percentiles = |histogram: &str| {
        let buckets = buckets(&samples, histogram);
        QUANTILES.map(|q| histogram_quantile(q, &buckets))
    };
    State {
        model: conductor.model_id().to_owned(),
        uptime_s: conductor.now_us() as f64 / 1e6,
        workers,
        admission_queue: conductor.queued(),
        counters,
        latency: Latency {
            ttft: percentiles("baton_time_to_first_token_seconds"),
            tbt: percentiles("baton_time_between_tokens_seconds"),
            e2e: percentiles("baton_request_duration_seconds"),
        },
    }
}

/// One sample of Prometheus' text format: `name{label="value",...} value`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The metric's name (with `_bucket`, `_sum` or `_count` for a histogram's series).
    pub name: String,
    /// Its labels, in the order written.
    pub labels: Vec<(String, String)>,
    /// Its value.
    pub value: f64,
}

impl Sample {
    /// The value of label `name`, if the sample has it.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// `name{k="v",...}`, as the text format writes it (the name alone without labels).
    pub fn key(&self) -> String {
        if self.labels.is_empty() {
            return self.name.clone();
        }
        let labels: Vec<String> = self.labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
        format!("{}{{{}}}", self.name, labels.join(","))
    }
}

/// The samples of a text-format exposition (comments and lines that do not parse left out).
pub fn parse_exposition(text: &str) -> Vec<Sample> {
    text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()).filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Sample> {
    let (series, value) = line.rsplit_once(' ')?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    let Some((name, rest)) = series.split_once('{') else {
        return Some(Sample { name: series.to_owned(), labels: Vec::new(), value });
    };
    let mut labels = Vec::new();
    let mut rest = rest.strip_suffix('}')?;
    while !rest.is_empty() {
        let (key, after) = rest.split_once("=\"")?;
        // A value ends at the first quote that no backslash escapes.
        let mut end = None;
        let mut escaped = false;
        for (i, c) in after.char_indices() {
            match c {
                '\\' if !escaped => escaped = true,
                '"' if !escaped => {
                    end = Some(i);
                    break;
                }
                _ => escaped = false,
            }
        }
        let end = end?;
        let raw = &after[..end];
        let value = raw.replace("\\\"", "\"").replace("\\n", "\n").replace("\\\\", "\\");
        labels.push((key.trim_start_matches(',').to_owned(), value));
        rest = after[end + 1..].trim_start_matches(',');
    }
    Some(Sample { name: name.to_owned(), labels, value })
}

/// A histogram's cumulative buckets, `(upper bound, count)` in ascending order of bound, summed
/// over its series.
pub fn buckets(samples: &[Sample], histogram: &str) -> Vec<(f64, f64)> {
    let name = format!("{histogram}_bucket");
    let mut by_bound: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
    for s in samples.iter().filter(|s| s.name == name) {
        let Some(le) = s.label("le").and_then(|le| if le == "+Inf" { Some(f64::INFINITY) } else { le.parse().ok() })
        else {
            continue;
        };
        // f64's bits order as the numbers do for the non-negative bounds a histogram has.
        let entry = by_bound.entry(le.to_bits()).or_insert((le, 0.0));
        entry.1 += s.value;
    }
    by_bound.into_values().collect()
}

/// The `q`-quantile of a histogram's cumulative buckets, as Prometheus' `histogram_quantile`
/// (and so Grafana's panels) estimates it: linear within the bucket the rank falls in, the
/// lowest bucket's lower bound taken as 0, a rank in the `+Inf` bucket answered with the highest
/// finite bound. None without observations.
pub fn histogram_quantile(q: f64, buckets: &[(f64, f64)]) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 || !(0.0..=1.0).contains(&q) {
        return None;
    }
    let rank = q * total;
    let mut lower = (0.0, 0.0);
    for &(bound, count) in buckets {
        if count >= rank {
            if bound.is_infinite() {
                return Some(lower.0);
            }
            if count == lower.1 {
                return Some(bound);
            }
            return Some(lower.0 + (bound - lower.0) * (rank - lower.1) / (count - lower.1));
        }
        lower = (bound, count);
    }
    Some(lower.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Outcome;

    #[test]
    fn the_conductors_own_metrics_parse_back_with_their_labels_and_values() {
        let m = Metrics::default();
        m.outcome(Outcome::Ok);
        m.outcome(Outcome::Ok);
        m.outcome(Outcome::Rejected);
        m.prefix_cache("prefill-0", 100, 64);
        m.role_switch("prefill", "decode");
        let samples = parse_exposition(&m.render(&Scrape::default()));
        let value = |key: &str| samples.iter().find(|s| s.key() == key).map(|s| s.value);
        assert_eq!(value("baton_requests_total{outcome=\"ok\"}"), Some(2.0));
        assert_eq!(value("baton_requests_total{outcome=\"rejected\"}"), Some(1.0));
        assert_eq!(value("baton_prefix_cache_hits_tokens_total{worker=\"prefill-0\"}"), Some(64.0));
        assert_eq!(value("baton_prefix_cache_queries_tokens_total{worker=\"prefill-0\"}"), Some(100.0));
        let switch = samples.iter().find(|s| s.name == "baton_role_switches_total").expect("a role switch series");
        assert_eq!((switch.label("from"), switch.label("to"), switch.value), (Some("prefill"), Some("decode"), 1.0));
    }

    #[test]
    fn escaped_label_values_and_infinities_parse() {
        let s = parse_exposition("x_bucket{a=\"q\\\"u,o}te\",le=\"+Inf\"} 3\nbad line\n# HELP x y\ny -Inf\n");
        assert_eq!(s.len(), 2, "{s:?}");
        assert_eq!(s[0].label("a"), Some("q\"u,o}te"));
        assert_eq!(s[0].label("le"), Some("+Inf"));
        assert_eq!(s[0].value, 3.0);
        assert_eq!(s[1].value, f64::NEG_INFINITY);
    }

    #[test]
    fn quantiles_interpolate_within_their_bucket_as_prometheus_does() {
        // 10 observations ≤ 0.1, 10 more in (0.1, 0.5], none above.
        let b = [(0.1, 10.0), (0.5, 20.0), (1.0, 20.0), (f64::INFINITY, 20.0)];
        assert_eq!(histogram_quantile(0.5, &b), Some(0.1));
        assert!((histogram_quantile(0.75, &b).expect("a 0.75-quantile") - 0.3).abs() < 1e-12);
        assert!((histogram_quantile(0.25, &b).expect("a 0.25-quantile") - 0.05).abs() < 1e-12);
        assert_eq!(histogram_quantile(0.5, &[(0.1, 0.0), (f64::INFINITY, 0.0)]), None);
        assert_eq!(histogram_quantile(0.5, &[]), None);
        // A rank past every finite bound is answered with the highest finite bound.
        assert_eq!(histogram_quantile(0.99, &[(0.1, 1.0), (f64::INFINITY, 5.0)]), Some(0.1));
    }

    #[test]
    fn buckets_sum_every_series_of_a_histogram_in_bound_order() {
        let m = Metrics::default();
        m.ttft.observe(0.02);
        m.ttft.observe(0.2);
        m.ttft.observe(20.0);
        let samples = parse_exposition(&m.render(&Scrape::default()));
        let b = buckets(&samples, "baton_time_to_first_token_seconds");
        assert!(b.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1), "{b:?}");
        assert_eq!(b.last().copied(), Some((f64::INFINITY, 3.0)));
        let p50 = histogram_quantile(0.5, &b).expect("a median");
        assert!(p50 > 0.1 && p50 <= 0.25, "the median observation, 0.2 s, is in (0.1, 0.25]: {p50}");
    }
}
