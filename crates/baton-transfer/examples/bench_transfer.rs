//! `cargo run --release -p baton-transfer --example bench_transfer [-- --json] [--tokens 8192,2048] [--reps 3] [--stand-in-device]`
//!
//! Moves one request's KV (Llama-3-8B geometry, f16, 16-token blocks) between two processes and
//! prints GB/s, transport calls and the ratio to this machine's limits for every variant.
//! `--stand-in-device` adds the device variants with host memory standing in for GPU memory
//! (the protocol and checks of `baton bench transfer --device cuda`, at memcpy speed).

use std::sync::Arc;

use baton_transfer::bench::{
    BenchDevice, StandInBenchDevice, TransferBenchConfig, format_table, run, serve_if_child_with,
};

const USAGE: &str =
    "usage: bench_transfer [--json] [--tokens 8192,2048] [--reps 3] [--stand-in-device [--device-only]]";

fn stand_in(_ordinal: usize, _options: &str) -> baton_transfer::Result<Arc<dyn BenchDevice>> {
    Ok(Arc::new(StandInBenchDevice))
}

fn main() {
    if serve_if_child_with(&stand_in) {
        return;
    }
    let mut config = TransferBenchConfig::default();
    let mut json = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--json" => json = true,
            "--tokens" => {
                config.tokens = args
                    .next()
                    .unwrap_or_default()
                    .split(',')
                    .map(|t| t.parse().unwrap_or_else(|_| panic!("bad --tokens value `{t}`")))
                    .collect();
            }
            "--reps" => config.reps = args.next().and_then(|r| r.parse().ok()).expect("--reps N"),
            "--stand-in-device" => config.device = Some(0),
            "--device-only" => config.host = false,
            "--help" | "-h" => {
                println!("{USAGE}");
                return;
            }
            other => {
                eprintln!("unknown argument `{other}`\n{USAGE}");
                std::process::exit(2);
            }
        }
    }
    match run(&config, &stand_in) {
        Ok(report) if json => println!("{}", serde_json::to_string_pretty(&report).expect("report serializes")),
        Ok(report) => print!("{}", format_table(&report)),
        Err(e) => {
            eprintln!("bench transfer failed: {e}");
            std::process::exit(1);
        }
    }
}
