//! `baton bench storm`: bursts of concurrent streaming requests against a server, each request
//! classified as completed, refused before its stream began (429), failed before it, failed after
//! its 200, or hung ([`baton_bench::storm`]). The last two must stay at 0 however hard the storm;
//! `scripts/bench-storm.sh` sweeps concurrency and KV size. Also counted: the completed requests
//! whose first token came within a deadline (`--deadline-s`), and with `--solo`, the completed
//! texts equal to the same request's run alone.

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
    /// Which requests: `short` (short prompts, --max-tokens each) or `mixed` (prompts of about
    /// 11 to 1,085 tokens and 8 to 128 tokens out; --max-tokens is not used).
    #[arg(long, value_enum, default_value = "short")]
    mix: MixArg,
    /// Count the completed requests whose first token came within this many seconds (the
    /// `ttft<=dl` column): with a server that queues everything (`--max-queue-wait 0`), how
    /// many a deadline of that length would have let through.
    #[arg(long, default_value_t = 30.0)]
    deadline_s: f64,
    /// After each storm, run every completed request again alone, one at a time, and count
    /// the texts equal to the storm's (`solo_equal`; the requests are greedy).
    #[arg(long)]
    solo: bool,
}

/// A storm's requests.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum MixArg {
    /// Short prompts, --max-tokens each.
    Short,
    /// Prompts of about 11 to 1,085 tokens, 8 to 128 tokens out.
    Mixed,
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
    let mix = match a.mix {
        MixArg::Short => storm::StormMix::Short,
        MixArg::Mixed => storm::StormMix::Mixed,
    };
    let deadline = Duration::from_secs_f64(a.deadline_s.max(0.0));
    let mut clean = true;
    for &n in &a.concurrency {
        let started = Instant::now();
        let requests: Vec<_> = (0..n).map(|i| storm::request(mix, i, a.max_tokens, &model)).collect();
        let (tally, exchanges) = runtime.block_on(async {
            let tasks: Vec<_> = requests
                .iter()
                .cloned()
                .map(|(endpoint, body)| {
                    let client = client.clone();
                    tokio::spawn(async move { client.stream(endpoint, &body, timeout).await })
                })
                .collect();
            let mut tally = StormTally::default();
            let mut exchanges = Vec::with_capacity(n);
            for t in tasks {
                match t.await {
                    Ok(ex) => {
                        if storm::classify(&ex) == storm::StormOutcome::FailedAfter {
                            eprintln!("failed after its 200: {}", ex.error.as_deref().unwrap_or("?"));
                        }
                        tally.add_within(&ex, deadline);
                        exchanges.push(ex);
                    }
                    Err(e) => anyhow::bail!("a request task failed: {e}"),
                }
            }
            Ok((tally, exchanges))
        })?;
        let wall_s = started.elapsed().as_secs_f64();
        let solo =
            if a.solo { Some(runtime.block_on(solo_equal(&client, &requests, &exchanges, timeout))?) } else { None };
        println!("{}", storm::row(a.kv_blocks, n, &tally, solo, wall_s));
        clean &= tally.is_clean();
    }
    if !clean {
        eprintln!("FAILED: requests failed after their 200 or hung (target 0)");
        std::process::exit(1);
    }
    Ok(())
}

/// Runs each completed request of a storm again alone, one after another, and counts the texts
/// equal to the storm's: (equal, compared). A request refused alone (a 429 while the server is
/// still busy) is retried after a pause.
async fn solo_equal(
    client: &Client,
    requests: &[(baton_bench::client::Endpoint, serde_json::Value)],
    exchanges: &[baton_bench::client::Exchange],
    timeout: Duration,
) -> anyhow::Result<(u64, u64)> {
    let (mut equal, mut compared) = (0, 0);
    for ((endpoint, body), ex) in requests.iter().zip(exchanges) {
        if storm::classify(ex) != storm::StormOutcome::Completed {
            continue;
        }
        let mut alone = client.stream(*endpoint, body, timeout).await;
        for _ in 0..20 {
            if storm::classify(&alone) != storm::StormOutcome::Refused {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            alone = client.stream(*endpoint, body, timeout).await;
        }
        anyhow::ensure!(
            storm::classify(&alone) == storm::StormOutcome::Completed,
            "a request run alone did not complete: {}",
            alone.error.as_deref().unwrap_or("?")
        );
        compared += 1;
        if alone.text == ex.text {
            equal += 1;
        } else {
            eprintln!(
                "differs from its run alone: {:?}…\n  storm: {:?}…\n  alone: {:?}…",
                body.get("prompt").or(body.get("messages")).map(|p| p.to_string().chars().take(60).collect::<String>()),
                ex.text.chars().take(120).collect::<String>(),
                alone.text.chars().take(120).collect::<String>()
            );
        }
    }
    Ok((equal, compared))
}
