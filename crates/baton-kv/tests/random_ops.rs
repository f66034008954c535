//! Seeded random-operation test of the MemPool: 100,000 operations mixing allocation, free,
//! insert, match, delete, swaps (including unfinished ones, out and in: a swap-in's copies made
//! through a `SwapCopier`'s own mappings) and eviction under pressure, with
//! requests holding references. After every step it checks that every block of every tier has
//! exactly one owner, that reference counts equal what the simulated requests hold, that the
//! maintained `available()` counter equals a scan, that match agrees with the index the event
//! stream describes (`Replay`, the stream folded by itself), and that KV bytes survive every move.

use std::collections::{BTreeMap, HashMap};

use baton_kv::{
    BlockHash, BlockId, IndexEntry, InstanceId, KvAddr, KvDtype, KvEvent, KvEventKind, KvGeometry, KvLayout, KvPart,
    Loc, MemPool, PolicyKind, PoolConfig, PoolError, SwapCopier, SwapIn, SwapJob, Tier, prefix_hashes,
};

/// splitmix64: a seeded generator, so a failure replays exactly.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// What a pool's stream of KV events says its index holds, folded from the events alone (each
/// instance's cached blocks and the number of its next event): the stream's contract. The index
/// the conductor keeps from the stream is baton-sched's `GlobalPromptTrees`, whose
/// `tests/kv_events.rs` feeds it pools' events.
#[derive(Debug, Default)]
struct Replay {
    instances: BTreeMap<InstanceId, (u64, BTreeMap<BlockHash, IndexEntry>)>,
}

impl Replay {
    /// Takes one event in, asserting that it is the instance's next (numbered from 0, no gap)
    /// and that a move or a removal names a block the stream stored.
    fn apply(&mut self, event: &KvEvent) {
        let (next, entries) = self.instances.entry(event.instance).or_default();
        assert_eq!(event.seq, *next, "{}: events come numbered in sequence", event.instance);
        *next += 1;
        match &event.kind {
            KvEventKind::Stored { hash, parent, tier, .. } => {
                entries.insert(*hash, IndexEntry { parent: *parent, tier: *tier });
            }
            KvEventKind::Moved { hash, tier } => {
                entries.get_mut(hash).unwrap_or_else(|| panic!("{hash} moved before it was stored")).tier = *tier;
            }
            KvEventKind::Removed { hash } => {
                entries.remove(hash).unwrap_or_else(|| panic!("{hash} removed before it was stored"));
            }
        }
    }

    /// The cached blocks of one instance, ordered by hash (`MemPool::index_entries`' form).
    fn entries(&self, instance: InstanceId) -> BTreeMap<BlockHash, IndexEntry> {
        self.instances.get(&instance).map(|(_, e)| e.clone()).unwrap_or_default()
    }

    /// Leading blocks of the prompt whose block hashes are `hashes` that `instance` caches.
    fn prefix_len(&self, instance: InstanceId, hashes: &[BlockHash]) -> usize {
        self.instances.get(&instance).map_or(0, |(_, e)| hashes.iter().take_while(|h| e.contains_key(h)).count())
    }
}

const BS: usize = 4;

/// The value stored at element `i` of the block whose chained hash is `h` (an integer below
/// 256: exact in float32, float16 and bfloat16 alike).
fn pattern(h: BlockHash, i: usize) -> f32 {
    ((h.0 >> ((i % 8) * 8)) & 0xff) as f32
}

#[derive(Debug, Default)]
struct Request {
    prompt: Vec<u32>,
    /// Device blocks in token order (one reference each).
    blocks: Vec<BlockId>,
    /// Blocks matched but left where they are (one reference each, any tier).
    held: Vec<KvAddr>,
}

struct Sim {
    pool: MemPool,
    /// The index the pool's events describe.
    stream: Replay,
    requests: Vec<Request>,
    job: Option<SwapJob>,
    /// A swap-in under way, and the request it brings blocks to.
    swapping: Option<(Request, SwapIn)>,
    copier: SwapCopier,
    rng: Rng,
    now: u64,
    /// Every full-block prefix ever inserted (by its last block's hash).
    ever_inserted: HashMap<BlockHash, usize>,
    /// Requests whose cached prefix reached into the disk tier.
    disk_hits: usize,
    /// Swap-ins finished after other operations ran meanwhile, with lower-tier copies.
    swapped_in: usize,
}

impl Sim {
    fn prompt(&mut self) -> Vec<u32> {
        // Few "documents" over a tiny vocabulary: prompts share prefixes often.
        let doc = self.rng.below(40) as u32;
        let len = self.rng.below(7 * BS);
        (0..len as u32).map(|i| if i < 8 { doc % 3 } else { (doc * 7 + i * (doc % 5 + 1)) % 11 }).collect()
    }

    fn write_blocks(&mut self, prompt: &[u32], blocks: &[BlockId], from: usize) {
        let hashes = prefix_hashes(prompt, BS);
        let slab = self.pool.geometry().slab_elems();
        for (i, h) in hashes.iter().enumerate().skip(from) {
            for part in [KvPart::Key, KvPart::Value] {
                for slot in 0..BS {
                    let row: Vec<f32> =
                        (0..row_len()).map(|j| pattern(*h, part as usize * slab + slot * row_len() + j)).collect();
                    self.pool.arena_mut().write_token(0, part, blocks[i], slot, &row);
                }
            }
        }
    }

    fn verify_blocks(&self, prompt: &[u32], blocks: &[BlockId]) {
        let hashes = prefix_hashes(prompt, BS);
        let slab = self.pool.geometry().slab_elems();
        for (i, &b) in blocks.iter().enumerate() {
            for part in [KvPart::Key, KvPart::Value] {
                let mut data = vec![0f32; slab];
                self.pool.arena().slab(0, part, b).rows_to_f32(0, slab, 1, slab, &mut data);
                for (e, &x) in data.iter().enumerate() {
                    assert_eq!(
                        x,
                        pattern(hashes[i], part as usize * slab + e),
                        "block {i} of a matched prefix: wrong KV"
                    );
                }
            }
        }
    }

    /// The longest prefix of `prompt` the pool's events say it caches.
    fn stream_overlap(&self, prompt: &[u32]) -> usize {
        self.stream.prefix_len(InstanceId(3), &prefix_hashes(prompt, BS))
    }

    /// Takes the pool's events in (they come in order and name known blocks: `Replay` asserts it).
    fn sync_events(&mut self) {
        for e in self.pool.drain_events() {
            self.stream.apply(&e);
        }
    }

    fn step(&mut self) {
        self.now += 1;
        let now = self.now;
        match self.rng.below(100) {
            // A request arrives: reuse its cached prefix, allocate the rest, write its KV.
            0..=19 => {
                let prompt = self.prompt();
                let expect = self.stream_overlap(&prompt);
                self.disk_hits += usize::from(self.pool.peek_prefix(&prompt)[Tier::Disk.index()] > 0);
                let (mut blocks, tokens) = self.pool.acquire_prefix(&prompt, now).expect("acquire never fails");
                assert!(tokens <= expect * BS, "match returned more than was cached");
                assert_eq!(tokens, blocks.len() * BS);
                self.verify_blocks(&prompt, &blocks);
                let need = (prompt.len() + 1 + self.rng.below(6)).div_ceil(BS).saturating_sub(blocks.len());
                match self.pool.alloc_blocks(need) {
                    Ok(new) => {
                        let from = blocks.len();
                        blocks.extend(new);
                        self.write_blocks(&prompt, &blocks, from);
                        self.requests.push(Request { prompt, blocks, held: Vec::new() });
                    }
                    Err(PoolError::OutOfBlocks { .. }) => self.pool.free_blocks(&blocks).expect("held"),
                    Err(e) => panic!("{e}"),
                }
            }
            // A request finishes: usually cache its prompt, then let go.
            20..=44 => {
                if self.requests.is_empty() {
                    return;
                }
                let k = self.rng.below(self.requests.len());
                let r = self.requests.swap_remove(k);
                if self.rng.below(10) < 8 {
                    self.pool.insert(&r.prompt, &r.blocks, now).expect("insert of held blocks");
                    for h in prefix_hashes(&r.prompt, BS) {
                        *self.ever_inserted.entry(h).or_default() += 1;
                    }
                }
                self.pool.free_blocks(&r.blocks).expect("held");
                self.pool.free_mem(&r.held).expect("held");
            }
            // Match only, holding blocks wherever they are (they must not move or vanish).
            45..=52 => {
                let prompt = self.prompt();
                let expect = self.stream_overlap(&prompt);
                let m = self.pool.match_prefix(&prompt, now);
                assert_eq!(m.len(), expect, "match disagrees with the event-fed index");
                for h in prefix_hashes(&prompt, BS).iter().take(m.len()) {
                    assert!(self.ever_inserted.contains_key(h), "matched a block never inserted");
                }
                let tiers: Vec<Tier> = m.addrs.iter().map(|a| a.loc.tier).collect();
                assert!(tiers.windows(2).all(|w| w[0] <= w[1]), "tiers only get slower along a prefix");
                self.requests.push(Request { prompt, blocks: Vec::new(), held: m.addrs });
            }
            // Bring a holder's blocks to the device.
            53..=57 => {
                let Some(k) = self
                    .requests
                    .iter()
                    .position(|r| !r.held.is_empty() && r.blocks.is_empty() && !r.prompt.is_empty())
                else {
                    return;
                };
                if self.swapping.is_none() && self.rng.below(2) == 0 {
                    // A swap-in that stays under way across other operations.
                    let r = self.requests.swap_remove(k);
                    match self.pool.begin_swap_in(&r.held) {
                        Ok(job) => self.swapping = Some((r, job)),
                        Err(PoolError::OutOfBlocks { .. }) => self.requests.push(r),
                        Err(e) => panic!("{e}"),
                    }
                    return;
                }
                let held = std::mem::take(&mut self.requests[k].held);
                match self.pool.swap_in(&held) {
                    Ok(blocks) => {
                        let prompt = self.requests[k].prompt.clone();
                        self.verify_blocks(&prompt, &blocks);
                        self.requests[k].blocks = blocks;
                    }
                    Err(PoolError::OutOfBlocks { .. }) => self.requests[k].held = held,
                    Err(e) => panic!("{e}"),
                }
            }
            58..=63 => {
                let prompt = self.prompt();
                self.pool.delete(&prompt);
            }
            64..=71 => {
                let n = self.rng.below(8);
                self.pool.swap_out(n, now).expect("swap out");
            }
            // Swaps that stay in flight across other operations.
            72..=79 if self.swapping.is_some() && self.rng.below(2) == 0 => {
                let (mut r, job) = self.swapping.take().expect("checked");
                if self.rng.below(4) == 0 {
                    // Given up: the slots go back and the request's references are dropped.
                    self.pool.abort_swap_in(job).expect("abort swap-in");
                    return;
                }
                for (from, to) in job.copies() {
                    self.copier.copy(from, to).expect("copy");
                }
                self.swapped_in += usize::from(job.lower() > 0);
                let blocks = self.pool.finish_swap_in(job).expect("finish swap-in");
                self.verify_blocks(&r.prompt, &blocks);
                r.held.clear();
                r.blocks = blocks;
                self.requests.push(r);
            }
            72..=79 => match self.job.take() {
                Some(job) => {
                    self.pool.finish_swap(job).expect("finish swap");
                }
                None => self.job = Some(self.pool.begin_swap_out(1 + self.rng.below(6), now).expect("begin swap")),
            },
            // Host or disk memory held by a request directly.
            80..=84 => {
                let tier = if self.rng.below(2) == 0 { Tier::Host } else { Tier::Disk };
                if let Ok(addrs) = self.pool.alloc_mem(1 + self.rng.below(3), tier) {
                    self.requests.push(Request { prompt: Vec::new(), blocks: Vec::new(), held: addrs });
                }
            }
            // Abort: free without caching.
            _ => {
                if self.requests.is_empty() {
                    return;
                }
                let k = self.rng.below(self.requests.len());
                let r = self.requests.swap_remove(k);
                self.pool.free_blocks(&r.blocks).expect("held");
                self.pool.free_mem(&r.held).expect("held");
            }
        }
    }

    fn check(&mut self) {
        if let Err(e) = self.pool.check_invariants() {
            panic!("after step {}: {e}", self.now);
        }
        // Reference counts are exactly what the simulated requests hold.
        let mut held: HashMap<Loc, u32> = HashMap::new();
        for r in &self.requests {
            for &b in &r.blocks {
                *held.entry(Loc { tier: Tier::Device, block: b }).or_default() += 1;
            }
            for a in &r.held {
                *held.entry(a.loc).or_default() += 1;
            }
        }
        for a in self.swapping.iter().flat_map(|(r, _)| &r.held) {
            *held.entry(a.loc).or_default() += 1;
        }
        // `available()` is a maintained counter: it must equal free blocks plus every cached
        // device block no request holds, counted here by a scan (blocks a swap job is moving
        // are excluded by the pool, and `check_invariants` compares those too).
        if self.job.is_none() {
            let idle_cached = self
                .pool
                .index()
                .iter()
                .map(|n| self.pool.index().info(n).loc)
                .filter(|&loc| loc.tier == Tier::Device && self.pool.ref_count(loc) == 0)
                .count();
            assert_eq!(self.pool.available(), self.pool.num_free() + idle_cached, "step {}: available()", self.now);
        }
        for tier in Tier::ALL {
            let usage = self.pool.usage(tier);
            assert_eq!(usage.free + usage.held + usage.cached + usage.in_flight, self.pool.num_blocks(tier));
            for i in 0..self.pool.num_blocks(tier) {
                let loc = Loc { tier, block: BlockId(i as u32) };
                assert_eq!(
                    self.pool.ref_count(loc),
                    held.get(&loc).copied().unwrap_or(0),
                    "step {}: refs of {loc:?}",
                    self.now
                );
            }
        }
        self.sync_events();
    }
}

fn row_len() -> usize {
    2
}

fn run(seed: u64, policy: PolicyKind, steps: usize) {
    run_of(seed, policy, steps, KvDtype::F32);
}

fn run_of(seed: u64, policy: PolicyKind, steps: usize, dtype: KvDtype) {
    let dir = std::env::temp_dir().join(format!("baton-kv-random-{}-{seed}", std::process::id()));
    let geometry = KvGeometry { dtype, ..KvGeometry::new(1, 1, row_len(), BS) };
    let pool = MemPool::new(PoolConfig {
        host_blocks: 24,
        disk_blocks: 16,
        disk_dir: Some(dir.clone()),
        policy,
        ..PoolConfig::device_only(InstanceId(3), geometry, KvLayout::LayerMajor, 40)
    })
    .expect("pool");
    let copier = pool.swap_copier().expect("the arenas are shared");
    let mut sim = Sim {
        copier,
        swapping: None,
        pool,
        stream: Replay::default(),
        requests: Vec::new(),
        job: None,
        rng: Rng(seed),
        now: 0,
        ever_inserted: HashMap::new(),
        disk_hits: 0,
        swapped_in: 0,
    };
    let mut moved_lower = 0;
    for i in 0..steps {
        sim.step();
        sim.check();
        if i % 1000 == 0 {
            assert_eq!(sim.stream.entries(InstanceId(3)), sim.pool.index_entries(), "event-fed index diverged");
        }
        moved_lower += usize::from(sim.pool.index_entries().values().any(|e| e.tier == Tier::Disk));
    }
    eprintln!(
        "{policy:?}: steps with disk entries {moved_lower}, disk hits {}; usage {:?} {:?} {:?}",
        sim.disk_hits,
        sim.pool.usage(Tier::Device),
        sim.pool.usage(Tier::Host),
        sim.pool.usage(Tier::Disk)
    );
    assert!(moved_lower > 0, "the workload never reached the disk tier");
    assert!(sim.disk_hits > 0, "no request ever read its prefix back from disk");
    assert!(sim.swapped_in > 0, "no swap-in under way copied from a slower tier");
    // Everyone lets go: only the cache and the free list own blocks.
    if let Some(job) = sim.job.take() {
        sim.pool.finish_swap(job).expect("finish");
    }
    if let Some((_, job)) = sim.swapping.take() {
        sim.pool.abort_swap_in(job).expect("abort");
    }
    for r in std::mem::take(&mut sim.requests) {
        sim.pool.free_blocks(&r.blocks).expect("held");
        sim.pool.free_mem(&r.held).expect("held");
    }
    sim.check();
    for tier in Tier::ALL {
        let u = sim.pool.usage(tier);
        assert_eq!((u.held, u.in_flight), (0, 0), "{tier}: leaked blocks");
        assert_eq!(u.free + u.cached, sim.pool.num_blocks(tier));
    }
    assert_eq!(sim.stream.entries(InstanceId(3)), sim.pool.index_entries());
    drop(sim);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn hundred_thousand_random_operations_lru() {
    run(0x5eed_0001, PolicyKind::Lru, 100_000);
}

#[test]
fn random_operations_lfu() {
    run(0x5eed_0002, PolicyKind::Lfu, 30_000);
}

/// A 16-bit pool: its blocks take half the bytes in every tier, disk included, and the KV
/// survives every move between them.
#[test]
fn random_operations_on_16_bit_kv() {
    run_of(0x5eed_0003, PolicyKind::Lru, 30_000, KvDtype::F16);
    run_of(0x5eed_0004, PolicyKind::Lfu, 10_000, KvDtype::Bf16);
}
