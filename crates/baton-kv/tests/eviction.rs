//! A full pool makes room by dropping the coldest cached prompt whole, from its tail, before a
//! warmer prompt loses a block: the prefix caching every serving system's LRU gives (vLLM,
//! SGLang's radix cache), and what `baton sim`'s prefix cache models.

use baton_kv::{InstanceId, KvGeometry, KvLayout, MemPool, PolicyKind, PoolConfig, Tier};

/// A device-only pool of `blocks` blocks of 2 tokens.
fn pool(blocks: usize, policy: PolicyKind) -> MemPool {
    let config = PoolConfig {
        policy,
        ..PoolConfig::device_only(InstanceId(0), KvGeometry::new(1, 1, 2, 2), KvLayout::BlockMajor, blocks)
    };
    MemPool::new(config).expect("pool")
}

/// Runs a prompt as the engine does: takes its cached prefix, computes the rest into new blocks,
/// caches them and lets go.
fn serve(pool: &mut MemPool, prompt: &[u32], now: u64) -> usize {
    let (mut blocks, cached) = pool.acquire_prefix(prompt, now).expect("acquire");
    let more = prompt.len().div_ceil(2) - blocks.len();
    blocks.extend(pool.alloc_blocks(more).expect("room"));
    pool.insert(prompt, &blocks, now).expect("insert");
    pool.free_blocks(&blocks).expect("held");
    cached
}

fn prompt(first: u32) -> Vec<u32> {
    (first..first + 8).collect()
}

fn cached_blocks(pool: &MemPool, prompt: &[u32]) -> usize {
    pool.peek_prefix(prompt)[Tier::Device.index()]
}

#[test]
fn a_full_pool_drops_the_coldest_prompt_whole_before_trimming_others() {
    for policy in [PolicyKind::Lru, PolicyKind::Lfu] {
        let mut p = pool(12, policy);
        let (a, b, c, d) = (prompt(0), prompt(100), prompt(200), prompt(300));
        for (now, x) in [&a, &b, &c].into_iter().enumerate() {
            assert_eq!(serve(&mut p, x, now as u64), 0);
        }
        assert_eq!(p.usage(Tier::Device).cached, 12, "{policy:?}: the pool is full of three prompts");
        // A fourth prompt needs 4 blocks: the coldest prompt, `a`, gives all of them.
        serve(&mut p, &d, 3);
        let held = [&a, &b, &c, &d].map(|x| cached_blocks(&p, x));
        assert_eq!(held, [0, 4, 4, 4], "{policy:?}: blocks cached of a, b, c, d");
        // `b` is used again (a whole hit), so `c` is now the coldest and goes next.
        assert_eq!(serve(&mut p, &b, 4), 8, "{policy:?}");
        serve(&mut p, &a, 5);
        let held = [&a, &b, &c, &d].map(|x| cached_blocks(&p, x));
        assert_eq!(held, [4, 4, 0, 4], "{policy:?}: after b's reuse and a's return");
    }
}

#[test]
fn a_prompt_too_big_for_the_room_left_keeps_the_head_of_the_coldest() {
    let mut p = pool(12, PolicyKind::Lru);
    let (a, b, c) = (prompt(0), prompt(100), prompt(200));
    for (now, x) in [&a, &b, &c].into_iter().enumerate() {
        serve(&mut p, x, now as u64);
    }
    // Two blocks of room: `a` loses its last two blocks and keeps a cached head of two.
    serve(&mut p, &[500, 501, 502, 503], 3);
    assert_eq!([&a, &b, &c].map(|x| cached_blocks(&p, x)), [2, 4, 4]);
}

/// A cached chain no request holds is reclaimable whole, though only its last block is
/// evictable at a time; a block a request holds is neither.
#[test]
fn a_cached_chain_no_one_holds_counts_as_reclaimable_whole() {
    let mut a = pool(8, PolicyKind::Lru);
    let prompt: Vec<u32> = (0..8).collect();
    serve(&mut a, &prompt, 1);
    let u = a.usage(Tier::Device);
    assert_eq!((u.cached, u.evictable, u.unheld_cached), (4, 1, 4));
    let (held, _) = a.acquire_prefix(&prompt[..4], 2).expect("acquire");
    let u = a.usage(Tier::Device);
    assert_eq!((u.cached, u.unheld_cached), (4, 2), "the two held blocks are in use");
    a.free_blocks(&held).expect("held");
    assert_eq!(a.usage(Tier::Device).unheld_cached, 4);
}
