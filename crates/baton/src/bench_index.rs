//! `baton bench index`: the conductor's KV index at cluster scale. Fills it with the KV events
//! of `--workers` workers holding `--blocks` blocks in all (real prompts' chained block hashes),
//! through the conductor's own path ([`ClusterView::apply`] of updates in memory; then from the
//! wire: the control API's binary frames read by [`StateReader`] in transport-sized chunks and
//! applied, and for reference the same from NDJSON lines), then times `kv-centric` routing
//! decisions against it. Prints each figure beside its target (issue #35): in memory ≥ 20 M
//! blocks/s, from the wire ≥ 5 M blocks/s on one core, a decision's p99 < 20 µs.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use baton_conductor::routing::{RouteRequest, cluster_snapshot, ready_trees};
use baton_conductor::view::{ClusterView, KvIndexMode, PREDICTED_TTL_US};
use baton_kv::{InstanceId, prefix_hashes};
use baton_protocol::Role;
use baton_protocol::state_codec::{StateFormat, StateReader};
use baton_protocol::wire::{BlockChange, BlockEvent, CachedBlock, KvTier, LoadReport, StateUpdate};
use baton_sched::{GlobalPromptTrees, TierUsage, WorkerLoad};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Arguments of `baton bench index`.
#[derive(Debug, clap::Args)]
pub(crate) struct IndexArgs {
    /// Workers (half prefill, half decode).
    #[arg(long, default_value_t = 16)]
    workers: usize,
    /// Blocks indexed in all.
    #[arg(long, default_value_t = 1_000_000)]
    blocks: usize,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block_tokens: usize,
    /// Blocks per cached prompt.
    #[arg(long, default_value_t = 64)]
    prompt_blocks: usize,
    /// Events per delta (a worker's batch).
    #[arg(long, default_value_t = 1024)]
    batch: usize,
    /// Routing decisions to time.
    #[arg(long, default_value_t = 20_000)]
    decisions: usize,
}

/// Targets of issue #35.
const MEMORY_TARGET: f64 = 20e6;
const WIRE_TARGET: f64 = 5e6;
const P99_TARGET_US: f64 = 20.0;
/// Bytes the wire path hands its reader at a time (about what a socket read brings).
const CHUNK: usize = 64 << 10;

fn name(w: usize) -> String {
    format!("w{w}")
}

pub(crate) fn run(a: IndexArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.workers >= 2 && a.blocks > 0 && a.prompt_blocks > 0 && a.batch > 0, "nothing to measure");
    let mut rng = StdRng::seed_from_u64(7);
    let prompt_tokens = a.prompt_blocks * a.block_tokens;
    let prompts_per_worker = a.blocks.div_ceil(a.prompt_blocks * a.workers);
    // Each worker's events: every block of its prompts stored, in order.
    eprintln!("hashing {} prompts of {prompt_tokens} tokens ...", prompts_per_worker * a.workers);
    let mut prompts: Vec<Vec<u32>> = Vec::new();
    let mut deltas: Vec<Vec<(usize, StateUpdate)>> = vec![Vec::new(); a.workers];
    for (w, worker_deltas) in deltas.iter_mut().enumerate() {
        let mut events = Vec::new();
        for _ in 0..prompts_per_worker {
            let prompt: Vec<u32> = (0..prompt_tokens).map(|_| rng.random_range(0..32_000)).collect();
            let hashes = prefix_hashes(&prompt, a.block_tokens);
            for (i, h) in hashes.iter().enumerate() {
                let parent = (i > 0).then(|| hashes[i - 1].0);
                let seq = events.len() as u64;
                events.push(BlockEvent {
                    seq,
                    change: BlockChange::Stored(CachedBlock { hash: h.0, parent, tier: KvTier::Device }),
                });
            }
            prompts.push(prompt);
        }
        for chunk in events.chunks(a.batch) {
            let update = StateUpdate::Delta { events: chunk.to_vec(), load: LoadReport::default(), at_ms: 0 };
            worker_deltas.push((w, update));
        }
    }
    let total: usize = deltas.iter().flatten().map(|(_, u)| events_of(u)).sum();

    // 1. The conductor's path, in memory (the updates owned, as the stream's reader hands them
    // over; copying them is not the index's cost).
    let trees = Arc::new(Mutex::new(GlobalPromptTrees::new(PREDICTED_TTL_US)));
    let view = ClusterView::new(Arc::clone(&trees), KvIndexMode::Exact);
    let followers: Vec<u64> = (0..a.workers).map(|w| view.enroll(&name(w), InstanceId(w as u32))).collect();
    let role = |w: usize| if w.is_multiple_of(2) { Role::Prefill } else { Role::Decode };
    let owned: Vec<(usize, StateUpdate)> = deltas.iter().flatten().cloned().collect();
    let start = Instant::now();
    for (w, update) in owned {
        view.apply(&name(w), role(w), followers[w], update)?;
    }
    let rate = total as f64 / start.elapsed().as_secs_f64();

    // 2. From the wire: each worker's stream of binary frames, read in socket-sized chunks,
    // decoded and applied; then the same from NDJSON lines, for reference.
    let wire_rate = |format: StateFormat| -> anyhow::Result<(f64, usize)> {
        let mut streams: Vec<Vec<u8>> = vec![Vec::new(); a.workers];
        for (w, update) in deltas.iter().flatten() {
            format.encode(update, &mut streams[*w])?;
        }
        let bytes = streams.iter().map(Vec::len).sum();
        let view = ClusterView::new(Arc::new(Mutex::new(GlobalPromptTrees::new(PREDICTED_TTL_US))), KvIndexMode::Exact);
        let followers: Vec<u64> = (0..a.workers).map(|w| view.enroll(&name(w), InstanceId(w as u32))).collect();
        let start = Instant::now();
        for (w, stream) in streams.iter().enumerate() {
            let mut reader = StateReader::new(format);
            for chunk in stream.chunks(CHUNK) {
                reader.extend(chunk);
                while let Some(update) = reader.next_update()? {
                    view.apply(&name(w), role(w), followers[w], update)?;
                }
            }
        }
        Ok((total as f64 / start.elapsed().as_secs_f64(), bytes))
    };
    let (binary_rate, binary_bytes) = wire_rate(StateFormat::Binary)?;
    let (ndjson_rate, ndjson_bytes) = wire_rate(StateFormat::Ndjson)?;

    // 3. kv-centric decisions against the full index: half the prompts extend a cached one.
    let policy = crate::bench_conductor_load::kv_centric()?.build(a.block_tokens);
    let config = policy.snapshot_config();
    // Every worker's pool is full (its report: no block free), nothing queued or decoding.
    let total = (a.blocks / a.workers * 2) as u64;
    let loads: Vec<WorkerLoad> = (0..a.workers)
        .map(|w| WorkerLoad {
            kv_device: TierUsage { used: total, total },
            ..WorkerLoad::idle(InstanceId(w as u32), role(w))
        })
        .collect();
    let mut times = Vec::with_capacity(a.decisions);
    let mut hits = 0usize;
    for i in 0..a.decisions {
        let mut prompt = if i.is_multiple_of(2) {
            prompts[rng.random_range(0..prompts.len())].clone()
        } else {
            (0..prompt_tokens).map(|_| rng.random_range(0..32_000)).collect()
        };
        prompt.extend((0..a.block_tokens * 4).map(|_| rng.random_range(0..32_000u32)));
        let request = RouteRequest { prompt: &prompt, max_tokens: 128, session: None };
        // A decision as the conductor makes it: the trees held still, the snapshot built over
        // them, the policy's plan, its prediction applied.
        let start = Instant::now();
        let d = {
            let mut trees = trees.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            ready_trees(&mut trees, 1, &loads);
            let plan = policy.plan(&cluster_snapshot(1, &loads, &trees, &config), &request);
            if let Some(p) = &plan.predict {
                trees.apply_predict(p, 1);
            }
            plan.decision
        };
        times.push(start.elapsed().as_nanos() as u64);
        hits += usize::from(matches!(d, baton_conductor::routing::Decision::Disaggregated { .. }));
    }
    times.sort_unstable();
    let pct = |p: f64| baton_measure::percentile(&times, p) / 1e3;
    let indexed: usize = (0..a.workers).map(|w| trees_len(&trees, w)).sum();

    let verdict = |ok: bool| if ok { "ok" } else { "MISSED" };
    println!("conductor KV index: {} workers, {indexed} blocks indexed", a.workers);
    println!(
        "  apply in memory (ClusterView::apply):        {:>7.2} M blocks/s   target >= {:.0} M blocks/s   {}",
        rate / 1e6,
        MEMORY_TARGET / 1e6,
        verdict(rate >= MEMORY_TARGET)
    );
    println!(
        "  apply from the wire (binary decode + apply): {:>7.2} M blocks/s   target >= {:.0} M blocks/s   {}   ({:.1} bytes/block)",
        binary_rate / 1e6,
        WIRE_TARGET / 1e6,
        verdict(binary_rate >= WIRE_TARGET),
        binary_bytes as f64 / total as f64
    );
    println!(
        "  apply from NDJSON (decode + apply):          {:>7.2} M blocks/s   (reference: `curl`'s format, {:.1} bytes/block)",
        ndjson_rate / 1e6,
        ndjson_bytes as f64 / total as f64
    );
    println!(
        "  kv-centric decision ({} decisions, {hits} routed): p50 {:.1} us  p99 {:.1} us   target p99 < {P99_TARGET_US:.0} us   {}",
        a.decisions,
        pct(50.0),
        pct(99.0),
        verdict(pct(99.0) < P99_TARGET_US)
    );
    Ok(())
}

fn events_of(u: &StateUpdate) -> usize {
    match u {
        StateUpdate::Delta { events, .. } => events.len(),
        StateUpdate::Snapshot { blocks, .. } => blocks.len(),
    }
}

fn trees_len(trees: &Mutex<GlobalPromptTrees>, w: usize) -> usize {
    trees.lock().map(|t| t.confirmed_by_tier(InstanceId(w as u32)).iter().sum()).unwrap_or(0)
}
