//! Per-request records and the metric math over them, pure: times are integer microseconds
//! from the start of a run, and every figure is a function of the records.
//!
//! Definitions (those of `vllm bench serve` where it has one):
//! - TTFT: from sending the request to the first chunk with output text.
//! - ITL (inter-token latency, "TBT"): the gaps between consecutive chunks with output text,
//!   pooled over all requests.
//! - TPOT: a request's `(JCT − TTFT) / (output tokens − 1)`, its mean time between tokens.
//! - JCT (end-to-end latency): from sending to the end of the stream.
//! - Output tokens: the server's `usage.completion_tokens` when it sends usage, otherwise the
//!   number of chunks with text.
//! - Goodput: requests per second that completed *and* met every SLO given (Mooncake's
//!   definition: a request that misses an SLO or fails counts for nothing). SLO attainment is
//!   the share of all requests sent that did so.
//! - Percentiles (p50, p90, p99): [`baton_measure::percentile`], linear interpolation between
//!   the closest ranks (numpy's default, as `vllm bench serve` reports): the one definition
//!   `baton sim` reports too.

use std::collections::BTreeMap;

pub use baton_measure::{Slo, Stats, TbtStat};
use baton_measure::{attainment, percentile};
use serde::{Deserialize, Serialize};

/// How a request ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Outcome {
    /// The stream ended normally (`[DONE]` or a finish reason).
    Ok,
    /// HTTP 429: the server refused the request (admission control).
    Rejected,
    /// Another HTTP error status.
    Http {
        /// The status code.
        status: u16,
    },
    /// The server sent an error object in the stream after headers.
    ServerError,
    /// No connection could be made.
    Connect,
    /// A wait ran past the request timeout.
    Timeout,
    /// The stream broke off or could not be parsed.
    Stream,
}

impl Outcome {
    /// A short name for counting outcomes by kind (`ok`, `rejected_429`, `http_503`, ...).
    pub fn kind(&self) -> String {
        match self {
            Outcome::Ok => "ok".into(),
            Outcome::Rejected => "rejected_429".into(),
            Outcome::Http { status } => format!("http_{status}"),
            Outcome::ServerError => "server_error".into(),
            Outcome::Connect => "connect".into(),
            Outcome::Timeout => "timeout".into(),
            Outcome::Stream => "stream".into(),
        }
    }
}

/// One request as the client saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Index of the request in the run, in order of sending.
    pub id: usize,
    /// The chain (session or independent request) it belongs to.
    pub chain: usize,
    /// Its turn within the chain (0 for independent requests).
    pub turn: usize,
    /// When the arrival process released it (µs from the start of the run).
    pub scheduled_us: u64,
    /// When it was sent (µs from the start of the run); later than `scheduled_us` when a
    /// concurrency limit held it back.
    pub start_us: u64,
    /// Time to the first chunk with text, if one came.
    pub ttft_us: Option<u64>,
    /// Gaps between consecutive chunks with text.
    pub itl_us: Vec<u64>,
    /// Sending to the end of the stream (or to the failure).
    pub jct_us: u64,
    /// Prompt tokens: the server's `usage.prompt_tokens` when sent, else the workload's target.
    pub input_tokens: u64,
    /// Whether `input_tokens` came from the server.
    pub input_from_usage: bool,
    /// Of `input_tokens`, those the server served from a prefix cache, when it said
    /// (`usage.prompt_tokens_details.cached_tokens`).
    #[serde(default)]
    pub cached_tokens: Option<u64>,
    /// Output tokens: `usage.completion_tokens` when sent, else chunks with text.
    pub output_tokens: u64,
    /// Chunks with text.
    pub chunks: u64,
    /// `max_tokens` asked for.
    pub max_tokens: u64,
    /// How it ended.
    pub outcome: Outcome,
    /// The error, for failed requests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl RequestRecord {
    /// Whether the request completed.
    pub fn ok(&self) -> bool {
        self.outcome == Outcome::Ok
    }

    /// Mean time per output token after the first, if there were two or more.
    pub fn tpot_us(&self) -> Option<f64> {
        let ttft = self.ttft_us?;
        (self.output_tokens > 1).then(|| (self.jct_us.saturating_sub(ttft)) as f64 / (self.output_tokens - 1) as f64)
    }

    /// When the stream ended (µs from the start of the run).
    pub fn end_us(&self) -> u64 {
        self.start_us + self.jct_us
    }

    /// Its time between tokens as `stat` reads it, µs, if it had two tokens or more.
    pub fn tbt_us(&self, stat: TbtStat) -> Option<f64> {
        match stat {
            TbtStat::Mean => self.tpot_us(),
            TbtStat::P90 => {
                let mut v = self.itl_us.clone();
                v.sort_unstable();
                (!v.is_empty()).then(|| percentile(&v, 90.0))
            }
            TbtStat::Max => self.itl_us.iter().max().map(|&x| x as f64),
        }
    }

    /// Whether it completed and met every target of `slo`.
    pub fn met(&self, slo: &Slo) -> bool {
        self.ok() && slo.met_by(self.ttft_us, self.tbt_us(slo.tbt_stat))
    }
}

/// SLO figures of a run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SloSummary {
    /// The targets.
    pub slo: Slo,
    /// Requests that completed and met every target.
    pub met: usize,
    /// `met` over all requests sent.
    pub attainment: f64,
    /// `met` per second of the run.
    pub goodput_req_s: f64,
}

/// The figures of one run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Requests sent.
    pub sent: usize,
    /// Requests that completed.
    pub completed: usize,
    /// Requests by outcome kind (`ok`, `rejected_429`, `http_500`, `timeout`, ...).
    pub outcomes: BTreeMap<String, usize>,
    /// Wall time of the run, first send to last end, seconds.
    pub duration_s: f64,
    /// Prompt tokens of completed requests.
    pub input_tokens: u64,
    /// Output tokens of completed requests.
    pub output_tokens: u64,
    /// Completed requests per second.
    pub request_throughput: f64,
    /// Output tokens per second.
    pub output_throughput: f64,
    /// Prompt and output tokens per second.
    pub total_token_throughput: f64,
    /// Time to first token, ms (completed requests).
    pub ttft_ms: Stats,
    /// Mean time per output token after the first, ms (completed requests of 2+ tokens).
    pub tpot_ms: Stats,
    /// Gaps between chunks, ms, pooled over completed requests.
    pub itl_ms: Stats,
    /// End-to-end latency, ms (completed requests).
    pub jct_ms: Stats,
    /// Most requests in flight at once.
    pub max_in_flight: usize,
    /// SLO attainment and goodput, when targets were given.
    pub slo: Option<SloSummary>,
}

/// Summarises the records of one run. The run's duration is taken from the records (first send
/// to last end); `min_duration_us` sets a floor (the run's wall time, when known).
pub fn summarize(records: &[RequestRecord], slo: &Slo, min_duration_us: u64) -> Summary {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.ok()).collect();
    let mut outcomes = BTreeMap::new();
    for r in records {
        *outcomes.entry(r.outcome.kind()).or_insert(0) += 1;
    }
    let first = records.iter().map(|r| r.start_us).min().unwrap_or(0);
    let last = records.iter().map(RequestRecord::end_us).max().unwrap_or(0);
    let duration_s = (last.saturating_sub(first)).max(min_duration_us) as f64 / 1e6;
    let per_s = |x: f64| if duration_s > 0.0 { x / duration_s } else { 0.0 };
    let ms = |us: f64| us / 1e3;
    let input_tokens: u64 = ok.iter().map(|r| r.input_tokens).sum();
    let output_tokens: u64 = ok.iter().map(|r| r.output_tokens).sum();
    let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_us).map(|t| ms(t as f64)).collect();
    let tpot: Vec<f64> = ok.iter().filter_map(|r| r.tpot_us()).map(ms).collect();
    let itl: Vec<f64> = ok.iter().flat_map(|r| r.itl_us.iter()).map(|&t| ms(t as f64)).collect();
    let jct: Vec<f64> = ok.iter().map(|r| ms(r.jct_us as f64)).collect();
    let slo_summary = slo.is_set().then(|| {
        let met = records.iter().filter(|r| r.met(slo)).count();
        SloSummary { slo: *slo, met, attainment: attainment(met, records.len()), goodput_req_s: per_s(met as f64) }
    });
    Summary {
        sent: records.len(),
        completed: ok.len(),
        outcomes,
        duration_s,
        input_tokens,
        output_tokens,
        request_throughput: per_s(ok.len() as f64),
        output_throughput: per_s(output_tokens as f64),
        total_token_throughput: per_s((input_tokens + output_tokens) as f64),
        ttft_ms: Stats::of(&ttft),
        tpot_ms: Stats::of(&tpot),
        itl_ms: Stats::of(&itl),
        jct_ms: Stats::of(&jct),
        max_in_flight: in_flight(records).iter().map(|&(_, n)| n).max().unwrap_or(0),
        slo: slo_summary,
    }
}

/// Requests in flight over time: `(µs, count from then on)` at every send and end, in order.
/// An end at the same instant as a send is counted first.
pub fn in_flight(records: &[RequestRecord]) -> Vec<(u64, usize)> {
    let mut events: Vec<(u64, i64)> = Vec::with_capacity(records.len() * 2);
    for r in records {
        events.push((r.start_us, 1));
        events.push((r.end_us(), -1));
    }
    events.sort();
    let mut n = 0i64;
    let mut out: Vec<(u64, usize)> = Vec::with_capacity(events.len());
    for (t, d) in events {
        n += d;
        match out.last_mut() {
            Some(last) if last.0 == t => last.1 = n.max(0) as usize,
            _ => out.push((t, n.max(0) as usize)),
        }
    }
    out
}
