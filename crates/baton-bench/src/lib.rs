//! Baton's load generator: `baton bench serve` against any OpenAI-compatible server.
//!
//! A benchmark sends a [`workload`] (synthetic lengths, shared-prefix sessions with causal
//! turns, a ShareGPT file or a Mooncake trace) under an [`arrival`] process (Poisson at a rate,
//! a trace's timestamps, a closed loop at a concurrency; several rates in one sweep), streams
//! every answer and records per request the time to first token, the gaps between tokens and
//! the end-to-end latency ([`metrics`]). The summary has mean / p50 / p90 / p99 of each,
//! throughput, outcomes by kind (HTTP 429 rejections, errors) and, given TTFT and TBT targets,
//! SLO attainment and goodput. The [`report`] is JSON with every record; [`plot`] draws CDFs,
//! in-flight timelines and sweep curves.
//!
//! The core is pure (workloads, schedules, SSE parsing, metric math, tables); [`client`] and
//! [`runner`] are the thin I/O shell.
//!
//! ```no_run
//! use std::sync::Arc;
//! use baton_bench::{BenchConfig, arrival::Arrival, workload::{LengthDist, WorkloadSpec}};
//!
//! # async fn demo() -> Result<(), baton_bench::BenchError> {
//! let config = BenchConfig {
//!     workload: WorkloadSpec::Synthetic {
//!         requests: 64,
//!         input: LengthDist::Fixed(256),
//!         output: LengthDist::Uniform { min: 16, max: 128 },
//!     },
//!     arrivals: vec![Arrival::Poisson { rate: 2.0 }, Arrival::Poisson { rate: 4.0 }],
//!     ..BenchConfig::new("http://127.0.0.1:8000")
//! };
//! let report = baton_bench::run(&config, Arc::new(baton_bench::runner::Quiet)).await?;
//! print!("{}", baton_bench::report::summary_table(&report));
//! # Ok(()) }
//! ```

pub mod arrival;
pub mod client;
pub mod metrics;
pub mod plot;
pub mod progress;
pub mod report;
pub mod runner;
pub mod sse;
pub mod storm;
pub mod text;
pub mod workload;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::arrival::Arrival;
use crate::client::{Client, Endpoint, RequestOptions};
use crate::metrics::Slo;
use crate::report::{Report, RunReport};
use crate::runner::{Observer, RunPlan};
use crate::workload::{LengthDist, WorkloadSpec};

/// Why a benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file is malformed.
    #[error("{what}, line {line}: {message}")]
    Parse {
        /// Which file.
        what: String,
        /// Line (1-based; 0 when unknown).
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// The configuration is invalid.
    #[error("{0}")]
    Config(String),
    /// The server could not be asked (before the run).
    #[error("{0}")]
    Http(String),
    /// A plot could not be drawn.
    #[error("plot {0}")]
    Plot(String),
}

/// A whole benchmark: the server, the workload, the arrival processes (one run each) and the
/// bounds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchConfig {
    /// The server's root URL (`http://127.0.0.1:8000`).
    pub url: String,
    /// Replicas of the server (conductors routing to the same workers): requests go to `url` and
    /// these in turn, one each, as a round-robin load balancer would send them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<String>,
    /// Completions or chat.
    pub endpoint: Endpoint,
    /// Model id to send; the server's first listed model when absent.
    pub model: Option<String>,
    /// Bearer token (never written to reports).
    #[serde(skip)]
    pub api_key: Option<String>,
    /// What to send.
    pub workload: WorkloadSpec,
    /// Keep at most this many requests of the workload.
    pub max_requests: Option<usize>,
    /// One run per entry, in order (a sweep when several).
    pub arrivals: Vec<Arrival>,
    /// Most requests in flight in open-loop runs.
    pub max_concurrency: Option<usize>,
    /// Send nothing new after this many seconds of a run.
    pub duration_s: Option<f64>,
    /// Limit of one request (connect, headers, every chunk), seconds.
    pub request_timeout_s: f64,
    /// Limit of making a connection, seconds.
    pub connect_timeout_s: f64,
    /// Pause between an answer and the session's next turn, ms.
    pub think_time_ms: f64,
    /// Ask for exactly `max_tokens` (`ignore_eos: true`).
    pub ignore_eos: bool,
    /// Sampling temperature.
    pub temperature: f64,
    /// Seed of everything random (lengths, texts, arrivals, sampling seeds). The runs of a sweep
    /// share lengths but get fresh texts, so none meets another's prompts in a prefix cache.
    pub seed: u64,
    /// Latency targets for attainment and goodput.
    pub slo: Slo,
    /// Allow a server that is not on this machine (loopback).
    pub allow_remote: bool,
}

impl BenchConfig {
    /// 100 synthetic requests of 128 tokens in and out, all at once, against `url`.
    pub fn new(url: &str) -> Self {
        BenchConfig {
            url: url.to_owned(),
            replicas: Vec::new(),
            endpoint: Endpoint::Completions,
            model: None,
            api_key: None,
            workload: WorkloadSpec::Synthetic {
                requests: 100,
                input: LengthDist::Fixed(128),
                output: LengthDist::Fixed(128),
            },
            max_requests: None,
            arrivals: vec![Arrival::Burst],
            max_concurrency: None,
            duration_s: None,
            request_timeout_s: 300.0,
            connect_timeout_s: 10.0,
            think_time_ms: 0.0,
            ignore_eos: false,
            temperature: 0.0,
            seed: 0,
            slo: Slo::default(),
            allow_remote: false,
        }
    }

    /// Checks the configuration: positive limits, valid arrivals, and a loopback server unless
    /// remote ones are allowed.
    pub fn validate(&self) -> Result<(), BenchError> {
        for url in std::iter::once(&self.url).chain(&self.replicas) {
            if !self.allow_remote && !is_loopback_url(url)? {
                return Err(BenchError::Config(format!(
                    "{url} is not on this machine (loopback); pass --allow-remote to benchmark it"
                )));
            }
        }
        if self.arrivals.is_empty() {
            return Err(BenchError::Config("no arrival process given".into()));
        }
        for a in &self.arrivals {
            a.validate()?;
        }
        let positive = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(BenchError::Config(format!("{name} must be positive, got {v}")))
            }
        };
        positive("the request timeout", self.request_timeout_s)?;
        positive("the connect timeout", self.connect_timeout_s)?;
        if let Some(d) = self.duration_s {
            positive("the duration", d)?;
        }
        if !(self.think_time_ms.is_finite() && self.think_time_ms >= 0.0) {
            return Err(BenchError::Config(format!("think time must be >= 0, got {}", self.think_time_ms)));
        }
        if self.max_concurrency == Some(0) {
            return Err(BenchError::Config("max concurrency must be at least 1".into()));
        }
        Ok(())
    }
}

/// Whether `url`'s host is this machine's loopback (`localhost`, 127.0.0.0/8, `::1`).
pub fn is_loopback_url(url: &str) -> Result<bool, BenchError> {
    let parsed = reqwest::Url::parse(url).map_err(|e| BenchError::Config(format!("bad URL {url:?}: {e}")))?;
    if parsed.scheme() != "http" && parsed.scheme() != "https" {
        return Err(BenchError::Config(format!("bad URL {url:?}: expected http:// or https://")));
    }
    Ok(match parsed.host() {
        Some(url::Host::Domain(d)) => d.eq_ignore_ascii_case("localhost"),
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        None => false,
    })
}

/// Runs a benchmark: builds the workload, then one run per arrival process, each over the whole
/// workload, and summarises each.
pub async fn run(config: &BenchConfig, observer: Arc<dyn Observer>) -> Result<Report, BenchError> {
    config.validate()?;
    // Every run of a sweep gets the same lengths but fresh prompt texts (see `Seeds::for_run`).
    let build_run = |run: usize| -> Result<workload::Workload, BenchError> {
        let mut workload = workload::build(&config.workload, workload::Seeds::for_run(config.seed, run))?;
        if let Some(n) = config.max_requests {
            workload.truncate(n);
        }
        Ok(workload)
    };
    let mut workload = build_run(0)?;
    if workload.requests() == 0 {
        return Err(BenchError::Config("the workload has no requests".into()));
    }
    let request_timeout = Duration::from_secs_f64(config.request_timeout_s);
    let client = Arc::new(
        Client::new(&config.url, config.api_key.clone(), Duration::from_secs_f64(config.connect_timeout_s))?
            .with_replicas(&config.replicas),
    );
    let model = match &config.model {
        Some(m) => m.clone(),
        None => client.first_model(request_timeout.min(Duration::from_secs(30))).await?,
    };
    let opts = Arc::new(RequestOptions {
        endpoint: config.endpoint,
        model: model.clone(),
        ignore_eos: config.ignore_eos,
        temperature: config.temperature,
    });
    let mut runs = Vec::new();
    for (k, arrival) in config.arrivals.iter().enumerate() {
        if k > 0 {
            workload = build_run(k)?;
        }
        let plan = RunPlan {
            starts: arrival::schedule(arrival, &workload, config.seed)?,
            concurrency: arrival.concurrency_limit(config.max_concurrency),
            duration: config.duration_s.map(Duration::from_secs_f64),
            request_timeout,
            think_time: Duration::from_secs_f64(config.think_time_ms / 1e3),
            seed: config.seed,
        };
        let label = arrival.label();
        observer.run_started(&label, workload.requests());
        let records = runner::run(client.clone(), opts.clone(), &workload, &plan, observer.clone()).await;
        observer.run_finished();
        let summary = metrics::summarize(&records, &config.slo, 0);
        runs.push(RunReport { label, arrival: *arrival, summary, records });
    }
    Ok(Report {
        tool: "baton-bench".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        model,
        config: config.clone(),
        workload_requests: workload.requests(),
        runs,
    })
}
