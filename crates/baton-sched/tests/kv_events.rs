//! The conductor's index of the cluster's caches follows each worker's pool by its KV events:
//! `GlobalPromptTrees` fed two pools' streams holds exactly each pool's cached blocks and
//! tiers, across inserts, tier moves, eviction and deletes, and matches a prompt as far as the
//! pool does; a lost event is reported as a gap, not absorbed.

use baton_kv::{EventError, InstanceId, KvGeometry, KvLayout, MemPool, PolicyKind, PoolConfig, Tier, prefix_hashes};
use baton_sched::GlobalPromptTrees;

/// A pool of 8 device and 6 host blocks of 2 tokens.
fn pool(instance: u32, policy: PolicyKind) -> MemPool {
    let geometry = KvGeometry::new(1, 1, 2, 2);
    let config = PoolConfig::device_only(InstanceId(instance), geometry, KvLayout::BlockMajor, 8);
    MemPool::new(PoolConfig { host_blocks: 6, policy, ..config }).expect("pool")
}

/// A request on `prompt`: its cached prefix taken, the rest allocated, all of it cached after.
fn serve(pool: &mut MemPool, prompt: &[u32], now: u64) {
    let (mut blocks, _) = pool.acquire_prefix(prompt, now).expect("acquire");
    let more = prompt.len().div_ceil(2).saturating_sub(blocks.len());
    blocks.extend(pool.alloc_blocks(more).expect("room"));
    pool.insert(prompt, &blocks, now).expect("insert");
    pool.free_blocks(&blocks).expect("held");
}

/// The pool's cached blocks as the trees keep them: hash and tier, ordered by hash.
fn cached(pool: &MemPool) -> Vec<(baton_kv::BlockHash, Tier)> {
    pool.index_entries().into_iter().map(|(h, e)| (h, e.tier)).collect()
}

#[test]
fn prompt_trees_fed_by_pools_events_hold_what_the_pools_cache() {
    for policy in [PolicyKind::Lru, PolicyKind::Lfu] {
        let (mut a, mut b) = (pool(1, policy), pool(2, policy));
        let mut trees = GlobalPromptTrees::new(1_000_000);
        for round in 0..60u32 {
            let now = u64::from(round) + 1;
            let prompt: Vec<u32> = (0..(round % 7 + 2)).map(|i| (i * (round % 4 + 1)) % 5).collect();
            serve(&mut a, &prompt, now);
            serve(&mut b, &prompt[..prompt.len() / 2 + 1], now);
            if round % 5 == 0 {
                a.swap_out(3, now).expect("swap");
            }
            if round % 11 == 0 {
                a.delete(&prompt);
            }
            for e in a.drain_events().into_iter().chain(b.drain_events()) {
                trees.apply(&e).expect("in order");
            }
            assert_eq!(trees.confirmed(InstanceId(1)), cached(&a), "round {round}");
            assert_eq!(trees.confirmed(InstanceId(2)), cached(&b), "round {round}");
        }
        assert!(trees.confirmed_by_tier(InstanceId(1))[Tier::Host.index()] > 0, "some blocks moved to host");
        let probe: Vec<u32> = (0..8).map(|i| (i * 2) % 5).collect();
        let hashes = prefix_hashes(&probe, 2);
        let local = a.peek_prefix(&probe).iter().sum::<usize>();
        assert_eq!(trees.prefix_len(InstanceId(1), &hashes, 0), local, "the trees match as far as the pool");
    }
}

#[test]
fn a_lost_event_is_reported() {
    let mut a = pool(1, PolicyKind::Lru);
    serve(&mut a, &[1, 2, 3, 4], 1);
    let events = a.drain_events();
    assert!(events.len() >= 2);
    let mut trees = GlobalPromptTrees::new(1_000_000);
    assert_eq!(trees.apply(&events[1]), Err(EventError::Gap { instance: InstanceId(1), expected: 0, got: 1 }));
    assert!(trees.confirmed(InstanceId(1)).is_empty(), "nothing past the gap is applied");
}
