//! `baton bench conductor`'s load half: how many requests one conductor routes per second, and
//! what it adds to each, with `--workers` stub workers behind it whose state streams fill its
//! KV index with `--index-blocks` blocks.
//!
//! The workers answer at once (a prefill part: its first token and a leased KV source; a decode
//! or whole part: one more token), so every microsecond measured is the conductor's: the HTTP
//! request and response, validation, the kv-centric routing decision against the full index,
//! the admission claim, the ledger, and each request's life across a prefill and a decode
//! worker. The conductor runs on a runtime of one thread (validation still goes through its
//! blocking pool, with little to do: prompts are token ids); the client, on real loopback
//! sockets, on the other cores.
//! Half the prompts extend a prompt the index holds, so the routing decision walks real
//! prefixes.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use baton_conductor::Conductor;
use baton_conductor::openai::Validator;
use baton_conductor::sched::PolicyChoice;
use baton_kv::prefix_hashes;
use baton_protocol::wire::{CachedBlock, KvTier, LoadReport, Received, StateUpdate, Work};
use baton_protocol::{Finish, KvSource, RequestEvent, Role, WorkRequest, Worker, WorkerStats};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc;

/// Targets of issue #34.
const THROUGHPUT_TARGET: f64 = 5_000.0;
const ADDED_P99_TARGET_US: f64 = 1_000.0;
/// Tokens per block (the index's and the policy's).
const BLOCK_TOKENS: usize = 16;
/// Blocks per prompt the client sends (256 tokens: the tiny model's vocabulary is 512 ids).
const PROMPT_BLOCKS: usize = 16;
const VOCAB: u32 = 512;

/// What the load half measures.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LoadArgs {
    /// Stub workers (half prefill, half decode).
    pub workers: usize,
    /// Blocks their state streams put in the conductor's index, in all.
    pub index_blocks: usize,
    /// Requests in flight at once for the throughput figure.
    pub concurrency: usize,
    /// Requests for the throughput figure (the latency figure sends a tenth of them, one at a time).
    pub requests: usize,
}

/// A worker that answers every request at once, and whose state stream is a snapshot of
/// `blocks`.
#[derive(Debug)]
struct StubWorker {
    name: String,
    role: Role,
    blocks: Vec<CachedBlock>,
}

#[async_trait::async_trait]
impl Worker for StubWorker {
    fn name(&self) -> &str {
        &self.name
    }

    fn role(&self) -> Role {
        self.role
    }

    /// Nothing stays in flight: every request is answered as it is submitted.
    fn in_flight(&self) -> usize {
        0
    }

    fn submit(&self, req: WorkRequest) -> mpsc::UnboundedReceiver<RequestEvent> {
        let (tx, rx) = mpsc::unbounded_channel();
        let prompt_tokens = req.prompt.len();
        let completion_tokens = req.generated.len() + 1;
        let (kv, received) = match &req.work {
            Work::Prefill { .. } => {
                let blocks = (0..prompt_tokens.div_ceil(BLOCK_TOKENS) as u32).collect();
                let addr = SocketAddr::from(([127, 0, 0, 1], 9));
                (Some(KvSource { addr, blocks, tokens: prompt_tokens, lease: None }), None)
            }
            Work::Decode { source, .. } => {
                (None, Some(Received { tokens: source.tokens, bytes: 0, micros: 0, transport: None }))
            }
            Work::Whole { .. } => (None, None),
        };
        let _ = tx.send(RequestEvent::Token { token: 1, text: " x".into(), logprobs: None });
        let _ = tx.send(RequestEvent::Finished {
            reason: Finish::Length,
            prompt_tokens,
            cached_tokens: 0,
            completion_tokens,
            kv,
            received,
        });
        rx
    }

    fn release(&self, _id: u64) {}

    async fn stats(&self) -> Option<WorkerStats> {
        Some(WorkerStats::default())
    }

    fn capacity_blocks(&self) -> usize {
        1 << 24
    }

    fn block_tokens(&self) -> usize {
        BLOCK_TOKENS
    }

    fn subscribe_state(&self) -> Option<mpsc::Receiver<StateUpdate>> {
        let (tx, rx) = mpsc::channel(1);
        let load = LoadReport { total_blocks: 1 << 24, free_blocks: 1 << 24, ..LoadReport::default() };
        let snapshot =
            StateUpdate::Snapshot { next_seq: self.blocks.len() as u64, blocks: self.blocks.clone(), load, at_ms: 0 };
        tokio::spawn(async move {
            if tx.send(snapshot).await.is_ok() {
                // Held open: a closed stream would read as a worker gone.
                tx.closed().await;
            }
        });
        Some(rx)
    }
}

/// One latency figure, microseconds.
#[derive(Debug, serde::Serialize)]
pub(crate) struct Latency {
    pub p50_us: f64,
    pub p99_us: f64,
}

/// What the load half measured.
#[derive(Debug, serde::Serialize)]
pub(crate) struct LoadFigures {
    pub workers: usize,
    pub indexed_blocks: usize,
    pub added: Latency,
    pub concurrency: usize,
    pub routed_per_s: f64,
    pub under_load: Latency,
}

/// Builds the index's blocks (each worker a share of `index_blocks`, in chains of
/// [`PROMPT_BLOCKS`]) and the prompts whose blocks they are.
fn index(args: LoadArgs, rng: &mut StdRng) -> (Vec<Vec<CachedBlock>>, Vec<Vec<u32>>) {
    let per_worker = args.index_blocks / args.workers;
    let mut prompts = Vec::new();
    let blocks = (0..args.workers)
        .map(|_| {
            let mut blocks = Vec::with_capacity(per_worker);
            while blocks.len() < per_worker {
                let prompt: Vec<u32> = (0..PROMPT_BLOCKS * BLOCK_TOKENS).map(|_| rng.random_range(0..VOCAB)).collect();
                let hashes = prefix_hashes(&prompt, BLOCK_TOKENS);
                for (i, h) in hashes.iter().enumerate() {
                    let parent = (i > 0).then(|| hashes[i - 1].0);
                    blocks.push(CachedBlock { hash: h.0, parent, tier: KvTier::Device });
                }
                prompts.push(prompt);
            }
            blocks
        })
        .collect();
    (blocks, prompts)
}

/// Runs the load half.
pub(crate) fn run(args: LoadArgs, model: &std::path::Path) -> anyhow::Result<LoadFigures> {
    anyhow::ensure!(args.workers >= 2 && args.concurrency > 0 && args.requests >= 10, "nothing to measure");
    let mut rng = StdRng::seed_from_u64(11);
    eprintln!("hashing {} blocks for {} stub workers ...", args.index_blocks, args.workers);
    let (blocks, prompts) = index(args, &mut rng);
    let workers: Vec<Arc<dyn Worker>> = blocks
        .into_iter()
        .enumerate()
        .map(|(i, blocks)| {
            let role = if i % 2 == 0 { Role::Prefill } else { Role::Decode };
            Arc::new(StubWorker { name: format!("{}-{i}", role.as_str()), role, blocks }) as Arc<dyn Worker>
        })
        .collect();
    let front = baton_model::Frontend::open(model).with_context(|| format!("loading {}", model.display()))?;
    let max_context = front.config.max_position_embeddings;
    let validator = Validator {
        model_id: "bench".into(),
        aliases: Vec::new(),
        max_context,
        vocab_size: front.config.vocab_size,
        max_prompt_bytes: Validator::prompt_bytes_bound(&front.tokenizer, max_context),
        tokenizer: Arc::new(front.tokenizer),
        template: None,
    };
    let policy = kv_centric()?;

    // The conductor: one runtime thread of its own.
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (indexed_tx, indexed_rx) = std::sync::mpsc::channel();
    let server = std::thread::spawn(move || -> anyhow::Result<()> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        rt.block_on(async move {
            let conductor = Arc::new(Conductor::new(validator, workers, policy.build(BLOCK_TOKENS), None, None));
            let router = Arc::clone(&conductor).router();
            // The index is full once every stream's snapshot is applied.
            let start = Instant::now();
            let indexed = loop {
                let n: usize =
                    conductor.workers().iter().filter_map(|w| conductor.view().blocks(w.name())).map(|b| b.len()).sum();
                if n >= args.index_blocks / args.workers * args.workers || start.elapsed() > Duration::from_secs(120) {
                    break n;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            let _ = indexed_tx.send(indexed);
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let _ = addr_tx.send(listener.local_addr()?);
            baton_protocol::http::serve(
                listener,
                router,
                baton_protocol::http::HttpLimits::default(),
                None,
                async {
                    let _ = stop_rx.await;
                },
                Duration::from_secs(1),
            )
            .await?;
            Ok(())
        })
    });
    let indexed = indexed_rx.recv().context("the conductor stopped before indexing")?;
    let addr = addr_rx.recv().context("the conductor did not start")?;
    eprintln!("conductor up at {addr}, {indexed} blocks indexed");

    let client_threads = std::thread::available_parallelism().map_or(1, |n| n.get().saturating_sub(1).max(1));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(client_threads).enable_all().build()?;
    let report = rt.block_on(async move {
        let client = reqwest::Client::builder().pool_max_idle_per_host(args.concurrency).build()?;
        let url = format!("http://{addr}/v1/completions");
        let prompts = Arc::new(prompts);
        let body = move |i: usize| {
            let mut rng = StdRng::seed_from_u64(i as u64);
            let mut prompt = if i.is_multiple_of(2) {
                prompts[rng.random_range(0..prompts.len())].clone()
            } else {
                (0..PROMPT_BLOCKS * BLOCK_TOKENS).map(|_| rng.random_range(0..VOCAB)).collect()
            };
            prompt.extend((0..BLOCK_TOKENS * 2).map(|_| rng.random_range(0..VOCAB)));
            serde_json::json!({"model": "bench", "prompt": prompt, "max_tokens": 2, "temperature": 0})
        };
        let send = |client: reqwest::Client, url: String, body: serde_json::Value| async move {
            let start = Instant::now();
            let resp = client.post(&url).json(&body).send().await?;
            let status = resp.status();
            let _ = resp.bytes().await?;
            anyhow::ensure!(status.is_success(), "the conductor answered {status}");
            anyhow::Ok(start.elapsed().as_secs_f64() * 1e6)
        };
        // Added latency: one request at a time (after a warm-up).
        for i in 0..50 {
            send(client.clone(), url.clone(), body(i)).await?;
        }
        let mut alone = Vec::new();
        for i in 0..args.requests / 10 {
            alone.push(send(client.clone(), url.clone(), body(1_000_000 + i)).await?);
        }
        // Throughput: `concurrency` clients, each sending its share back to back.
        let start = Instant::now();
        let tasks: Vec<_> = (0..args.concurrency)
            .map(|c| {
                let (client, url, body) = (client.clone(), url.clone(), body.clone());
                tokio::spawn(async move {
                    let mut times = Vec::new();
                    for i in (c..args.requests).step_by(args.concurrency) {
                        times.push(send(client.clone(), url.clone(), body(2_000_000 + i)).await?);
                    }
                    anyhow::Ok(times)
                })
            })
            .collect();
        let mut loaded = Vec::new();
        for t in tasks {
            loaded.extend(t.await??);
        }
        let elapsed = start.elapsed().as_secs_f64();
        anyhow::Ok(LoadFigures {
            workers: args.workers,
            indexed_blocks: indexed,
            added: latency(alone),
            concurrency: args.concurrency,
            routed_per_s: loaded.len() as f64 / elapsed,
            under_load: latency(loaded),
        })
    });
    let _ = stop_tx.send(());
    server.join().map_err(|_| anyhow::anyhow!("the conductor's thread panicked"))??;
    report
}

/// The kv-centric policy with its defaults and the 70B/8×H100 cost profile: the conductor
/// benchmarks' router.
pub(crate) fn kv_centric() -> anyhow::Result<PolicyChoice> {
    Ok(PolicyChoice::Sched {
        policy: "kv-centric".parse()?,
        config: baton_sched::PolicyConfig::default(),
        admission: baton_sched::AdmissionConfig::default(),
        cost: Box::new(baton_sched::CostProfile::llama2_70b_8xh100()),
        seed: 1,
        kv_fetch: true,
        decode_affinity: true,
        conditional_tokens: None,
    })
}

fn latency(mut us: Vec<f64>) -> Latency {
    us.sort_by(f64::total_cmp);
    Latency { p50_us: baton_measure::percentile(&us, 50.0), p99_us: baton_measure::percentile(&us, 99.0) }
}

/// Prints the load half beside its targets.
pub(crate) fn print(r: &LoadFigures) {
    let verdict = |ok: bool| if ok { "ok" } else { "MISSED" };
    println!(
        "conductor under load: {} stub workers, {} blocks indexed, kv-centric, one runtime thread",
        r.workers, r.indexed_blocks
    );
    println!(
        "  added latency, one request at a time: p50 {:.0} us  p99 {:.0} us   target p99 < {ADDED_P99_TARGET_US:.0} us   {}",
        r.added.p50_us,
        r.added.p99_us,
        verdict(r.added.p99_us < ADDED_P99_TARGET_US)
    );
    println!(
        "  routed with {} in flight: {:.0} requests/s (p50 {:.0} us, p99 {:.0} us)   target >= {THROUGHPUT_TARGET:.0}/s   {}",
        r.concurrency,
        r.routed_per_s,
        r.under_load.p50_us,
        r.under_load.p99_us,
        verdict(r.routed_per_s >= THROUGHPUT_TARGET)
    );
}
