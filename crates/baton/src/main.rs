//! The Baton binary: one executable for every role. Each subcommand is a thin shell over the
//! library crates; no logic of its own lives here.

mod bench;
mod bench_conductor;
mod bench_conductor_load;
mod bench_transfer;
mod check_device;
mod cluster;
mod engine_flags;
mod generate;
mod profile;
mod serve;
mod sim;

use clap::{Parser, Subcommand};

/// Baton: disaggregated LLM serving (prefill and decode on separate workers, KV cache passed
/// between them).
#[derive(Debug, Parser)]
#[command(name = "baton", version, about, long_about = None)]
struct Cli {
    /// Log lines as text, or as one JSON object per line (with the request's span: its
    /// `x-request-id` and Baton id) for log collectors. Filter with `RUST_LOG` (default `warn`).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible API: a conductor and its workers in one process (one
    /// colocated worker by default; --prefill 1 --decode 1 disaggregates).
    Serve(serve::ServeArgs),
    /// Run one worker (prefill, decode or colocated) of a multi-process cluster; it joins
    /// through the registry and serves KV to its peers.
    Worker(cluster::WorkerArgs),
    /// Run the conductor of a multi-process cluster: the OpenAI-compatible API, routing to the
    /// workers that join through its registry.
    Conductor(cluster::ConductorArgs),
    /// Generate text for one prompt with a local engine and print it.
    Generate(generate::GenerateArgs),
    /// Simulate a cluster on virtual time with the conductor's scheduling policies.
    Sim(Box<sim::SimArgs>),
    /// Time the CPU backend and fit the cost profile that `sim --profile` and emulated workers use.
    Profile(profile::ProfileArgs),
    /// Benchmarks (not tests): engine throughput and more.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Check a device's engine against the CPU's: the same prompts, greedy, tokens and logits
    /// compared (what `scripts/gpu-check.sh` runs on a GPU).
    CheckDevice(check_device::CheckDeviceArgs),
}

fn main() -> anyhow::Result<()> {
    // `baton bench transfer` re-runs this binary as its prefill-side process.
    if baton_transfer::bench::serve_if_child_with(&bench_transfer::bench_device) {
        return Ok(());
    }
    let cli = Cli::parse();
    let logs = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        // Colour only on a terminal: a log redirected to a file keeps no escape codes.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match cli.log_format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().with_current_span(true).with_span_list(true).init(),
    }
    match cli.command {
        Command::Serve(args) => serve::run(args),
        Command::Worker(args) => cluster::worker(args),
        Command::Conductor(args) => cluster::conductor(args),
        Command::Generate(args) => generate::run(args),
        Command::Bench(cmd) => bench::run(cmd),
        Command::Sim(args) => sim::run(*args),
        Command::Profile(args) => profile::run(args),
        Command::CheckDevice(args) => check_device::run(args),
    }
}
