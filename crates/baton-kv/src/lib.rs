//! KV cache memory for Baton: MemServe's MemPool, FlowKV's allocation, Mooncake's block keys.
//!
//! This crate owns every byte of an instance's KV cache and the bookkeeping around it. It does
//! no network I/O, no model math and reads no clock: the model reads and writes KV through the
//! views this crate hands out, the transfer layer plans copies from the [`TensorDescriptor`]s it
//! describes, and callers pass time in as a number.
//!
//! The pieces, bottom up:
//!
//! - [`KvGeometry`], [`KvLayout`], [`TensorDescriptor`]: shape and order of the KV tensor;
//!   [`TensorDescriptor::byte_ranges`] turns block ids into the byte ranges they occupy.
//! - [`KvArena`]: one region per tier, in a memfd another process can map read-only through an
//!   [`ArenaHandle`] ([`MappedArena`]).
//! - [`SegmentAllocator`]: free blocks as contiguous runs; best-fit, aligned allocation and
//!   fragmentation figures. ([`BlockAllocator`] is the first engine's simple allocator.)
//! - [`block_hash`]: chained, seeded, process-stable block keys ([`BlockHash`]).
//! - [`HashTable`](hash_table::HashTable): an open-addressing map from block hashes to nonzero
//!   values, prefetchable; the prefix index's, and the conductor's global prompt trees'.
//! - [`PrefixIndex`]: a radix tree over token blocks whose nodes carry hash, tier and slot.
//! - [`EvictionPolicy`]: [`Lru`] and [`Lfu`], with pinning.
//! - [`MemPool`]: the facade: `alloc_mem`/`free_mem`, `insert`/`match_prefix`/`delete`,
//!   `swap_out`/`swap_in` over device, host and disk tiers, reference counts, and
//!   [`KvEvent`]s that an index elsewhere (the conductor's: baton-sched's `GlobalPromptTrees`)
//!   applies to stay in sync.
//! - [`BlockTable`]: the blocks of one sequence, in token order.
//! - [`block_checksum`]: the CRC-32C every block on the host and disk tiers carries, checked
//!   when it comes back (a block that fails is dropped, counted and recomputed).
//! - [`CopyMeter`]: bytes moved into and out of the device arena, by direction (tiers, the
//!   device backend, the transfer plane).
//!
//! An engine's life with the pool:
//!
//! ```
//! use baton_kv::{InstanceId, KvEventKind, KvGeometry, KvLayout, KvPart, MemPool, PoolConfig};
//!
//! let geometry = KvGeometry::new(2, 2, 8, 4);
//! let mut pool = MemPool::new(PoolConfig {
//!     host_blocks: 8,
//!     ..PoolConfig::device_only(InstanceId(1), geometry, KvLayout::BlockMajor, 8)
//! })?;
//! let prompt: Vec<u32> = (0..10).collect();
//!
//! // A request: nothing cached yet, so allocate and compute all of it.
//! let (cached, _) = pool.acquire_prefix(&prompt, 0)?;
//! assert!(cached.is_empty());
//! let blocks = pool.alloc_blocks(3)?;
//! pool.arena_mut().token_mut(0, KvPart::Key, blocks[0], 0).fill(1.0);
//! // It finished: cache its two full blocks, then let go of all three.
//! assert_eq!(pool.insert(&prompt, &blocks, 1)?, 2);
//! pool.free_blocks(&blocks)?;
//!
//! // Cold blocks move to host DRAM; a later request with the same prefix brings them back.
//! assert_eq!(pool.swap_out(2, 2)?, 2);
//! let (again, tokens) = pool.acquire_prefix(&prompt, 3)?;
//! assert_eq!(tokens, 8);
//! assert_eq!(pool.arena().block(0, KvPart::Key, again[0])[0], 1.0);
//! pool.free_blocks(&again)?;
//!
//! // Each change to the index was an event, numbered from 0: two blocks stored, then moved to
//! // the host and back. A conductor follows the pool by them, from a snapshot of the index.
//! let events = pool.drain_events();
//! assert!(events.iter().zip(0..).all(|(e, seq)| e.seq == seq));
//! let stored = events.iter().filter(|e| matches!(e.kind, KvEventKind::Stored { .. })).count();
//! assert_eq!((stored, pool.index_entries().len()), (2, 2));
//! assert_eq!(pool.next_event_seq(), events.len() as u64);
//! pool.check_invariants()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod allocator;
mod arena;
mod block_table;
mod checksum;
mod copies;
mod events;
mod geometry;
mod hash;
pub mod hash_table;
mod index;
mod policy;
mod pool;
mod ranges;
mod segment;
mod tier;

pub use allocator::{AllocatorError, BlockAllocator};
pub use arena::{ArenaHandle, DEFAULT_ARENA_NAME, KvArena, MappedArena, Slab};
pub use block_table::BlockTable;
pub use checksum::{block_checksum, checksum_ranges};
pub use copies::{CopyBytes, CopyDirection, CopyMeter};
pub use events::{BlockTokens, EventError, IndexEntry, KvEvent, KvEventKind};
pub use geometry::{Dim, KvDtype, KvGeometry, KvLayout, KvPart, TensorDescriptor};
pub use hash::{BlockHash, HASH_SEED, block_hash, fnv1a_32, fnv1a_64, prefix_hashes};
pub use index::{NodeInfo, PrefixIndex};
pub use policy::{EvictionPolicy, Lfu, Lru, NodeId, PolicyKind, Ranked};
pub use pool::{
    DevicePrefix, HOST_TIER_NAME, MAX_BUFFERED_EVENTS, MemPool, PoolConfig, PoolError, PrefixMatch, SwapCopier, SwapIn,
    SwapJob, TierOwners,
};
pub use ranges::ByteRange;
pub use segment::{FragmentationStats, Segment, SegmentAllocator, count_runs, segments_of};
pub use tier::{DiskStore, InstanceId, KvAddr, Loc, Tier};

/// Identifies one block of an instance's KV arena: an index into the arena, `0..num_blocks`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

impl BlockId {
    /// The block's index into the arena.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl std::fmt::Display for BlockId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "block#{}", self.0)
    }
}
