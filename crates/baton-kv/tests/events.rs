//! Applying a pool's stream of KV events to an empty remote index yields an equal index, across
//! inserts, tier moves, eviction and deletes; a lost event is detected, not absorbed.

use baton_kv::{
    EventError, InstanceId, KvGeometry, KvLayout, MemPool, PolicyKind, PoolConfig, RemoteIndex, Tier, prefix_hashes,
};

fn pool(instance: u32, policy: PolicyKind) -> MemPool {
    MemPool::new(PoolConfig {
        host_blocks: 6,
        policy,
        ..PoolConfig::device_only(InstanceId(instance), KvGeometry::new(1, 1, 2, 2), KvLayout::BlockMajor, 8)
    })
    .expect("pool")
}

fn serve(pool: &mut MemPool, prompt: &[u32], now: u64) {
    let (mut blocks, _) = pool.acquire_prefix(prompt, now).expect("acquire");
    let more = prompt.len().div_ceil(2).saturating_sub(blocks.len());
    blocks.extend(pool.alloc_blocks(more).expect("room"));
    pool.insert(prompt, &blocks, now).expect("insert");
    pool.free_blocks(&blocks).expect("held");
}

#[test]
fn remote_index_fed_by_events_equals_the_source() {
    for policy in [PolicyKind::Lru, PolicyKind::Lfu] {
        let mut a = pool(1, policy);
        let mut b = pool(2, policy);
        let mut remote = RemoteIndex::new();
        let mut now = 0;
        for round in 0..60u32 {
            now += 1;
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
                remote.apply(&e).expect("in order");
            }
            assert_eq!(remote.entries(InstanceId(1)), a.index_entries());
            assert_eq!(remote.entries(InstanceId(2)), b.index_entries());
        }
        assert!(a.index_entries().values().any(|e| e.tier == Tier::Host), "some blocks moved to host");
        let probe: Vec<u32> = (0..8).map(|i| (i * 2) % 5).collect();
        let hashes = prefix_hashes(&probe, 2);
        let local = a.peek_prefix(&probe).iter().sum::<usize>();
        let remote_a = remote.overlaps(&hashes).into_iter().find(|o| o.0 == InstanceId(1)).map_or(0, |o| o.1);
        assert_eq!(local, remote_a, "remote overlap matches the local match");
    }
}

#[test]
fn a_lost_event_is_reported() {
    let mut a = pool(1, PolicyKind::Lru);
    serve(&mut a, &[1, 2, 3, 4], 1);
    let events = a.drain_events();
    assert!(events.len() >= 2);
    let mut remote = RemoteIndex::new();
    assert_eq!(remote.apply(&events[1]), Err(EventError::Gap { instance: InstanceId(1), expected: 0, got: 1 }));
}

/// A cached chain no request holds is reclaimable whole, though only its last block is
/// evictable at a time; a block a request holds is neither.
#[test]
fn a_cached_chain_no_one_holds_counts_as_reclaimable_whole() {
    let mut a = pool(1, PolicyKind::Lru);
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
