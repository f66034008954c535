//! Discrete-event simulation of a Baton cluster on integer virtual time.
//!
//! The simulator drives the *same* [`baton_sched`] policies, admission controls, global prompt
//! trees and cost model as the live conductor: every arrival builds a
//! [`ClusterSnapshot`](baton_sched::ClusterSnapshot) from the virtual instances and calls
//! [`Scheduler::decide`](baton_sched::Scheduler::decide). Instance caches emit `baton-kv`
//! [`KvEvent`](baton_kv::KvEvent)s that feed the trees, as a worker's MemPool would.
//!
//! - [`workload`]: Mooncake-format traces (`timestamp`, `input_length`, `output_length`,
//!   `hash_ids`), ShareGPT-style files, Poisson, shared-prefix, own-context and hot-prefix
//!   generators.
//! - [`Simulator`]: the event loop (queues, continuous batching, KV capacity per tier, transfers).
//! - [`Report`]: TTFT / TBT / JCT percentiles, SLO attainment, goodput, rejections, wasted
//!   prefill, as JSON; [`plot`] draws CDFs and summaries of several runs as PNG and SVG.
//!
//! ```
//! use baton_sim::{ClusterConfig, SimConfig, WorkloadSpec, workload::Synthetic};
//!
//! let cfg = SimConfig {
//!     cluster: ClusterConfig { prefill: 2, decode: 2, ..ClusterConfig::default() },
//!     workload: WorkloadSpec::Synthetic(Synthetic::Poisson {
//!         requests: 20,
//!         rate: 2.0,
//!         input: (1000, 4000),
//!         output: (10, 50),
//!     }),
//!     ..SimConfig::default()
//! };
//! let report = baton_sim::run(&cfg)?;
//! assert_eq!(report.completed, 20);
//! assert_eq!(report, baton_sim::run(&cfg)?, "deterministic for a seed");
//! # Ok::<(), baton_sim::SimError>(())
//! ```

mod cache;
pub mod load;
mod metrics;
pub mod plot;
mod sim;
pub mod workload;

use std::path::PathBuf;

use baton_sched::{AdmissionConfig, CostProfile, Micros, PolicyConfig, PolicyKind};

pub use load::{AdmissionSample, LoadSample, LoadTrace};
pub use metrics::{Percentiles, Report, RequestRecord, RoleChangeAt};
pub use sim::Simulator;
use workload::{SimRequest, Synthetic};

/// Errors of a simulation run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A workload file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A workload file is malformed.
    #[error("line {line}: {message}")]
    Parse {
        /// 1-based line (0: the whole file).
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// The configuration is unusable.
    #[error("bad configuration: {0}")]
    Config(String),
}

impl From<baton_measure::trace::ParseError> for SimError {
    fn from(e: baton_measure::trace::ParseError) -> Self {
        SimError::Parse { line: e.line, message: e.message }
    }
}

/// The simulated cluster.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterConfig {
    /// Prefill-only instances (ids first).
    pub prefill: usize,
    /// Decode-only instances (ids next).
    pub decode: usize,
    /// Colocated instances (ids last).
    pub colocated: usize,
    /// Tokens per KV block.
    pub block_tokens: u64,
    /// Device KV blocks per instance (running decodes).
    pub device_blocks: u64,
    /// Device blocks a prefill instance keeps as prefix cache.
    pub device_cache_blocks: u64,
    /// Host DRAM blocks per instance (second cache tier).
    pub host_blocks: u64,
    /// Largest decode batch.
    pub max_batch: usize,
    /// Whether an instance may fetch a prefix cached on another (`baton sim --kv-fetch`, as the
    /// live conductor's `--kv-fetch`).
    pub kv_fetch: bool,
    /// Prompt tokens a prefill step computes at most (the engine's `--prefill-chunk`): a
    /// layer-wise push leaves the last chunk's last layer to cross after the prefill.
    pub prefill_chunk: u64,
}

impl Default for ClusterConfig {
    /// 8 prefill + 8 decode instances of 8×A800 (LLaMA-2-70B): 640 GB of HBM less 138 GB of
    /// weights, 90% of it for KV, is ≈2,690 blocks of 512 tokens × 327,680 B; a host pool of
    /// ≈1 TB of DRAM is ≈6,000 blocks.
    fn default() -> Self {
        Self {
            prefill: 8,
            decode: 8,
            colocated: 0,
            block_tokens: workload::MOONCAKE_BLOCK_TOKENS,
            device_blocks: 2_690,
            device_cache_blocks: 2_690,
            host_blocks: 6_000,
            max_batch: 256,
            kv_fetch: true,
            prefill_chunk: 512,
        }
    }
}

/// Where the requests come from.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkloadSpec {
    /// A Mooncake-format trace file, arrivals divided by `time_scale`.
    MooncakeTrace {
        /// The file.
        path: PathBuf,
        /// Replay speed (2.0: twice as fast).
        time_scale: f64,
    },
    /// A ShareGPT-style JSON file with Poisson arrivals.
    ShareGpt {
        /// The file.
        path: PathBuf,
        /// Requests per second.
        rate: f64,
    },
    /// A generator.
    Synthetic(Synthetic),
    /// Requests given directly.
    Requests(Vec<SimRequest>),
}

/// Everything a run needs.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// The cluster.
    pub cluster: ClusterConfig,
    /// The cost model (step and transfer times).
    pub cost: CostProfile,
    /// The routing policy.
    pub policy: PolicyKind,
    /// Its parameters.
    pub policy_config: PolicyConfig,
    /// Admission control and SLOs.
    pub admission: AdmissionConfig,
    /// TTL of the scheduler's unconfirmed prompt-tree entries.
    pub tree_ttl_us: Micros,
    /// How often the policy may change roles (0: never asked).
    pub rebalance_interval_us: Micros,
    /// Elastic roles whatever the routing policy, as the live conductor's `--elastic`: roles
    /// change by load-aware's rule (with `policy_config.load_aware`), not the routing policy's.
    pub elastic: bool,
    /// Conditional disaggregation: the most prompt tokens not cached on its decode instance
    /// that a request may compute there whole, without a hand-off (`None`: never; the live
    /// conductor's `--conditional-disagg-tokens`).
    pub conditional_tokens: Option<u64>,
    /// The hand-off's KV crosses the link layer by layer while the prefill computes, as the
    /// live `--kv-transfer layerwise`: it is in at the later of the prefill's end plus the
    /// last chunk's last layer (one layer's share of that chunk's KV) and the prefill compute's
    /// start plus the whole transfer (the link keeps up, or it does not). `false`: the whole transfer after the prefill (pull
    /// and push).
    pub layerwise_push: bool,
    /// The workload.
    pub workload: WorkloadSpec,
    /// Seed of the scheduler's RNG and of generators.
    pub seed: u64,
    /// Keep a [`RequestRecord`] per request in the report (`baton sim --records`).
    pub records: bool,
    /// Predictive admission assumes every request decodes for the uniform
    /// `admission.decode_time_us` (Mooncake's system-level prediction, and the live conductor's,
    /// which does not know a running request's output), instead of counting each running
    /// request gone after its remaining output (the workload's output length: the
    /// [`Request::expected_output`](baton_sched::Request) the scheduler is given).
    pub uniform_decode_time: bool,
    /// Sample every instance's load this often into the report's [`LoadTrace`], with every
    /// decode check admission makes (0: no trace; `baton sim --load-trace`).
    pub load_trace_us: Micros,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            cluster: ClusterConfig::default(),
            cost: CostProfile::llama2_70b_8xa800(),
            policy: PolicyKind::KvCentric,
            policy_config: PolicyConfig::default(),
            admission: AdmissionConfig::default(),
            tree_ttl_us: 120_000_000,
            rebalance_interval_us: 1_000_000,
            elastic: false,
            conditional_tokens: None,
            layerwise_push: false,
            workload: WorkloadSpec::Requests(Vec::new()),
            seed: 0,
            records: false,
            uniform_decode_time: false,
            load_trace_us: 0,
        }
    }
}

/// Loads the workload a config names.
pub fn load_workload(cfg: &SimConfig) -> Result<Vec<SimRequest>, SimError> {
    let bt = cfg.cluster.block_tokens;
    match &cfg.workload {
        WorkloadSpec::MooncakeTrace { path, time_scale } => workload::read_mooncake(path, *time_scale),
        WorkloadSpec::ShareGpt { path, rate } => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| SimError::Io { path: path.display().to_string(), source: e })?;
            workload::parse_sharegpt(&text, *rate, bt, cfg.seed)
        }
        WorkloadSpec::Synthetic(s) => Ok(workload::synthesize(s, bt, cfg.seed)),
        WorkloadSpec::Requests(r) => Ok(r.clone()),
    }
}

/// Runs a simulation to the end.
pub fn run(cfg: &SimConfig) -> Result<Report, SimError> {
    let c = &cfg.cluster;
    if c.prefill + c.decode + c.colocated == 0 || c.block_tokens == 0 {
        return Err(SimError::Config("need at least one instance and a non-zero block size".into()));
    }
    let requests = load_workload(cfg)?;
    Ok(Simulator::new(cfg.clone(), requests).finish())
}
