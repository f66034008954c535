//! Blocks that come back from a slower tier are checked (issue #63, item 3): a host or disk
//! tier damaged under the pool — bytes overwritten through `/proc/self/fd`, as a failing disk
//! or a stray writer would — never hands back the damaged bytes. The block that fails its
//! checksum leaves the index with what is cached below it, the pool counts it, and the prefix
//! comes back shorter (its tokens are computed again), with the undamaged blocks intact.

#![allow(clippy::unwrap_used)]

use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use baton_kv::{BlockId, InstanceId, KvGeometry, KvLayout, KvPart, MemPool, PoolConfig, PoolError, Tier};

const BLOCKS: usize = 3;

fn geometry() -> KvGeometry {
    KvGeometry::new(2, 2, 8, 4)
}

/// A prompt of three whole blocks.
fn prompt() -> Vec<u32> {
    (100..100 + (BLOCKS * 4) as u32).collect()
}

fn value(block: usize, layer: usize, part: usize, slot: usize) -> f32 {
    (block * 1000 + layer * 100 + part * 10 + slot) as f32
}

/// A pool whose prompt's three blocks were computed, cached and swapped out to the first
/// slower tier (host when it has one, else disk).
fn pool_with_prompt_below(instance: u32, host_blocks: usize, disk_blocks: usize) -> MemPool {
    let dir = std::env::temp_dir().join(format!("baton-kv-checksums-{}", std::process::id()));
    let mut pool = MemPool::new(PoolConfig {
        host_blocks,
        disk_blocks,
        disk_dir: Some(dir),
        ..PoolConfig::device_only(InstanceId(instance), geometry(), KvLayout::LayerMajor, 8)
    })
    .unwrap();
    let blocks = pool.alloc_blocks(BLOCKS).unwrap();
    for (i, &b) in blocks.iter().enumerate() {
        for layer in 0..2 {
            for (p, part) in [KvPart::Key, KvPart::Value].into_iter().enumerate() {
                for slot in 0..4 {
                    pool.arena_mut().token_mut(layer, part, b, slot).fill(value(i, layer, p, slot));
                }
            }
        }
    }
    assert_eq!(pool.insert(&prompt(), &blocks, 1).unwrap(), BLOCKS);
    pool.free_blocks(&blocks).unwrap();
    assert_eq!(pool.swap_out(BLOCKS, 2).unwrap(), BLOCKS);
    pool
}

/// The slot of the prompt's `i`-th block (on a slower tier).
fn slot_of(pool: &mut MemPool, i: usize) -> (Tier, BlockId) {
    let m = pool.match_prefix(&prompt(), 2);
    let loc = m.addrs[i].loc;
    pool.free_mem(&m.addrs).unwrap();
    (loc.tier, loc.block)
}

/// Overwrites 4 bytes of `file` at `at`, through a descriptor of its own.
fn damage(file: &PathBuf, at: u64) {
    let f = std::fs::OpenOptions::new().write(true).open(file).unwrap();
    f.write_all_at(&[0xA5; 4], at).unwrap();
}

/// The disk tier's (unlinked) block file of `instance`, through `/proc/self/fd`.
fn disk_file(instance: u32) -> PathBuf {
    let want = format!("baton-kv-{instance}-{}-", std::process::id());
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| std::fs::read_link(p).is_ok_and(|t| t.to_string_lossy().contains(&want)))
        .expect("the disk tier's file is open")
}

/// The device blocks hold exactly the prompt's first blocks' values.
fn assert_intact(pool: &MemPool, blocks: &[BlockId]) {
    for (i, &b) in blocks.iter().enumerate() {
        for layer in 0..2 {
            for (p, part) in [KvPart::Key, KvPart::Value].into_iter().enumerate() {
                let got = pool.arena().block(layer, part, b);
                for slot in 0..4 {
                    assert!(got[slot * 16..(slot + 1) * 16].iter().all(|&x| x == value(i, layer, p, slot)));
                }
            }
        }
    }
}

#[test]
fn a_damaged_host_block_is_dropped_counted_and_never_served() {
    let mut pool = pool_with_prompt_below(6301, 8, 0);
    let (tier, slot) = slot_of(&mut pool, 1);
    assert_eq!(tier, Tier::Host);
    let host = pool.arena_of(Tier::Host).unwrap();
    let at = host.descriptor().byte_ranges(&[slot])[0].offset + 40;
    damage(&host.handle().unwrap().path(), at as u64);

    let (blocks, tokens) = pool.acquire_prefix(&prompt(), 3).unwrap();
    assert_eq!(tokens, 4, "only the block before the damaged one comes back");
    assert_intact(&pool, &blocks);
    assert_eq!(pool.corrupt_blocks(), 1);
    assert_eq!(pool.index_entries().len(), 1, "the damaged block and the one below it left the index");
    pool.free_blocks(&blocks).unwrap();
    pool.check_invariants().unwrap();
}

#[test]
fn a_damaged_disk_block_is_dropped_counted_and_never_served() {
    let mut pool = pool_with_prompt_below(6302, 0, 8);
    let (tier, slot) = slot_of(&mut pool, 0);
    assert_eq!(tier, Tier::Disk);
    let block_bytes = geometry().block_elems() * 4;
    damage(&disk_file(6302), (slot.index() * block_bytes + 100) as u64);

    let (blocks, tokens) = pool.acquire_prefix(&prompt(), 3).unwrap();
    assert_eq!(tokens, 0, "the first block is damaged: nothing comes back");
    assert!(blocks.is_empty());
    assert_eq!(pool.corrupt_blocks(), 1);
    assert!(pool.index_entries().is_empty());
    pool.check_invariants().unwrap();
}

/// The engine's way: a copier on another thread finds the damage; giving the swap-in back
/// drops the block, and the next match stops before it.
#[test]
fn a_copier_that_finds_a_damaged_block_has_it_dropped_when_the_swap_in_is_given_back() {
    let mut pool = pool_with_prompt_below(6303, 0, 8);
    let (_, slot) = slot_of(&mut pool, 2);
    let block_bytes = geometry().block_elems() * 4;
    damage(&disk_file(6303), (slot.index() * block_bytes + block_bytes - 4) as u64);

    let job = pool.begin_acquire_prefix(&prompt(), 3).unwrap();
    let mut copier = pool.swap_copier().unwrap();
    let copied: Vec<_> = job.copies().into_iter().map(|(from, to)| copier.copy(from, to)).collect();
    assert!(copied[..2].iter().all(Result::is_ok));
    assert!(matches!(copied[2], Err(PoolError::Corrupt(a)) if a.loc.block == slot), "{copied:?}");
    assert_eq!(pool.corrupt_blocks(), 1);
    pool.abort_swap_in(job).unwrap();
    assert_eq!(pool.index_entries().len(), 2);

    let (blocks, tokens) = pool.acquire_prefix(&prompt(), 4).unwrap();
    assert_eq!(tokens, 8);
    assert_intact(&pool, &blocks);
    pool.free_blocks(&blocks).unwrap();
    pool.check_invariants().unwrap();
}

/// A damaged host block evicted on to disk is dropped, not carried down with a fresh sum.
#[test]
fn a_damaged_host_block_is_not_moved_on_to_disk() {
    let mut pool = pool_with_prompt_below(6304, 3, 8);
    let (_, slot) = slot_of(&mut pool, 2);
    let host = pool.arena_of(Tier::Host).unwrap();
    let at = host.descriptor().byte_ranges(&[slot])[0].offset;
    damage(&host.handle().unwrap().path(), at as u64);
    // Three more blocks cached and swapped out push the prompt's from the host to disk.
    let other: Vec<u32> = (500..512).collect();
    let blocks = pool.alloc_blocks(3).unwrap();
    pool.insert(&other, &blocks, 5).unwrap();
    pool.free_blocks(&blocks).unwrap();
    pool.swap_out(3, 6).unwrap();
    assert_eq!(pool.corrupt_blocks(), 1);
    assert_eq!(pool.peek_prefix(&prompt()).iter().sum::<usize>(), 2, "{:?}", pool.peek_prefix(&prompt()));
    let (blocks, tokens) = pool.acquire_prefix(&prompt(), 7).unwrap();
    assert_eq!(tokens, 8);
    assert_intact(&pool, &blocks);
    pool.free_blocks(&blocks).unwrap();
    pool.check_invariants().unwrap();
}
