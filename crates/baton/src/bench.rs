//! `baton bench ...`: benchmark commands. Each prints its figures next to the limit measured
//! in the same run.

use baton_engine::bench::{self, EngineBenchConfig};
use baton_kv::KvLayout;

// Declared here rather than in main.rs: `baton bench serve` and `compare` are bench commands.
#[path = "bench_index.rs"]
mod bench_index;
#[path = "bench_memory.rs"]
mod bench_memory;
#[path = "bench_serve.rs"]
mod bench_serve;
#[path = "bench_storm.rs"]
mod bench_storm;

/// Benchmarks.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum BenchCommand {
    /// Prefill and decode tokens/s of the engine on a random-weight model of realistic shape,
    /// against the machine's memory bandwidth.
    Engine(EngineArgs),
    /// KV transfer between two processes (naive per-slab messages — KVDirect's baseline — and
    /// per-block messages vs coalesced pull over TCP
    /// and shared memory, both layouts) against memcpy and loopback TCP measured in the same run.
    Transfer(crate::bench_transfer::TransferArgs),
    /// What routing through the conductor adds to a request: a colocated worker's own API vs
    /// the same worker behind a conductor, on loopback (p50/p90/p99 of both and of the paired
    /// difference).
    Conductor(crate::bench_conductor::ConductorBenchArgs),
    /// Load generator against an OpenAI-compatible server (Baton, vLLM, ...): streams a
    /// workload at a rate, a trace's timestamps or a concurrency and reports TTFT, TBT, JCT,
    /// throughput, SLO attainment and goodput, with a JSON report and plots.
    Serve(Box<bench_serve::ServeBenchArgs>),
    /// Side-by-side tables of `baton bench serve` reports: two run by run, and any number of
    /// rate sweeps by rate.
    Compare(bench_serve::CompareArgs),
    /// Bursts of concurrent streaming requests (shared-prefix completions, unrelated
    /// completions, chats): per burst, how many completed, were refused before their stream began
    /// (429), failed before it, failed after its 200 or hung (the last two: target 0), and
    /// tokens/s. Exits non-zero when any failed after its 200 or hung.
    Storm(bench_storm::StormArgs),
    /// The conductor's KV index at cluster scale: KV events applied per second (in memory and
    /// from the control API's NDJSON) into an index of 16 workers and 1M blocks, and the p99 of
    /// a kv-centric routing decision against it, each beside its target.
    Index(bench_index::IndexArgs),
    /// A worker's resident memory after 2,000 and after 20,000 distinct cached requests (its
    /// pool full and evicting, its KV events streamed to an in-process conductor), against the
    /// pool's bookkeeping size.
    WorkerMemory(bench_memory::MemoryArgs),
}

/// Arguments of `baton bench engine`.
#[derive(Debug, clap::Args)]
pub(crate) struct EngineArgs {
    /// Residual width.
    #[arg(long, default_value_t = 1024)]
    hidden: usize,
    /// Decoder layers.
    #[arg(long, default_value_t = 16)]
    layers: usize,
    /// Query heads.
    #[arg(long, default_value_t = 16)]
    heads: usize,
    /// KV heads.
    #[arg(long, default_value_t = 4)]
    kv_heads: usize,
    /// MLP width.
    #[arg(long, default_value_t = 2816)]
    intermediate: usize,
    /// Vocabulary size.
    #[arg(long, default_value_t = 32000)]
    vocab: usize,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 512)]
    prompt_len: usize,
    /// Decode steps to time.
    #[arg(long, default_value_t = 32)]
    decode_steps: usize,
    /// Batch sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    batches: Vec<usize>,
    /// KV layout.
    #[arg(long, default_value = "block-major")]
    layout: KvLayout,
    /// Where the model computes, in what type, and the KV cache's type (16-bit: half the bytes
    /// attention reads). On a GPU the figures are set beside its copy bandwidth and GEMM peak,
    /// measured in the same run.
    #[command(flatten)]
    device: crate::engine_flags::DeviceFlags,
    /// Run a real model (HF directory or `.gguf` file) instead of random weights; the shape
    /// options are then ignored. Batch sizes default to 1.
    #[arg(long)]
    model: Option<std::path::PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

pub(crate) fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Engine(a) => engine(a),
        BenchCommand::Transfer(a) => crate::bench_transfer::transfer(a),
        BenchCommand::Conductor(a) => crate::bench_conductor::run(a),
        BenchCommand::Serve(a) => bench_serve::serve(*a),
        BenchCommand::Storm(a) => bench_storm::run(a),
        BenchCommand::Index(a) => bench_index::run(a),
        BenchCommand::WorkerMemory(a) => bench_memory::run(a),
        BenchCommand::Compare(a) => bench_serve::compare(a),
    }
}

impl EngineArgs {
    fn batches_default(&self) -> bool {
        self.batches == [1, 16]
    }
}

fn engine(a: EngineArgs) -> anyhow::Result<()> {
    let config = EngineBenchConfig {
        hidden: a.hidden,
        layers: a.layers,
        heads: a.heads,
        kv_heads: a.kv_heads,
        intermediate: a.intermediate,
        vocab: a.vocab,
        prompt_len: a.prompt_len,
        decode_steps: a.decode_steps,
        batches: if a.model.is_some() && a.batches_default() { vec![1] } else { a.batches.clone() },
        layout: a.layout,
        kv_dtype: a.device.kv_dtype(),
        model: a.model.clone(),
        device: a.device.options(),
    };
    let report = bench::run(config, &mut |msg| eprintln!("[bench engine] {msg}"))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    let m = &report.memory;
    let s = &report.model;
    println!(
        "model: {} ({}), {} layers, hidden {}, heads {}/{}, {:.0}M params, {:.0} MB of weights read per step",
        s.architecture,
        s.source,
        s.layers,
        s.hidden,
        s.heads.0,
        s.heads.1,
        report.params as f64 / 1e6,
        report.weight_bytes_per_step as f64 / 1e6
    );
    if let Some(d) = &report.device_limits {
        // The host's bandwidth says nothing of a GPU's steps: only the GPU's table.
        println!("KV cache: {:?}, {} prompt tokens a sequence", report.config.kv_dtype, report.config.prompt_len);
        print_device(&report, d);
        return Ok(());
    }
    println!(
        "machine: {} threads, read {:.1} GB/s, memcpy {:.1} GB/s (at the start of this run)",
        m.threads, m.read_gb_s, m.memcpy_gb_s
    );
    println!("KV cache: {:?}, {} prompt tokens a sequence", report.config.kv_dtype, report.config.prompt_len);
    // Each batch beside the read bandwidth measured next to it (the higher of a probe just
    // before and one just after), and the threads' hand-off round trip just after it (a VM
    // whose vCPUs sit on two core complexes reads faster and hands off slower).
    println!(
        "{:>6} {:>14} {:>13} {:>15} {:>10} {:>18} {:>12}",
        "batch", "prefill tok/s", "decode tok/s", "weights GB/s", "read GB/s", "of read bandwidth", "hand-off ns"
    );
    for r in &report.results {
        let handoff = r.handoff_ns.map_or_else(|| "-".to_string(), |ns| format!("{ns:.0}"));
        println!(
            "{:>6} {:>14.1} {:>13.1} {:>15.1} {:>10.1} {:>17.0}% {:>12}",
            r.batch,
            r.prefill_tokens_per_s,
            r.decode_tokens_per_s,
            r.decode_weight_gb_s,
            r.read_gb_s,
            r.decode_fraction_of_read_bw * 100.0,
            handoff
        );
    }
    if let Some(s) = report.batch_speedup {
        println!("decode speed-up of the largest batch over batch 1: {s:.1}x (target >= 5x)");
    }
    // The median of the batch-1 runs (`--batches 1,1,1,1` measures four).
    let mut ones: Vec<f64> =
        report.results.iter().filter(|r| r.batch == 1).map(|r| r.decode_fraction_of_read_bw).collect();
    ones.sort_by(f64::total_cmp);
    // The lower middle of an even count.
    if let Some(&median) = ones.get(ones.len().saturating_sub(1) / 2) {
        let runs = if ones.len() > 1 { format!(" (median of {} runs)", ones.len()) } else { String::new() };
        println!(
            "batch-1 decode reads weights at {:.0}% of the machine's read bandwidth{runs} (target >= 60%)",
            median * 100.0
        );
    }
    Ok(())
}

/// The GPU figures of `baton bench engine --device cuda`, each beside its limit.
fn print_device(report: &baton_engine::bench::EngineBenchReport, d: &baton_model::DeviceLimits) {
    println!("GPU: copy {:.0} GB/s (read + written), bf16 GEMM {:.0} TFLOP/s (same run)", d.copy_gb_s, d.gemm_tflops);
    println!(
        "{:>6} {:>8} {:>14} {:>9} {:>13} {:>12} {:>12} {:>10}",
        "batch", "context", "prefill tok/s", "TFLOP/s", "of GEMM peak", "decode ms", "roofline ms", "of roofline"
    );
    for r in &report.results {
        let roof = r.decode_roofline_ms.unwrap_or(f64::NAN);
        let tflops = r.prefill_tflops.unwrap_or(f64::NAN);
        println!(
            "{:>6} {:>8} {:>14.0} {:>9.1} {:>12.0}% {:>12.3} {:>12.3} {:>9.0}%",
            r.batch,
            report.config.prompt_len,
            r.prefill_tokens_per_s,
            tflops,
            tflops / d.gemm_tflops * 100.0,
            r.decode_step_ms,
            roof,
            roof / r.decode_step_ms * 100.0
        );
    }
    if let Some([w, kv, ws]) = report.device_memory {
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        println!(
            "GPU memory (largest batch): weights {:.2} GiB, KV arena {:.2} GiB, workspace {:.2} GiB",
            gib(w),
            gib(kv),
            gib(ws)
        );
    }
}
