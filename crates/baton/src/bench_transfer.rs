//! `baton bench transfer`: one request's KV moved between two processes, per variant, next to
//! the machine's memcpy and loopback TCP limits measured in the same run, with the speed-up over
//! two naive message-passing transfers: per-slab on a layer-major cache (KVDirect's baseline)
//! and per-block (a stronger one); see `baton_transfer::bench`.

use baton_transfer::bench::{TransferBenchConfig, format_table, run};

/// Arguments of `baton bench transfer`.
#[derive(Debug, clap::Args)]
pub(crate) struct TransferArgs {
    /// Request sizes in tokens, comma-separated (Llama-3-8B geometry: 8192 tokens = 1 GiB).
    #[arg(long, value_delimiter = ',', default_value = "8192,2048")]
    tokens: Vec<usize>,
    /// Timed repetitions per variant (after one warm-up); the median is reported.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

pub(crate) fn transfer(a: TransferArgs) -> anyhow::Result<()> {
    let config = TransferBenchConfig { tokens: a.tokens, reps: a.reps, ..TransferBenchConfig::default() };
    let report = run(&config)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", format_table(&report));
    }
    Ok(())
}
