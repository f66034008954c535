//! MemPool benchmarks, beside MemServe's published figures (about 800 ns per block for the
//! memory APIs; at most 0.7 ms to insert a 4K-token prompt):
//!
//! - alloc/free of a 256-block request (target ≤ 50 ns per block);
//! - insert and match of a 4K-token prompt (256 blocks of 16) into an index of 1M blocks
//!   (target ≤ 50 µs each);
//! - swap-out/in throughput to host DRAM and to disk, next to this machine's memcpy bandwidth
//!   measured in the same run.
//!
//! Run: `cargo bench -p baton-kv`. `cargo bench -p baton-kv -- --test` runs each once.

// `criterion_group!` generates an undocumented public function.
#![allow(missing_docs)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use baton_kv::{InstanceId, KvGeometry, KvLayout, MemPool, PoolConfig, SegmentAllocator, Tier};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

const BLOCK: usize = 16;
const REQUEST_BLOCKS: usize = 256;
const INDEX_BLOCKS: usize = 1 << 20;

/// Deterministic distinct token streams.
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

fn tiny_geometry() -> KvGeometry {
    KvGeometry::new(1, 1, 1, BLOCK)
}

fn alloc_free(c: &mut Criterion) {
    let mut g = c.benchmark_group("alloc_free_256_blocks");
    g.throughput(Throughput::Elements(REQUEST_BLOCKS as u64));
    let mut seg = SegmentAllocator::new(64 * 1024);
    let mut out = Vec::with_capacity(REQUEST_BLOCKS);
    g.bench_function("segment_allocator", |b| {
        b.iter(|| {
            out.clear();
            assert!(seg.allocate_into(REQUEST_BLOCKS, &mut out));
            seg.free(black_box(&out)).expect("held");
        })
    });
    let mut pool =
        MemPool::new(PoolConfig::device_only(InstanceId(0), tiny_geometry(), KvLayout::BlockMajor, 64 * 1024))
            .expect("pool");
    g.bench_function("mempool", |b| {
        b.iter(|| {
            let blocks = pool.alloc_blocks(REQUEST_BLOCKS).expect("room");
            pool.free_blocks(black_box(&blocks)).expect("held");
        })
    });
    g.finish();
}

fn index(c: &mut Criterion) {
    let extra = 64 * REQUEST_BLOCKS;
    let mut pool = MemPool::new(PoolConfig::device_only(
        InstanceId(0),
        tiny_geometry(),
        KvLayout::BlockMajor,
        INDEX_BLOCKS + extra,
    ))
    .expect("pool");
    let tokens = REQUEST_BLOCKS * BLOCK;
    let fill = Instant::now();
    for i in 0..(INDEX_BLOCKS / REQUEST_BLOCKS) as u64 {
        let p = prompt(i, tokens);
        let blocks = pool.alloc_blocks(REQUEST_BLOCKS).expect("room");
        pool.insert(&p, &blocks, i).expect("insert");
        pool.free_blocks(&blocks).expect("held");
        black_box(pool.drain_events());
    }
    eprintln!("index: filled {} blocks in {:?}", pool.index().len(), fill.elapsed());
    let mut g = c.benchmark_group("index_4k_prompt_1m_blocks");
    g.throughput(Throughput::Elements(REQUEST_BLOCKS as u64));
    let mut seed = 1 << 40;
    let mut now = 1 << 20;
    g.bench_function("insert", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                seed += 1;
                now += 1;
                let p = prompt(seed, tokens);
                // Evicts the coldest cached prompt when the arena is full (untimed).
                let blocks = pool.alloc_blocks(REQUEST_BLOCKS).expect("room");
                let t = Instant::now();
                let added = pool.insert(black_box(&p), &blocks, now).expect("insert");
                total += t.elapsed();
                assert_eq!(added, REQUEST_BLOCKS);
                pool.free_blocks(&blocks).expect("held");
                // A consumer drains events every step; keep them out of the timing.
                black_box(pool.drain_events());
            }
            total
        })
    });
    let cached = prompt(seed, tokens);
    g.bench_function("match", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                now += 1;
                let t = Instant::now();
                let m = pool.match_prefix(black_box(&cached), now);
                total += t.elapsed();
                assert_eq!(m.len(), REQUEST_BLOCKS);
                pool.free_mem(&m.addrs).expect("held");
            }
            total
        })
    });
    g.finish();
}

fn swap(c: &mut Criterion) {
    // A 1 MiB block: 16 layers, 8 KV heads of 64, 16 tokens, f32.
    let geometry = KvGeometry::new(16, 8, 64, BLOCK);
    let block_bytes = geometry.block_elems() * 4;
    let n = 64;
    let bytes = (n * block_bytes) as u64;

    let mut g = c.benchmark_group("swap_64_blocks_of_1mib");
    g.throughput(Throughput::Bytes(bytes));
    g.sample_size(10);
    let src = vec![1u8; n * block_bytes];
    let mut dst = vec![0u8; n * block_bytes];
    g.bench_function("memcpy", |b| b.iter(|| dst.copy_from_slice(black_box(&src))));

    let dir = std::env::temp_dir().join(format!("baton-kv-bench-{}", std::process::id()));
    for (name, host, disk) in [("host", n, 0), ("disk", 0, n)] {
        let mut pool = MemPool::new(PoolConfig {
            host_blocks: host,
            disk_blocks: disk,
            disk_dir: Some(dir.clone()),
            ..PoolConfig::device_only(InstanceId(0), geometry, KvLayout::BlockMajor, 2 * n)
        })
        .expect("pool");
        let p = prompt(7, n * BLOCK);
        let blocks = pool.alloc_blocks(n).expect("room");
        for x in pool.arena_mut().as_mut_slice() {
            *x = 1.0;
        }
        pool.insert(&p, &blocks, 0).expect("insert");
        pool.free_blocks(&blocks).expect("held");
        let mut now = 1;
        g.bench_function(format!("swap_out_to_{name}"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    now += 1;
                    let t = Instant::now();
                    assert_eq!(pool.swap_out(n, now).expect("swap out"), n);
                    total += t.elapsed();
                    let (back, _) = pool.acquire_prefix(&p, now).expect("swap in");
                    pool.free_blocks(&back).expect("held");
                }
                total
            })
        });
        g.bench_function(format!("swap_in_from_{name}"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    now += 1;
                    assert_eq!(pool.swap_out(n, now).expect("swap out"), n);
                    let t = Instant::now();
                    let (back, _) = pool.acquire_prefix(&p, now).expect("swap in");
                    total += t.elapsed();
                    assert_eq!(back.len(), n);
                    assert_eq!(pool.index().len(), n);
                    pool.free_blocks(&back).expect("held");
                }
                total
            })
        });
        assert_eq!(pool.peek_prefix(&p)[Tier::Device.index()], n);
    }
    g.finish();
    let _ = std::fs::remove_dir_all(dir);
}

criterion_group!(benches, alloc_free, index, swap);
criterion_main!(benches);
