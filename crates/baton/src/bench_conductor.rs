//! `baton bench conductor`: what routing through the conductor adds to a request.
//!
//! One colocated worker and one conductor run in this process on real loopback sockets (the
//! worker registers with the conductor's embedded registry, as `baton worker` does). The
//! colocated worker also serves the OpenAI API itself, so the same request can be sent
//! directly to the worker or routed through the conductor. Requests alternate between the
//! two so that both see the same machine noise; the report gives each path's latency and the
//! difference, which is the conductor's added latency (validation, routing, the control API
//! hop and re-serialising the answer).
//!
//! Then the load half ([`crate::bench_conductor_load`]): requests routed per second by one
//! conductor with 16 stub workers and a 1M-block index behind it, and the latency it adds.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use baton_cluster::{ClusterSecret, RegistryConfig};
use baton_conductor::deploy::{ConductorConfig, WorkerConfig, run_conductor, run_worker};
use baton_protocol::Role;

/// Arguments of `baton bench conductor`.
#[derive(Debug, clap::Args)]
pub(crate) struct ConductorBenchArgs {
    /// Model (default: the tiny test model, so that model time does not hide routing time).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Requests per path.
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// Tokens each request generates.
    #[arg(long, default_value_t = 4)]
    max_tokens: usize,
    /// Stream the answers (then the figure is time to the last chunk).
    #[arg(long)]
    stream: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Stub workers behind the conductor for the load half (half prefill, half decode).
    #[arg(long, default_value_t = 16)]
    workers: usize,
    /// Blocks the stub workers put in the conductor's KV index, in all.
    #[arg(long, default_value_t = 1_000_000)]
    index_blocks: usize,
    /// Requests in flight at once in the load half.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Requests the load half sends (and a tenth of them one at a time).
    #[arg(long, default_value_t = 20_000)]
    load_requests: usize,
    /// Skip the load half.
    #[arg(long)]
    no_load: bool,
}

fn default_model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-llama")
}

/// Latency percentiles of one path, in microseconds.
#[derive(Debug, serde::Serialize)]
struct Summary {
    p50_us: f64,
    p90_us: f64,
    p99_us: f64,
    mean_us: f64,
}

fn summarize(xs: &[f64]) -> Summary {
    let s = baton_measure::Stats::of(xs);
    Summary { p50_us: s.p50, p90_us: s.p90, p99_us: s.p99, mean_us: s.mean }
}

/// The API key of the worker's own OpenAI API (the direct path).
const DIRECT_KEY: &str = "bench-conductor-direct";

pub(crate) fn run(a: ConductorBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.requests > 0, "--requests must be at least 1");
    let model = a.model.clone().unwrap_or_else(default_model);
    anyhow::ensure!(model.exists(), "model {} not found (pass --model)", model.display());
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let load_model = model.clone();
    let latency = runtime.block_on(async move {
        let secret = ClusterSecret::new("bench-conductor")?;
        let conductor_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let conductor_url = format!("http://{}", conductor_listener.local_addr()?);
        let conductor = ConductorConfig {
            model: model.clone(),
            model_id: Some("bench".into()),
            registry: RegistryConfig::Embedded,
            secret: secret.clone(),
            api_key: None,
            protect_metrics: false,
            policy: baton_conductor::sched::PolicyChoice::default(),
            block_tokens: 16,
            kv_transfer: baton_protocol::KvTransfer::default(),
            pd_caching: baton_protocol::wire::PdCaching::default(),
            kv_index: baton_conductor::view::KvIndexMode::default(),
            elastic: None,
            drain_timeout: baton_conductor::deploy::DEFAULT_DRAIN_TIMEOUT,
            tls: None,
            tls_ca: None,
            worker_timeout: baton_conductor::remote::STREAM_IDLE_TIMEOUT,
            max_queue_wait: Some(baton_conductor::conductor::DEFAULT_MAX_QUEUE_WAIT),
        };
        tokio::spawn(run_conductor(conductor, conductor_listener, std::future::pending()));
        let worker = WorkerConfig {
            model: model.clone(),
            device: baton_model::DeviceOptions::default(),
            model_id: Some("bench".into()),
            role: Role::Colocated,
            name: Some("colocated-0".into()),
            listen: "127.0.0.1:0".parse()?,
            kv_listen: "127.0.0.1:0".parse()?,
            advertise: None,
            registry: RegistryConfig::Remote { base_url: conductor_url.clone() },
            secret,
            engine: baton_engine::EngineConfig::default(),
            lease: Duration::from_secs(30),
            transport: baton_worker::TransportChoice::Auto,
            ttl: Duration::from_secs(3),
            emulate: None,
            emulate_link: None,
            drain_timeout: baton_conductor::deploy::DEFAULT_DRAIN_TIMEOUT,
            // A colocated worker serves the OpenAI API itself only behind a key.
            api_key: Some(DIRECT_KEY.into()),
            tls_ca: None,
            tls: None,
        };
        let worker_listener = tokio::net::TcpListener::bind(worker.listen).await?;
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        tokio::spawn(run_worker(worker, worker_listener, move |r| drop(ready_tx.send(r.url)), std::future::pending()));
        let direct_url = tokio::time::timeout(Duration::from_secs(120), ready_rx)
            .await
            .context("the worker did not start within 120 s")??;
        let client = reqwest::Client::builder().timeout(Duration::from_secs(60)).build()?;
        // Wait until the conductor routes to the worker.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let health = client.get(format!("{conductor_url}/health")).send().await?;
            if health.status().is_success() {
                break;
            }
            anyhow::ensure!(Instant::now() < deadline, "the conductor did not see the worker within 10 s");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let body = serde_json::json!({"model": "bench", "prompt": "The conductor adds", "max_tokens": a.max_tokens,
            "temperature": 0, "ignore_eos": true, "stream": a.stream});
        let once = |url: String| {
            let client = client.clone();
            let body = body.clone();
            let direct = url == direct_url;
            async move {
                let start = Instant::now();
                let mut r = client.post(format!("{url}/v1/completions")).json(&body);
                if direct {
                    r = r.bearer_auth(DIRECT_KEY);
                }
                let r = r.send().await?;
                anyhow::ensure!(r.status().is_success(), "{url}: {}", r.status());
                let _ = r.bytes().await?;
                Ok::<_, anyhow::Error>(start.elapsed().as_secs_f64() * 1e6)
            }
        };
        // Warm both paths (connections, caches).
        for _ in 0..10 {
            once(direct_url.clone()).await?;
            once(conductor_url.clone()).await?;
        }
        let (mut direct, mut routed) = (Vec::new(), Vec::new());
        let progress = indicatif::ProgressBar::new(2 * a.requests as u64);
        for _ in 0..a.requests {
            direct.push(once(direct_url.clone()).await?);
            routed.push(once(conductor_url.clone()).await?);
            progress.inc(2);
        }
        progress.finish_and_clear();
        let added: Vec<f64> = routed.iter().zip(&direct).map(|(r, d)| r - d).collect();
        let (direct, routed, added) = (summarize(&direct), summarize(&routed), summarize(&added));
        if a.json {
            let report = serde_json::json!({"requests": a.requests, "max_tokens": a.max_tokens, "stream": a.stream,
                "model": model.display().to_string(), "direct": direct, "routed": routed, "added": added});
            return Ok(Some(report));
        } else {
            println!(
                "conductor added latency, {} requests per path, {} tokens each{} ({})",
                a.requests,
                a.max_tokens,
                if a.stream { ", streamed" } else { "" },
                model.display()
            );
            println!("{:<28} {:>10} {:>10} {:>10} {:>10}", "", "p50 µs", "p90 µs", "p99 µs", "mean µs");
            for (name, s) in [
                ("direct (worker's own API)", &direct),
                ("routed (conductor → worker)", &routed),
                ("added (paired difference)", &added),
            ] {
                println!("{name:<28} {:>10.0} {:>10.0} {:>10.0} {:>10.0}", s.p50_us, s.p90_us, s.p99_us, s.mean_us);
            }
        }
        Ok(None)
    })?;
    drop(runtime);
    let load = if a.no_load {
        None
    } else {
        let args = crate::bench_conductor_load::LoadArgs {
            workers: a.workers,
            index_blocks: a.index_blocks,
            concurrency: a.concurrency,
            requests: a.load_requests,
        };
        Some(crate::bench_conductor_load::run(args, &load_model)?)
    };
    match (latency, load) {
        (Some(mut report), load) => {
            report["load"] = serde_json::to_value(load)?;
            println!("{}", serde_json::to_string_pretty(&report)?);
        }
        (None, Some(load)) => crate::bench_conductor_load::print(&load),
        (None, None) => {}
    }
    Ok(())
}
