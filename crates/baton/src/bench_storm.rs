//! `baton bench storm`: bursts of concurrent streaming requests against a server, each request
//! classified as completed, refused before its stream began (429), failed before it, failed after
//! its 200, or hung ([`baton_bench::storm`]). The last two must stay at 0 however hard the storm;
//! `scripts/bench-storm.sh` sweeps concurrency and KV size.

use std::time::{Duration, Instant};

use baton_bench::client::Client;
use baton_bench::storm::{self, StormTally};

/// Arguments of `baton bench storm`.
#[derive(Debug, clap::Args)]
pub(crate) struct StormArgs {
    /// The server's root URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// Requests sent at once, one storm per value, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "16,64,256,512")]
    concurrency: Vec<usize>,
    /// Tokens each request generates (`ignore_eos`).
    #[arg(long, default_value_t = 300)]
    max_tokens: u64,
    /// A request with no end by then counts as hung.
    #[arg(long, default_value_t = 300.0)]
    timeout_s: f64,
    /// The model to name (default: the first the server lists).
    #[arg(long)]
    model: Option<String>,
    /// The server's KV blocks, printed in the table (0: not printed).
    #[arg(long, default_value_t = 0)]
    kv_blocks: usize,
    /// API key.
    #[arg(long, env = "OPENAI_API_KEY")]
    api_key: Option<String>,
    /// Print the header line too.
    #[arg(long)]
    header: bool,
}

pub(crate) fn run(a: StormArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.timeout_s > 0.0, "--timeout-s must be positive");
    anyhow::ensure!(a.concurrency.iter().all(|&c| c > 0), "--concurrency values must be positive");
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let client = Client::new(&a.url, a.api_key.clone(), Duration::from_secs(10))?;
    let timeout = Duration::from_secs_f64(a.timeout_s);
    let model = match &a.model {
        Some(m) => m.clone(),
        None => runtime.block_on(client.first_model(Duration::from_secs(10)))?,
    };
    if a.header {
        println!("{}", storm::header());
    }
    let mut clean = true;
    for &n in &a.concurrency {
        let started = Instant::now();
        let tally = runtime.block_on(async {
            let tasks: Vec<_> = (0..n)
                .map(|i| {
                    let client = client.clone();
                    let (endpoint, body) = storm::storm_request(i, a.max_tokens, &model);
                    tokio::spawn(async move { client.stream(endpoint, &body, timeout).await })
                })
                .collect();
            let mut tally = StormTally::default();
            for t in tasks {
                match t.await {
                    Ok(ex) => {
                        if storm::classify(&ex) == storm::StormOutcome::FailedAfter {
                            eprintln!("failed after its 200: {}", ex.error.as_deref().unwrap_or("?"));
                        }
                        tally.add(&ex);
                    }
                    Err(e) => anyhow::bail!("a request task failed: {e}"),
                }
            }
            Ok(tally)
        })?;
        println!("{}", storm::row(a.kv_blocks, n, &tally, started.elapsed().as_secs_f64()));
        clean &= tally.is_clean();
    }
    if !clean {
        eprintln!("FAILED: requests failed after their 200 or hung (target 0)");
        std::process::exit(1);
    }
    Ok(())
}
