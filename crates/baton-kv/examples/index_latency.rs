//! Latency of `insert` and `match` of a 4K-token prompt (256 blocks of 16) into a MemPool whose
//! index holds 1M blocks, as min / p10 / median over many single calls: on a busy machine the
//! minimum and low percentiles say more than criterion's mean.
//!
//! Run: `cargo run --release -p baton-kv --example index_latency [-- SAMPLES]`.

use std::hint::black_box;
use std::time::Instant;

use baton_kv::{InstanceId, KvGeometry, KvLayout, MemPool, PoolConfig};

const BLOCK: usize = 16;
const REQUEST_BLOCKS: usize = 256;
const INDEX_BLOCKS: usize = 1 << 20;

fn prompt(seed: u64, tokens: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..tokens)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 150_000) as u32
        })
        .collect()
}

fn summary(name: &str, mut ns: Vec<f64>) {
    ns.sort_by(f64::total_cmp);
    let at = |q: f64| baton_measure::percentile(&ns, q) / 1e3;
    println!(
        "{name:<7} n={:<6} min {:7.2} µs  p10 {:7.2} µs  median {:7.2} µs  p90 {:7.2} µs",
        ns.len(),
        at(0.0),
        at(10.0),
        at(50.0),
        at(90.0)
    );
}

fn main() {
    let samples: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(3000);
    let geometry = KvGeometry::new(1, 1, 1, BLOCK);
    let mut pool = MemPool::new(PoolConfig::device_only(
        InstanceId(0),
        geometry,
        KvLayout::BlockMajor,
        INDEX_BLOCKS + 64 * REQUEST_BLOCKS,
    ))
    .expect("pool");
    let tokens = REQUEST_BLOCKS * BLOCK;
    for i in 0..(INDEX_BLOCKS / REQUEST_BLOCKS) as u64 {
        let p = prompt(i, tokens);
        let blocks = pool.alloc_blocks(REQUEST_BLOCKS).expect("room");
        pool.insert(&p, &blocks, i).expect("insert");
        pool.free_blocks(&blocks).expect("held");
        black_box(pool.drain_events());
    }
    let mut now = 1 << 20;
    let mut seed = 1 << 40;
    let (mut ins, mut mat) = (Vec::with_capacity(samples), Vec::with_capacity(samples));
    for _ in 0..samples {
        seed += 1;
        now += 1;
        let p = prompt(seed, tokens);
        let blocks = pool.alloc_blocks(REQUEST_BLOCKS).expect("room");
        let t = Instant::now();
        let added = pool.insert(black_box(&p), &blocks, now).expect("insert");
        ins.push(t.elapsed().as_nanos() as f64);
        assert_eq!(added, REQUEST_BLOCKS);
        pool.free_blocks(&blocks).expect("held");
        black_box(pool.drain_events());
        now += 1;
        let t = Instant::now();
        let m = pool.match_prefix(black_box(&p), now);
        mat.push(t.elapsed().as_nanos() as f64);
        assert_eq!(m.len(), REQUEST_BLOCKS);
        pool.free_mem(&m.addrs).expect("held");
    }
    summary("insert", ins);
    summary("match", mat);
    println!("available {} of {}", pool.available(), pool.num_blocks(baton_kv::Tier::Device));
}
