//! The pool counts what its tier copies move into and out of the device arena
//! (`MemPool::copy_meter`, exported as `baton_kv_copy_bytes_total{direction}`): a block demoted
//! to the host or disk tier is device to host, one brought back host to device; host to disk
//! is neither.

#![allow(clippy::unwrap_used)]

use baton_kv::{CopyBytes, InstanceId, KvGeometry, KvLayout, MemPool, PoolConfig};

#[test]
fn tier_copies_are_counted_by_direction_and_nothing_else_is() {
    let geometry = KvGeometry::new(2, 2, 8, 4);
    let block = (geometry.block_elems() * geometry.dtype.size()) as u64;
    let dir = std::env::temp_dir().join(format!("baton-kv-copies-{}", std::process::id()));
    let mut pool = MemPool::new(PoolConfig {
        host_blocks: 2,
        disk_blocks: 4,
        disk_dir: Some(dir),
        ..PoolConfig::device_only(InstanceId(1), geometry, KvLayout::BlockMajor, 8)
    })
    .unwrap();
    let prompt: Vec<u32> = (0..12).collect();
    let blocks = pool.alloc_blocks(3).unwrap();
    assert_eq!(pool.insert(&prompt, &blocks, 1).unwrap(), 3);
    pool.free_blocks(&blocks).unwrap();
    assert_eq!(pool.copy_meter().snapshot(), CopyBytes::default(), "allocating and caching copy nothing");

    // Three blocks leave the device: to the host tier first; a host block that must make room
    // goes on to disk (host to disk: not the device's).
    assert_eq!(pool.swap_out(3, 2).unwrap(), 3);
    let out = pool.copy_meter().snapshot();
    assert_eq!(out.device_to_host, 3 * block, "each demoted block left the device once");
    assert_eq!((out.host_to_device, out.device_to_device), (0, 0));

    // They come back for a prompt that uses them.
    let (again, tokens) = pool.acquire_prefix(&prompt, 3).unwrap();
    assert_eq!(tokens, 12);
    let back = pool.copy_meter().snapshot();
    assert_eq!(back.host_to_device, 3 * block, "each block came back onto the device once");
    assert_eq!(back.device_to_host, out.device_to_host);
    pool.free_blocks(&again).unwrap();
    pool.check_invariants().unwrap();
}

#[test]
fn the_device_arena_is_made_under_the_name_asked_for() {
    let geometry = KvGeometry::new(1, 1, 8, 4);
    let named = |name: &'static str| {
        let pool = MemPool::new(PoolConfig {
            device_arena_name: name,
            host_blocks: 1,
            ..PoolConfig::device_only(InstanceId(2), geometry, KvLayout::BlockMajor, 4)
        })
        .unwrap();
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let has =
            |n: &str| maps.lines().any(|l| l.contains(&format!("/memfd:{n} ")) || l.ends_with(&format!("/memfd:{n}")));
        (has(name), has(baton_kv::HOST_TIER_NAME), pool)
    };
    let (device, host, _pool) = named("baton-test-device-arena");
    assert!(device && host, "the device arena and the host tier each under its own name");
}
