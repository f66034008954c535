//! `baton bench index`: the conductor's KV index at cluster scale. Fills it with the KV events
//! of `--workers` workers holding `--blocks` blocks in all (real prompts' chained block hashes),
//! through the conductor's own path ([`ClusterView::apply`], and once more from NDJSON lines as
//! the control API carries them), then times `kv-centric` routing decisions against it.
//! Prints events/s (target ≥ 5M blocks/s on one core) and the decision's p50/p99 (target
//! < 100 µs), each beside its target.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use baton_kv::{InstanceId, prefix_hashes};
use baton_sched::GlobalPromptTrees;
use baton_server::Role;
use baton_server::routing::{RouteRequest, Snapshot, WorkerView};
use baton_server::sched::PolicyChoice;
use baton_server::view::{ClusterView, KvIndexMode, PREDICTED_TTL_US};
use baton_server::wire::{BlockChange, BlockEvent, CachedBlock, KvTier, LoadReport, StateUpdate};
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

    // 1. The conductor's path, in memory.
    let trees = Arc::new(Mutex::new(GlobalPromptTrees::new(PREDICTED_TTL_US)));
    let view = ClusterView::new(Arc::clone(&trees), KvIndexMode::Exact);
    let followers: Vec<u64> = (0..a.workers).map(|w| view.enroll(&name(w), InstanceId(w as u32))).collect();
    let role = |w: usize| if w.is_multiple_of(2) { Role::Prefill } else { Role::Decode };
    let start = Instant::now();
    for (w, update) in deltas.iter().flatten().cloned() {
        view.apply(&name(w), role(w), followers[w], update)?;
    }
    let applied = start.elapsed();
    let rate = total as f64 / applied.as_secs_f64();

    // 2. From the wire: NDJSON lines decoded and applied.
    let lines: Vec<(usize, Vec<u8>)> =
        deltas.iter().flatten().map(|(w, u)| serde_json::to_vec(u).map(|l| (*w, l))).collect::<Result<_, _>>()?;
    let wire_trees = Arc::new(Mutex::new(GlobalPromptTrees::new(PREDICTED_TTL_US)));
    let wire_view = ClusterView::new(wire_trees, KvIndexMode::Exact);
    let wire_followers: Vec<u64> = (0..a.workers).map(|w| wire_view.enroll(&name(w), InstanceId(w as u32))).collect();
    let start = Instant::now();
    for (w, line) in &lines {
        let update: StateUpdate = serde_json::from_slice(line)?;
        wire_view.apply(&name(*w), role(*w), wire_followers[*w], update)?;
    }
    let wire_rate = total as f64 / start.elapsed().as_secs_f64();

    // 3. kv-centric decisions against the full index: half the prompts extend a cached one.
    let choice: PolicyChoice = PolicyChoice::Sched {
        policy: "kv-centric".parse()?,
        config: baton_sched::PolicyConfig::default(),
        admission: baton_sched::AdmissionConfig::default(),
        cost: Box::new(baton_sched::CostProfile::llama2_70b_8xh100()),
        seed: 1,
        kv_fetch: true,
        decode_affinity: true,
        conditional_tokens: None,
    };
    let policy = choice.build(a.block_tokens);
    policy.attach_index(Arc::clone(&trees));
    let snapshot = Snapshot {
        workers: (0..a.workers)
            .map(|w| WorkerView {
                instance: w as u32,
                capacity_blocks: a.blocks / a.workers * 2,
                report: Some(LoadReport { total_blocks: a.blocks / a.workers * 2, ..LoadReport::default() }),
                ..WorkerView::new(w, role(w), 0)
            })
            .collect(),
        now_us: 1,
    };
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
        let start = Instant::now();
        let d = policy.route(&snapshot, &request);
        times.push(start.elapsed().as_nanos() as u64);
        hits += usize::from(matches!(d, baton_server::routing::Decision::Disaggregated { .. }));
    }
    times.sort_unstable();
    let pct = |p: f64| times[((times.len() - 1) as f64 * p) as usize] as f64 / 1e3;
    let indexed: usize = (0..a.workers).map(|w| trees_len(&trees, w)).sum();

    println!("conductor KV index: {} workers, {indexed} blocks indexed", a.workers);
    println!(
        "  apply (ClusterView::apply, in memory): {:>8.2} M blocks/s   target >= 5.00 M blocks/s   {}",
        rate / 1e6,
        if rate >= 5e6 { "ok" } else { "MISSED" }
    );
    println!(
        "  apply from NDJSON (decode + apply):     {:>8.2} M blocks/s   (the control API's path)",
        wire_rate / 1e6
    );
    println!(
        "  kv-centric decision ({} decisions, {hits} routed): p50 {:.1} us  p99 {:.1} us   target p99 < 100 us   {}",
        a.decisions,
        pct(0.5),
        pct(0.99),
        if pct(0.99) < 100.0 { "ok" } else { "MISSED" }
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
