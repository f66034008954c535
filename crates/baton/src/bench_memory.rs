//! `baton bench worker-memory`: a worker's memory stays flat however many requests it caches.
//!
//! Runs a colocated worker in this process (a real model, default the tiny fixture), with the
//! conductor following its state stream as in `baton serve`, and sends it `--requests` distinct
//! prompts straight through the worker API (no HTTP, so only the worker's and the index's
//! memory moves). Every prompt is cached, and the pool evicts once full, so each request adds
//! and removes index entries and KV events. Prints the process's resident memory after the
//! first `--checkpoint` requests and after all of them, the difference, and the bound it must
//! stay under: the size of the pool's per-block bookkeeping (what a full cache may add).

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use baton_conductor::ServeConfig;
use baton_protocol::WorkRequest;

/// Arguments of `baton bench worker-memory`.
#[derive(Debug, clap::Args)]
pub(crate) struct MemoryArgs {
    /// Model (default: `fixtures/models/tiny-llama`).
    #[arg(long)]
    model: Option<std::path::PathBuf>,
    /// Distinct requests in all.
    #[arg(long, default_value_t = 20_000)]
    requests: usize,
    /// Requests after which the first reading is taken.
    #[arg(long, default_value_t = 2_000)]
    checkpoint: usize,
    /// KV blocks of the worker's pool (full, and evicting, after the first ~1,400 requests).
    #[arg(long, default_value_t = 4096)]
    num_blocks: usize,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 48)]
    prompt_tokens: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
}

/// Resident set size of this process, bytes (Linux).
fn rss_bytes() -> anyhow::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<u64>().ok())
        .context("no VmRSS line")?;
    Ok(kb * 1024)
}

/// Upper bound of the pool's bookkeeping per block: an index node (hash, parent, tier, LRU
/// links, children), its hash-map entry, the allocator's and the block table's share, and a
/// KV event in the conductor's index. Generous: 512 bytes.
const BOOKKEEPING_PER_BLOCK: u64 = 512;

pub(crate) fn run(a: MemoryArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.checkpoint > 0 && a.checkpoint < a.requests, "--checkpoint must be below --requests");
    let model = a.model.clone().unwrap_or_else(|| std::path::PathBuf::from("fixtures/models/tiny-llama"));
    let mut config = ServeConfig { prefill: 0, decode: 0, colocated: 1, ..ServeConfig::new(model.clone()) };
    config.engine.num_blocks = a.num_blocks;
    let conductor = baton_conductor::build(&config).with_context(|| format!("loading {}", model.display()))?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        // The router starts following the worker's state stream, as a serving conductor does.
        let _app = Arc::clone(&conductor).router();
        let worker = conductor.workers().into_iter().next().context("no worker")?;
        let mut readings = Vec::new();
        let start = Instant::now();
        let mut sent = 0usize;
        for stop in [a.checkpoint, a.requests] {
            while sent < stop {
                let batch = a.concurrency.min(stop - sent);
                let mut tasks = Vec::with_capacity(batch);
                for i in sent..sent + batch {
                    // Distinct prompts: the request number spelled in the first tokens (ids below
                    // 300, within any vocabulary).
                    let mut prompt: Vec<u32> = (0..a.prompt_tokens as u32).map(|t| 10 + t % 200).collect();
                    for (k, slot) in prompt.iter_mut().take(4).enumerate() {
                        *slot = 10 + ((i >> (8 * k)) & 0xff) as u32;
                    }
                    let mut req = WorkRequest::new(i as u64 + 1, prompt);
                    req.stop.max_tokens = 1;
                    let mut events = worker.submit(req);
                    tasks.push(tokio::spawn(async move {
                        while let Some(e) = events.recv().await {
                            if e.is_last() {
                                return match e {
                                    baton_protocol::RequestEvent::Finished { .. } => Ok(()),
                                    other => Err(format!("{other:?}")),
                                };
                            }
                        }
                        Err("no last event".to_owned())
                    }));
                }
                for t in tasks {
                    if let Err(e) = t.await? {
                        anyhow::bail!("a request failed: {e}");
                    }
                }
                sent += batch;
            }
            // Let the state stream and the index catch up before reading.
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            readings.push((sent, rss_bytes()?));
            eprintln!("{sent} requests in {:.1} s", start.elapsed().as_secs_f64());
        }
        let indexed: usize = conductor.view().gauges().iter().map(|g| g.blocks.iter().sum::<usize>()).sum();
        let (n1, r1) = readings[0];
        let (n2, r2) = readings[1];
        let bound = a.num_blocks as u64 * BOOKKEEPING_PER_BLOCK;
        let grew = r2.saturating_sub(r1);
        println!(
            "worker memory with a {}-block pool ({indexed} blocks in the conductor's index at the end):",
            a.num_blocks
        );
        println!("  RSS after {n1:>6} requests: {:>8.1} MiB", r1 as f64 / 1048576.0);
        println!("  RSS after {n2:>6} requests: {:>8.1} MiB", r2 as f64 / 1048576.0);
        println!(
            "  grew {:.2} MiB; bound (pool bookkeeping, {} blocks x {BOOKKEEPING_PER_BLOCK} B): {:.2} MiB   {}",
            grew as f64 / 1048576.0,
            a.num_blocks,
            bound as f64 / 1048576.0,
            if grew < bound { "ok" } else { "MISSED" }
        );
        Ok(())
    })
}
