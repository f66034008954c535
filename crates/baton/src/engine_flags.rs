//! Engine options shared by `baton serve` and `baton worker`.

use baton_engine::EngineConfig;
use baton_kv::{KvDtype, KvLayout};
use baton_model::{ComputeDevice, ComputeDtype, DeviceOptions, GpuOptions, KvExport, PrefillAttention};

/// How each worker's engine is sized.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Engine and KV cache")]
pub(crate) struct EngineFlags {
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV blocks per worker.
    #[arg(long, default_value_t = 2048)]
    num_blocks: usize,
    /// Most sequences a worker runs at once.
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
    /// Most tokens a worker computes per step.
    #[arg(long, default_value_t = 512)]
    max_batch_tokens: usize,
    /// Most prompt tokens of one sequence per step (chunked prefill).
    #[arg(long, default_value_t = 512)]
    prefill_chunk: usize,
    /// KV layout: block-major or layer-major.
    #[arg(long, default_value = "block-major")]
    layout: KvLayout,
    /// Blocks of host memory each worker's prefix cache spills to (0: none). A block evicted
    /// from the device arena moves here instead of being dropped, and a prompt that finds its
    /// prefix here has it copied back.
    #[arg(long, default_value_t = 0)]
    host_kv_blocks: usize,
    /// Directory of the disk tier, below host. Each worker reserves its own block file there
    /// at start (an error if the file system lacks the room) and removes its name at once: the
    /// space returns when the worker exits, however it exits, and nothing is left behind.
    #[arg(long, value_name = "DIR")]
    disk_kv_dir: Option<std::path::PathBuf>,
    /// Blocks of the disk tier (0: none; needs --disk-kv-dir).
    #[arg(long, default_value_t = 0, requires = "disk_kv_dir")]
    disk_kv_blocks: usize,
    /// Emulate the model instead of computing it: step times from this cost profile (a JSON
    /// file from `baton profile`, or `a800` / `h100` for LLaMA-2-70B on 8×A800 / 8×H100), deterministic
    /// tokens; the engine loop, KV pool and transfers stay real.
    #[arg(long, value_name = "PROFILE")]
    emulate: Option<String>,
    /// With --emulate: each worker receives KV over a network link of this many Gb/s, carrying
    /// the emulated model's KV bytes (the profile's bytes per token), so a hand-off takes as long
    /// as between GPU instances: 8K tokens of a 70B model's KV (2.7 GB) take 215 ms at 100 Gb/s.
    /// Unset, a transfer takes the emulated arena's copy (microseconds).
    #[arg(long, value_name = "GBPS", requires = "emulate", value_parser = link_gbps)]
    emulate_link_gbps: Option<f64>,
    /// Where the model computes, in what type, and the KV cache's type (last: its own heading).
    #[command(flatten)]
    device: DeviceFlags,
}

/// Parses `--emulate-link-gbps`: a positive speed in gigabits per second.
fn link_gbps(s: &str) -> Result<f64, String> {
    let g: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if g.is_finite() && g > 0.0 && g <= 1e6 {
        Ok(g)
    } else {
        Err(format!("a link speed is a positive number of Gb/s, not {g}"))
    }
}

/// Checks `--elastic-watermarks` (`baton serve`, `baton conductor`, `baton sim`): two numbers,
/// LOW,HIGH, with 0 <= LOW < HIGH.
pub(crate) fn watermarks(w: &[f64]) -> anyhow::Result<(f64, f64)> {
    let &[low, high] = w else {
        anyhow::bail!("--elastic-watermarks takes two numbers, LOW,HIGH");
    };
    anyhow::ensure!(0.0 <= low && low < high, "--elastic-watermarks: expected 0 <= LOW < HIGH, got {low},{high}");
    Ok((low, high))
}

/// Parses `--admission-tbt-headroom`: a fraction of the TBT SLO, from 0 (admit up to the SLO)
/// to 0.9.
pub(crate) fn tbt_headroom(s: &str) -> Result<f64, String> {
    let h: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if (0.0..=0.9).contains(&h) {
        Ok(h)
    } else {
        Err(format!("the headroom is a fraction of the TBT SLO from 0 to 0.9, not {h}"))
    }
}

/// A cost profile: `a800` / `h100` (LLaMA-2-70B on 8 GPUs, from published figures) or a file
/// `baton profile` wrote.
pub(crate) fn cost_profile(spec: &str) -> anyhow::Result<baton_sched::CostProfile> {
    Ok(baton_engine::profile::load_profile(spec)?)
}

/// `--device`, `--dtype` and `--kv-dtype`, as every command that loads a model takes them.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Device")]
pub(crate) struct DeviceFlags {
    /// Where the model computes: `cpu`, or a GPU, `cuda` / `cuda:N` (a build with `--features
    /// cuda`). The KV cache then lives in that GPU's memory. `stand-in` is a testing device:
    /// the CPU's kernels over KV in memory of its own, offered to peers on this host as a GPU's
    /// arena is, so the device paths run without a GPU (texts equal the CPU's).
    #[arg(long, default_value = "cpu", value_name = "cpu|cuda[:N]|stand-in")]
    device: ComputeDevice,
    /// The GPU's compute type for weights and activations (`auto`: bfloat16; `float32` checks
    /// the GPU against the CPU token for token). The CPU computes in float32.
    #[arg(long, default_value = "auto", value_name = "auto|bfloat16|float16|float32")]
    dtype: ComputeDtype,
    /// Element type of the KV cache: `f16` or `bf16` take half the memory and half the bytes
    /// of a hand-off of `f32`. Workers hand KV only to workers of the same type: the conductor
    /// pairs prefill and decode workers of one type, and runs a request whole on a decode worker
    /// when no prefill worker shares its type. Default: f32 on the CPU, the compute type on a
    /// GPU.
    #[arg(long, value_name = "f32|f16|bf16")]
    kv_dtype: Option<KvDtype>,
    /// GPU: launch every step's kernels one by one, without CUDA graphs (as vLLM's flag).
    #[arg(long)]
    enforce_eager: bool,
    /// GPU: the attention of prefill chunks: `auto` (tensor-core tiles, with asynchronous copies
    /// where the device allows), `tiled-sync` (tiles loaded through registers) or `rows` (row by
    /// row, as decode). For measuring what the tiles buy.
    #[arg(long, value_enum, default_value = "auto")]
    prefill_attention: PrefillAttentionArg,
    /// GPU: how the KV arena is offered to worker processes on the same host: `vmm` (a CUDA
    /// virtual-memory allocation the peer imports: its copies stay safe if this process dies)
    /// or `ipc` (legacy CUDA IPC).
    #[arg(long, value_enum, default_value = "vmm")]
    kv_export: KvExportArg,
    /// GPU: page-lock the host arena, so a step's whole blocks go down to it by DMA (`off`:
    /// through staging).
    #[arg(long, value_enum, default_value = "on")]
    pin_host_kv: OnOff,
    /// GPU: print where each engine's steps spent their wall time when it ends.
    #[arg(long)]
    device_timing: bool,
    /// GPU: time every kernel launch (CUDA graphs off) and print the GPU time by kernel when an
    /// engine ends.
    #[arg(long)]
    device_profile: bool,
}

/// Which attention takes a GPU's prefill chunks (`--prefill-attention`).
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub(crate) enum PrefillAttentionArg {
    /// Tensor-core tiles, with asynchronous copies where the device allows.
    Auto,
    /// Tiles loaded through registers.
    TiledSync,
    /// Row by row.
    Rows,
}

/// How a GPU's KV arena is offered to peer processes (`--kv-export`).
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub(crate) enum KvExportArg {
    /// A CUDA virtual-memory allocation's descriptor.
    Vmm,
    /// Legacy CUDA IPC.
    Ipc,
}

impl From<KvExportArg> for KvExport {
    fn from(a: KvExportArg) -> Self {
        match a {
            KvExportArg::Vmm => KvExport::Vmm,
            KvExportArg::Ipc => KvExport::Ipc,
        }
    }
}

impl DeviceFlags {
    /// Where the model computes.
    pub(crate) fn options(&self) -> DeviceOptions {
        let gpu = GpuOptions {
            graphs: !self.enforce_eager,
            prefill_attention: match self.prefill_attention {
                PrefillAttentionArg::Auto => PrefillAttention::Auto,
                PrefillAttentionArg::TiledSync => PrefillAttention::TiledSync,
                PrefillAttentionArg::Rows => PrefillAttention::Rows,
            },
            kv_export: self.kv_export.into(),
            pin_host_kv: self.pin_host_kv == OnOff::On,
            timing: self.device_timing,
            profile: self.device_profile,
        };
        DeviceOptions { device: self.device, dtype: self.dtype, gpu }
    }

    /// The KV cache's type: `--kv-dtype`, else [`default_kv_dtype`].
    pub(crate) fn kv_dtype(&self) -> KvDtype {
        self.kv_dtype.unwrap_or_else(|| default_kv_dtype(self.options()))
    }
}

/// The KV cache's type when `--kv-dtype` is not given: the compute type on a GPU (a bfloat16
/// model keeps bfloat16 KV, as vLLM's `auto`), float32 on the CPU.
pub(crate) fn default_kv_dtype(device: DeviceOptions) -> KvDtype {
    match (device.device, device.dtype) {
        (ComputeDevice::Cpu | ComputeDevice::StandIn, _) | (_, ComputeDtype::F32) => KvDtype::F32,
        (_, ComputeDtype::F16) => KvDtype::F16,
        _ => KvDtype::Bf16,
    }
}

impl EngineFlags {
    /// Where the model computes.
    pub(crate) fn device(&self) -> DeviceOptions {
        self.device.options()
    }

    /// The name of the cost profile to emulate, if any (`--emulate`).
    pub(crate) fn emulate_name(&self) -> Option<&str> {
        self.emulate.as_deref()
    }

    /// The cost profile to emulate, if any.
    pub(crate) fn emulate(&self) -> anyhow::Result<Option<baton_sched::CostProfile>> {
        self.emulate.as_deref().map(cost_profile).transpose()
    }

    /// The emulated workers' link, if one is asked for (no setup latency: the bandwidth is the
    /// cost).
    pub(crate) fn emulate_link(&self) -> Option<baton_sched::Link> {
        self.emulate_link_gbps.map(|g| baton_sched::Link { bytes_per_s: (g * 1e9 / 8.0).round() as u64, latency_us: 0 })
    }

    /// The engine configuration these flags describe.
    pub(crate) fn config(&self) -> EngineConfig {
        EngineConfig {
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            layout: self.layout,
            max_num_seqs: self.max_num_seqs,
            max_batch_tokens: self.max_batch_tokens,
            prefill_chunk: self.prefill_chunk,
            host_blocks: self.host_kv_blocks,
            disk_blocks: self.disk_kv_blocks,
            disk_dir: self.disk_kv_dir.clone(),
            kv_dtype: self.device.kv_dtype(),
            ..EngineConfig::default()
        }
    }
}

/// How KV moves from a prefill worker to a decode worker.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub(crate) enum KvTransferArg {
    /// The decode worker reserves blocks, then reads the prefill worker's KV into them
    /// (KVDirect's default).
    Pull,
    /// The decode worker reserves blocks and registers them with the prefill worker, which
    /// writes the KV into them (one-sided copies over shared memory, WRITE frames over TCP)
    /// once the prefill is done.
    Push,
    /// Push, overlapped with the prefill: the decode worker reserves its blocks when the
    /// prefill starts, and the prefill worker writes each layer of each chunk into them as
    /// soon as its forward pass computed it, the last write carrying the first token
    /// (Mooncake, KVDirect). Holds decode memory while the prompt computes, so only when
    /// the prefill worker has no other prefill of this conductor's; else pull.
    Layerwise,
}

/// How the conductor routes and admits requests, and hands KV over (`baton serve`, `baton
/// conductor`).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Routing, admission and KV hand-off")]
pub(crate) struct RoutingFlags {
    /// Routing policy: `simple` (fewest requests in flight, with --max-in-flight), or one of
    /// baton-sched's policies as `baton sim` runs them: round-robin, random, least-load,
    /// session-affinity, prompt-tree, kv-centric, load-aware.
    #[arg(long, default_value = "simple")]
    policy: String,
    /// With `simple`: requests in flight per worker before new ones are answered 429.
    #[arg(long)]
    max_in_flight: Option<usize>,
    /// Longest a request waits in the conductor's queue for decode room before it starts, in
    /// seconds (0: no limit, as vLLM queues). A request predicted to wait longer, or still
    /// waiting then, is answered 429 with Retry-After before its stream starts. With
    /// --slo-ttft-ms, that SLO is the limit instead.
    #[arg(long, default_value_t = baton_conductor::conductor::DEFAULT_MAX_QUEUE_WAIT.as_secs_f64(), value_name = "SECONDS", value_parser = queue_wait)]
    max_queue_wait: f64,
    /// With a baton-sched policy: admission control (none, baseline, early, predictive);
    /// rejected requests are answered 429.
    #[arg(long, default_value = "none")]
    admission: baton_sched::AdmissionKind,
    /// TTFT SLO in milliseconds, for admission control (default 10,000) and --elastic (default:
    /// four 2,048-token prefills of the cost profile, at least a second).
    #[arg(long)]
    slo_ttft_ms: Option<u64>,
    /// TBT SLO in milliseconds, for admission control (default 1,000) and --elastic (default:
    /// three times the cost profile's decode step for one short request).
    #[arg(long)]
    slo_tbt_ms: Option<u64>,
    /// Fraction of the TBT SLO that early and predictive admission keep free: a request is
    /// admitted while its decode worker's predicted step stays under (1 − this) × the SLO.
    /// Admitting right up to the SLO leaves about half the admitted requests just over it.
    #[arg(long, default_value_t = baton_sched::DEFAULT_TBT_HEADROOM, value_parser = tbt_headroom)]
    admission_tbt_headroom: f64,
    /// Cost profile the policies and --elastic predict with: a JSON file from `baton profile`,
    /// `a800` or `h100` (default: --emulate's profile, else a800).
    #[arg(long)]
    cost_profile: Option<String>,
    /// Seed of the random policy.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// How the KV cache of a disaggregated request moves from its prefill worker to its decode
    /// worker. Every worker supports every mode; the conductor picks one for all requests.
    #[arg(long, value_enum, default_value = "pull")]
    kv_transfer: KvTransferArg,
    /// What the conductor's KV index (the prompt trees prefix-aware policies read) is fed by:
    /// `exact`, every worker's KV events (stored, moved, removed; a snapshot after any loss),
    /// or `predicted`, only the conductor's guess that a routed prompt is cached where it went.
    #[arg(long, value_enum, default_value = "exact")]
    kv_index: KvIndexArg,
    /// Whether a prompt's worker may fetch a prefix cached on another worker (over the KV
    /// transfer protocol) before computing the rest, when the policy finds that moving the KV
    /// beats recomputing it (Mooncake's Algorithm 1, MemServe's eq. 2; kv-centric and
    /// prompt-tree plan fetches). A fetch that fails is recomputed.
    #[arg(long, value_enum, default_value = "on")]
    kv_fetch: OnOff,
    /// Where past requests' KV is kept, as MemServe's modes (default 3): 0 (PD-Basic) nowhere, every
    /// prompt computed whole; 1 (PD-Caching-1) prefill workers cache prompts; 2 (PD-Caching-2)
    /// decode workers also keep finished requests' KV, a session's next turn goes to the decode
    /// worker holding its history when that worker is about as fast as the fastest (policies of
    /// baton-sched), and a hand-off moves only the blocks the decode worker lacks (pull mode);
    /// 3 (PD-Caching-3) also sends each answer's KV back from the decode worker into the cache
    /// of the prefill worker that computed the prompt, so a session's next prompt starts after
    /// its whole history.
    #[arg(long, default_value = "3", value_parser = clap::value_parser!(u8).range(0..=3))]
    pd_caching: u8,
    /// Conditional disaggregation (with a baton-sched policy): a request with at most N prompt
    /// tokens not cached on the decode worker the policy chose (a short prompt, or a session's
    /// next turn on the decode worker holding its history) runs whole there, without a hand-off,
    /// when the cost model predicts that is no slower. Such requests count as
    /// `baton_routing_decisions_total{route="colocated"}`. 0 (the default) never.
    #[arg(long, default_value_t = 0)]
    conditional_disagg_tokens: u64,
    /// Elastic prefill/decode: the conductor switches a worker between the prefill and decode
    /// roles when one pool stays overloaded (over 0.7 of its SLO: queued prefill time over
    /// --slo-ttft-ms, or decode step time above its floor over --slo-tbt-ms, KV memory, waiting
    /// requests) while the other is idle (under 0.3), for a time that scales with how far over
    /// it is (--elastic-hold-s), with the cost profile of --cost-profile. A worker whose pool cannot spare it (one prefill and one decode worker)
    /// becomes colocated instead: it keeps its work and takes the busy kind too (and if a
    /// decode-heavy imbalance lasts, the decode worker becomes colocated as well). The worker
    /// finishes what it holds; nothing is dropped. Switches show as
    /// `baton_role_switches_total` and in the role label of `baton_queue_length`.
    #[arg(long)]
    elastic: bool,
    /// With --elastic: how long an imbalance whose busy pool is at twice the high watermark must
    /// last before a switch, in seconds; one ten times over acts in a ninth of it, one just over
    /// in four times it (the hysteresis starts again after each switch, except that a pair's
    /// second step to two colocated workers follows at once while the imbalance lasts).
    #[arg(long, default_value_t = 2.0, requires = "elastic")]
    elastic_hold_s: f64,
    /// With --elastic: at most this many switches in any minute.
    #[arg(long, default_value_t = 2, requires = "elastic")]
    elastic_max_switches_per_min: usize,
    /// With --elastic: the low and high watermarks, LOW,HIGH (FlowKV's 0.3,0.7): a pool's load
    /// over HIGH while the other's is under LOW is an imbalance.
    #[arg(long, value_delimiter = ',', default_value = "0.3,0.7", value_name = "LOW,HIGH", requires = "elastic")]
    elastic_watermarks: Vec<f64>,
    /// With --elastic: workers each of the prefill and decode roles keeps at least (colocated
    /// workers count for both); at the least, the idle role's worker becomes colocated.
    #[arg(long, default_value_t = 1, requires = "elastic")]
    elastic_min_per_role: usize,
}

/// A switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum OnOff {
    /// Enabled.
    On,
    /// Disabled.
    Off,
}

/// What feeds the conductor's KV index.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub(crate) enum KvIndexArg {
    /// The workers' KV events.
    Exact,
    /// The conductor's predictions only.
    Predicted,
}

impl RoutingFlags {
    /// The KV hand-off mode these flags choose.
    pub(crate) fn kv_transfer(&self) -> baton_protocol::KvTransfer {
        match self.kv_transfer {
            KvTransferArg::Pull => baton_protocol::KvTransfer::Pull,
            KvTransferArg::Push => baton_protocol::KvTransfer::Push,
            KvTransferArg::Layerwise => baton_protocol::KvTransfer::Layerwise,
        }
    }

    /// Where these flags keep past requests' KV.
    pub(crate) fn pd_caching(&self) -> baton_protocol::wire::PdCaching {
        match self.pd_caching {
            0 => baton_protocol::wire::PdCaching::Basic,
            1 => baton_protocol::wire::PdCaching::Prefill,
            2 => baton_protocol::wire::PdCaching::Decode,
            _ => baton_protocol::wire::PdCaching::Return,
        }
    }

    /// What these flags feed the conductor's KV index with.
    pub(crate) fn kv_index(&self) -> baton_conductor::view::KvIndexMode {
        match self.kv_index {
            KvIndexArg::Exact => baton_conductor::view::KvIndexMode::Exact,
            KvIndexArg::Predicted => baton_conductor::view::KvIndexMode::Predicted,
        }
    }

    /// Predicts with `profile` (the profile emulated workers run on) unless `--cost-profile` names
    /// another.
    pub(crate) fn predict_with(&mut self, profile: Option<&str>) {
        if self.cost_profile.is_none() {
            self.cost_profile = profile.map(str::to_owned);
        }
    }

    /// How long a request may wait for decode room: --slo-ttft-ms where given, else
    /// --max-queue-wait (`None` for 0: no limit).
    pub(crate) fn max_queue_wait(&self) -> Option<std::time::Duration> {
        match self.slo_ttft_ms {
            Some(ms) => Some(std::time::Duration::from_millis(ms)),
            None => (self.max_queue_wait > 0.0).then(|| std::time::Duration::from_secs_f64(self.max_queue_wait)),
        }
    }

    /// Admission's SLOs: the flags', or 10 s and 1 s.
    fn admission_slo(&self) -> baton_sched::Slo {
        baton_sched::Slo {
            ttft_us: self.slo_ttft_ms.unwrap_or(10_000) * 1000,
            tbt_us: self.slo_tbt_ms.unwrap_or(1_000) * 1000,
        }
    }

    /// Whether `--elastic` was given.
    pub(crate) fn elastic_on(&self) -> bool {
        self.elastic
    }

    /// Elastic role switching, when `--elastic` asks for it.
    pub(crate) fn elastic(&self) -> anyhow::Result<Option<baton_conductor::elastic::ElasticConfig>> {
        if !self.elastic {
            return Ok(None);
        }
        anyhow::ensure!(
            self.elastic_hold_s.is_finite() && self.elastic_hold_s >= 0.0,
            "--elastic-hold-s must be a number of seconds, 0 or more"
        );
        let cost = match &self.cost_profile {
            Some(name) => cost_profile(name)?,
            None => baton_sched::CostProfile::llama2_70b_8xa800(),
        };
        let (ttft_us, tbt_us) = baton_conductor::elastic::default_slos(&cost);
        let mut config = baton_conductor::elastic::ElasticConfig::new(
            cost,
            self.slo_ttft_ms.map_or(ttft_us, |ms| ms * 1000),
            self.slo_tbt_ms.map_or(tbt_us, |ms| ms * 1000),
            std::time::Duration::from_secs_f64(self.elastic_hold_s),
        );
        config.max_per_minute = self.elastic_max_switches_per_min;
        config.policy.min_per_role = self.elastic_min_per_role;
        (config.policy.low, config.policy.high) = watermarks(&self.elastic_watermarks)?;
        Ok(Some(config))
    }

    /// The policy these flags choose.
    pub(crate) fn choice(&self) -> anyhow::Result<baton_conductor::sched::PolicyChoice> {
        use baton_conductor::sched::PolicyChoice;
        if self.policy == "simple" {
            anyhow::ensure!(
                self.conditional_disagg_tokens == 0,
                "--conditional-disagg-tokens goes with a baton-sched --policy (kv-centric, prompt-tree, ...)"
            );
            return Ok(PolicyChoice::Simple { max_in_flight: self.max_in_flight });
        }
        anyhow::ensure!(self.max_in_flight.is_none(), "--max-in-flight goes with --policy simple");
        let policy: baton_sched::PolicyKind = self.policy.parse()?;
        let cost = match &self.cost_profile {
            Some(name) => cost_profile(name)?,
            None => baton_sched::CostProfile::llama2_70b_8xa800(),
        };
        let admission = baton_sched::AdmissionConfig {
            kind: self.admission,
            slo: self.admission_slo(),
            decode_time_us: 10_000_000,
            tbt_headroom: self.admission_tbt_headroom,
        };
        Ok(PolicyChoice::Sched {
            policy,
            config: baton_sched::PolicyConfig::default(),
            admission,
            cost: Box::new(cost),
            seed: self.seed,
            kv_fetch: self.kv_fetch == OnOff::On,
            decode_affinity: self.pd_caching() >= baton_protocol::wire::PdCaching::Decode,
            conditional_tokens: (self.conditional_disagg_tokens > 0).then_some(self.conditional_disagg_tokens),
        })
    }
}

/// A --max-queue-wait: seconds, 0 or more.
fn queue_wait(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("{s:?} is not a number of seconds, 0 or more")),
    }
}
