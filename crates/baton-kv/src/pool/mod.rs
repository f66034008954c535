//! MemPool: one API over every byte of an instance's KV memory (MemServe Table 1).
//!
//! The pool owns three tiers (device, host, disk), each a set of block slots with a
//! [`SegmentAllocator`], per-slot reference counts and an eviction policy, and one
//! [`PrefixIndex`] whose nodes point into any tier. Every slot has exactly one owner:
//!
//! - the free list (its allocator),
//! - running requests (reference count > 0, not in the index),
//! - the index (a node points at it; requests may also hold references, which pin it),
//! - an in-flight swap (the destination of a move that has not finished).
//!
//! [`MemPool::check_invariants`] proves that, and the random-operation test calls it after every
//! step. Cached blocks obey one more rule: along every path of the tree, tiers only get slower
//! (a device block never hangs below a host block), so eviction only ever needs to look at the
//! coldest block that has no child in its own tier.
//!
//! Every block on the host and disk tiers carries a checksum, checked when it is read back; a
//! block that fails is dropped from the index and counted, never served (`check.rs`).
//!
//! The pool does no network I/O and reads no clock: callers pass `now` (any monotone counter)
//! to the calls that record use.

use std::path::PathBuf;
use std::sync::Arc;

use crate::events::{BlockTokens, IndexEntry, KvEvent, KvEventKind};

/// Most KV events a pool buffers undrained; past it the buffer is dropped (the consumer sees a
/// gap in the sequence numbers and resynchronises).
pub const MAX_BUFFERED_EVENTS: usize = 1 << 16;
use crate::index::{HashStream, Lookup, PrefixIndex};
use crate::{
    AllocatorError, BlockHash, BlockId, DiskStore, EvictionPolicy, InstanceId, KvAddr, KvArena, KvGeometry, KvLayout,
    Loc, NodeId, PolicyKind, SegmentAllocator, Tier, block_hash,
};

mod accounting;
mod check;
mod swap;

pub use accounting::TierOwners;
pub use swap::{SwapCopier, SwapIn, SwapJob};

const NO_OWNER: u32 = u32::MAX;
const SWAP_OWNER: u32 = u32::MAX - 1;
/// How many blocks ahead [`MemPool::insert`] prefetches the node slot it will reuse.
const REUSE_AHEAD: usize = 4;

/// How to build a [`MemPool`].
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// This instance's id; every address the pool hands out carries it.
    pub instance: InstanceId,
    /// KV geometry (float32: the arenas hold `f32`).
    pub geometry: KvGeometry,
    /// Layout of the device arena (the host arena is always block-major).
    pub layout: KvLayout,
    /// Blocks in the device tier.
    pub device_blocks: usize,
    /// Blocks in the host DRAM tier (0: no host tier).
    pub host_blocks: usize,
    /// Blocks in the disk tier (0: no disk tier).
    pub disk_blocks: usize,
    /// Directory for the disk tier's block file; required when `disk_blocks > 0`.
    pub disk_dir: Option<PathBuf>,
    /// Eviction policy of every tier.
    pub policy: PolicyKind,
    /// The name of the device arena's memfd ([`KvArena::new_named`]): the default
    /// [`crate::DEFAULT_ARENA_NAME`], or a stand-in device's `baton-device-arena`.
    pub device_arena_name: &'static str,
}

impl PoolConfig {
    /// A device-only pool of `device_blocks` blocks with LRU eviction.
    pub fn device_only(instance: InstanceId, geometry: KvGeometry, layout: KvLayout, device_blocks: usize) -> Self {
        Self {
            instance,
            geometry,
            layout,
            device_blocks,
            host_blocks: 0,
            disk_blocks: 0,
            disk_dir: None,
            policy: PolicyKind::Lru,
            device_arena_name: crate::DEFAULT_ARENA_NAME,
        }
    }
}

/// The name of the host tier's memfd.
pub const HOST_TIER_NAME: &str = "baton-host-tier";

/// Why a pool call failed.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// Not enough free or evictable blocks in a tier.
    #[error("out of {tier} blocks: {wanted} wanted, {available} free or evictable")]
    OutOfBlocks {
        /// The tier.
        tier: Tier,
        /// Blocks asked for.
        wanted: usize,
        /// Blocks free or evictable.
        available: usize,
    },
    /// A block id outside its tier, or a block nobody holds.
    #[error(transparent)]
    Allocator(#[from] AllocatorError),
    /// The caller passed an address it holds no reference on.
    #[error("{0} is not held")]
    NotHeld(KvAddr),
    /// The address belongs to another instance.
    #[error("{0} belongs to another instance")]
    WrongInstance(KvAddr),
    /// The configuration is invalid.
    #[error("invalid pool configuration: {0}")]
    Config(String),
    /// Reading or writing the disk tier failed.
    #[error("disk tier I/O: {0}")]
    Io(#[from] std::io::Error),
    /// A block read back from the host or disk tier failed its checksum: it was dropped from
    /// the index (see [`MemPool::corrupt_blocks`]).
    #[error("{0} failed its checksum (damaged on its tier); dropped")]
    Corrupt(KvAddr),
}

/// The longest cached prefix of a prompt, with one reference held on each block.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Addresses of the cached blocks, in prompt order (device blocks first, then slower tiers).
    pub addrs: Vec<KvAddr>,
    /// Tokens covered: `addrs.len() · T`.
    pub tokens: usize,
}

impl PrefixMatch {
    /// Matched blocks.
    pub fn len(&self) -> usize {
        self.addrs.len()
    }

    /// Whether nothing matched.
    pub fn is_empty(&self) -> bool {
        self.addrs.is_empty()
    }

    /// Matched blocks already on the device tier (a prefix of `addrs`).
    pub fn on_device(&self) -> usize {
        self.addrs.iter().take_while(|a| a.loc.tier == Tier::Device).count()
    }
}

/// The device part of a cached prefix, seen without taking it ([`MemPool::peek_device_prefix`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DevicePrefix {
    /// Cached device blocks of the prefix, in a row from its start.
    pub blocks: usize,
    /// Of those, the blocks someone holds already.
    pub held: usize,
}

struct TierState {
    alloc: SegmentAllocator,
    refs: Vec<u32>,
    owner: Vec<u32>,
    policy: Box<dyn EvictionPolicy>,
    store: Store,
    /// The checksum of each slot's block (host and disk tiers), shared with copiers.
    sums: check::Sums,
    /// Cached slots no request holds and no swap is moving (see [`MemPool::available`]).
    reclaimable: usize,
}

enum Store {
    Arena(KvArena),
    Disk(DiskStore),
    None,
}

impl TierState {
    fn new(n: usize, policy: PolicyKind, store: Store) -> Self {
        Self {
            alloc: SegmentAllocator::new(n),
            refs: vec![0; n],
            owner: vec![NO_OWNER; n],
            policy: policy.build(),
            store,
            sums: check::sums(n),
            reclaimable: 0,
        }
    }

    fn size(&self) -> usize {
        self.refs.len()
    }
}

/// The KV memory pool of one instance: device, host and disk tiers, the prefix index, eviction
/// and KV events, behind MemServe's API.
///
/// KV events wait in a buffer of at most [`MAX_BUFFERED_EVENTS`] until
/// [`drain_events`](MemPool::drain_events); beyond it the oldest are dropped.
pub struct MemPool {
    instance: InstanceId,
    geometry: KvGeometry,
    tiers: [TierState; 3],
    index: PrefixIndex,
    events: Vec<KvEvent>,
    /// [`insert`](Self::insert)'s scratch list of blocks it added (position in the prompt, hash,
    /// parent hash), kept between calls so an insert allocates nothing for it.
    stored: Vec<(usize, BlockHash, Option<BlockHash>)>,
    next_seq: u64,
    now: u64,
    /// The tiers' checksums and the count of blocks that failed theirs.
    checker: check::Checker,
}

impl std::fmt::Debug for MemPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemPool")
            .field("instance", &self.instance)
            .field("cached", &self.index.len())
            .field("device_free", &self.tiers[0].alloc.num_free())
            .field("host_free", &self.tiers[1].alloc.num_free())
            .field("disk_free", &self.tiers[2].alloc.num_free())
            .finish()
    }
}

/// An arena in a memfd named `name`, or in private memory where the host allows no memfd.
fn arena_named(name: &str, g: KvGeometry, layout: KvLayout, blocks: usize) -> KvArena {
    KvArena::new_named(name, g, layout, blocks).unwrap_or_else(|_| KvArena::new_private(g, layout, blocks))
}

impl MemPool {
    /// Builds a pool: a shared-memory device arena, a host arena and a disk block file.
    pub fn new(config: PoolConfig) -> Result<Self, PoolError> {
        let g = config.geometry;
        if g.block_size == 0 || g.layers == 0 {
            return Err(PoolError::Config("block size and layers must be positive".into()));
        }
        let disk = if config.disk_blocks > 0 {
            let dir = config.disk_dir.as_ref().ok_or_else(|| PoolError::Config("a disk tier needs disk_dir".into()))?;
            static NEXT_FILE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let k = NEXT_FILE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let name = format!("baton-kv-{}-{}-{k}.blocks", config.instance.0, std::process::id());
            Store::Disk(DiskStore::create(dir, &name, config.disk_blocks, g.block_elems() * g.dtype.size())?)
        } else {
            Store::None
        };
        let host = if config.host_blocks > 0 {
            Store::Arena(arena_named(HOST_TIER_NAME, g, KvLayout::BlockMajor, config.host_blocks))
        } else {
            Store::None
        };
        let device = Store::Arena(arena_named(config.device_arena_name, g, config.layout, config.device_blocks));
        let tiers = [
            TierState::new(config.device_blocks, config.policy, device),
            TierState::new(config.host_blocks, config.policy, host),
            TierState::new(config.disk_blocks, config.policy, disk),
        ];
        let checker = check::Checker {
            instance: config.instance,
            sums: [0, 1, 2].map(|i| Arc::clone(&tiers[i].sums)),
            log: Arc::default(),
            meter: Arc::default(),
            block_bytes: (g.block_elems() * g.dtype.size()) as u64,
        };
        Ok(Self {
            instance: config.instance,
            geometry: g,
            tiers,
            index: PrefixIndex::with_capacity(
                g.block_size,
                config.device_blocks + config.host_blocks + config.disk_blocks,
            ),
            events: Vec::new(),
            stored: Vec::new(),
            next_seq: 0,
            now: 0,
            checker,
        })
    }

    /// This instance's id.
    pub fn instance(&self) -> InstanceId {
        self.instance
    }

    /// The KV geometry.
    pub fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }

    /// The device arena, for the model to read.
    pub fn arena(&self) -> &KvArena {
        self.arena_of(Tier::Device).expect("the device tier is an arena")
    }

    /// The device arena, for the model to write.
    pub fn arena_mut(&mut self) -> &mut KvArena {
        match &mut self.tiers[0].store {
            Store::Arena(a) => a,
            _ => unreachable!("the device tier is an arena"),
        }
    }

    /// The arena of a memory tier (device or host), if configured.
    pub fn arena_of(&self, tier: Tier) -> Option<&KvArena> {
        match &self.tiers[tier.index()].store {
            Store::Arena(a) => Some(a),
            _ => None,
        }
    }

    /// The prefix index (read-only).
    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    /// Blocks in a tier.
    pub fn num_blocks(&self, tier: Tier) -> usize {
        self.tiers[tier.index()].size()
    }

    /// Free device blocks.
    pub fn num_free(&self) -> usize {
        self.tiers[0].alloc.num_free()
    }

    /// Device blocks an allocation can get now: free plus every cached block no one holds.
    ///
    /// A cached block is evicted only once its children are (the policy sees leaves), but
    /// eviction cascades up a chain, so every unreferenced cached block is reclaimable: a
    /// reference on a block implies references on its ancestors (requests hold whole prefixes).
    ///
    /// `O(1)`: the pool keeps the count of such blocks as references, owners and swaps change
    /// (the engine calls this every step); [`check_invariants`](Self::check_invariants) checks
    /// it against a scan.
    pub fn available(&self) -> usize {
        self.tiers[0].alloc.num_free() + self.tiers[0].reclaimable
    }

    /// Cached blocks of `tier` that no request holds and no swap is moving, counted by a scan
    /// of the tier: what the maintained counter must equal.
    fn reclaimable_by_scan(&self, tier: Tier) -> usize {
        let t = &self.tiers[tier.index()];
        (0..t.size()).filter(|&i| self.is_reclaimable(Loc { tier, block: BlockId(i as u32) })).count()
    }

    /// Whether the slot at `loc` is cached, unreferenced and not being moved by a swap: what
    /// the per-tier `reclaimable` counter counts.
    #[inline]
    fn is_reclaimable(&self, loc: Loc) -> bool {
        let t = &self.tiers[loc.tier.index()];
        let owner = t.owner[loc.block.index()];
        owner < SWAP_OWNER && t.refs[loc.block.index()] == 0 && !self.index.nodes[owner as usize].in_flight
    }

    /// Brings the `reclaimable` counter of `loc`'s tier up to date after a change to the slot
    /// (its owner, references or its node's swap state) that found it reclaimable or not (`was`).
    #[inline]
    fn recount(&mut self, loc: Loc, was: bool) {
        let now = self.is_reclaimable(loc);
        let t = &mut self.tiers[loc.tier.index()];
        match (was, now) {
            (false, true) => t.reclaimable += 1,
            (true, false) => t.reclaimable -= 1,
            _ => {}
        }
    }

    /// Marks a node as being moved by a swap, or no longer.
    fn set_in_flight(&mut self, n: NodeId, in_flight: bool) {
        let loc = self.index.nodes[n.index()].loc;
        let was = self.is_reclaimable(loc);
        self.index.nodes[n.index()].in_flight = in_flight;
        self.recount(loc, was);
    }

    /// References held on a slot.
    pub fn ref_count(&self, loc: Loc) -> u32 {
        self.tiers[loc.tier.index()].refs.get(loc.block.index()).copied().unwrap_or(0)
    }

    /// The device allocator (fragmentation figures).
    pub fn allocator(&self) -> &SegmentAllocator {
        &self.tiers[0].alloc
    }

    /// Drains the events recorded since the last call.
    pub fn drain_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// The sequence number the next event will carry: a consumer that applied every event
    /// before it holds exactly [`index_entries`](Self::index_entries).
    pub fn next_event_seq(&self) -> u64 {
        self.next_seq
    }

    fn addr(&self, loc: Loc) -> KvAddr {
        KvAddr { instance: self.instance, loc }
    }

    fn dev(block: BlockId) -> Loc {
        Loc { tier: Tier::Device, block }
    }

    fn emit(&mut self, kind: KvEventKind) {
        // Bounded: events no one drains are dropped (the sequence numbers go on, so a consumer
        // sees the gap and resynchronises from `index_entries`), and memory stays flat.
        if self.events.len() >= MAX_BUFFERED_EVENTS {
            self.events.clear();
        }
        self.events.push(KvEvent { instance: self.instance, seq: self.next_seq, kind });
        self.next_seq += 1;
    }

    fn tick(&mut self, now: u64) {
        self.now = self.now.max(now);
    }

    // ---- memory block API ------------------------------------------------------------------

    /// MemServe `alloc_mem`: `n` blocks in `tier`, each with one reference held by the caller.
    /// Evicts cold cached blocks (to a slower tier, or out) when too few are free.
    pub fn alloc_mem(&mut self, n: usize, tier: Tier) -> Result<Vec<KvAddr>, PoolError> {
        let blocks = self.alloc_in(tier, n)?;
        Ok(blocks.into_iter().map(|block| self.addr(Loc { tier, block })).collect())
    }

    /// MemServe `free_mem`: drops one reference on each address.
    pub fn free_mem(&mut self, addrs: &[KvAddr]) -> Result<(), PoolError> {
        for a in addrs {
            self.own(*a)?;
            self.drop_ref(a.loc)?;
        }
        Ok(())
    }

    /// `n` device blocks, each with one reference held by the caller, as contiguous as the free
    /// space allows. The engine's allocation call.
    pub fn alloc_blocks(&mut self, n: usize) -> Result<Vec<BlockId>, PoolError> {
        self.alloc_in(Tier::Device, n)
    }

    /// Device blocks shaped like `pattern` (a peer's block ids): the same ids where free, else
    /// runs of the same lengths (FlowKV segment alignment). One reference each.
    pub fn alloc_aligned(&mut self, pattern: &[BlockId]) -> Result<Vec<BlockId>, PoolError> {
        self.make_room(Tier::Device, pattern.len())?;
        let t = &mut self.tiers[0];
        let blocks = t.alloc.allocate_aligned(pattern).ok_or(PoolError::OutOfBlocks {
            tier: Tier::Device,
            wanted: pattern.len(),
            available: t.alloc.num_free(),
        })?;
        for b in &blocks {
            t.refs[b.index()] = 1;
        }
        Ok(blocks)
    }

    /// Drops one reference on each device block; a block no one holds and the index does not
    /// cache goes back to the free list. The engine's free call.
    pub fn free_blocks(&mut self, blocks: &[BlockId]) -> Result<(), PoolError> {
        // Fast path: blocks nobody else holds and the index does not cache go back to the
        // allocator as runs, one call per run instead of one per block.
        let mut released = Vec::with_capacity(blocks.len());
        let mut result = Ok(());
        for &b in blocks {
            let t = &mut self.tiers[0];
            match (t.refs.get(b.index()).copied(), t.owner.get(b.index()).copied()) {
                (Some(1), Some(NO_OWNER)) => {
                    t.refs[b.index()] = 0;
                    released.push(b);
                }
                _ => {
                    if let Err(e) = self.drop_ref(Self::dev(b)) {
                        result = Err(e);
                        break;
                    }
                }
            }
        }
        self.tiers[0].alloc.free(&released)?;
        result
    }

    /// Adds one reference on each held device block (e.g. to keep a finished prompt's KV).
    pub fn retain_blocks(&mut self, blocks: &[BlockId]) -> Result<(), PoolError> {
        for &b in blocks {
            let loc = Self::dev(b);
            if self.ref_count(loc) == 0 && self.owner(loc) == NO_OWNER {
                return Err(PoolError::NotHeld(self.addr(loc)));
            }
            self.take_ref(loc)?;
        }
        Ok(())
    }

    fn own(&self, a: KvAddr) -> Result<(), PoolError> {
        if a.instance != self.instance {
            return Err(PoolError::WrongInstance(a));
        }
        if a.loc.block.index() >= self.tiers[a.loc.tier.index()].size() {
            return Err(AllocatorError::OutOfRange(a.loc.block).into());
        }
        Ok(())
    }

    fn owner(&self, loc: Loc) -> u32 {
        self.tiers[loc.tier.index()].owner[loc.block.index()]
    }

    fn alloc_in(&mut self, tier: Tier, n: usize) -> Result<Vec<BlockId>, PoolError> {
        self.make_room(tier, n)?;
        let t = &mut self.tiers[tier.index()];
        let blocks =
            t.alloc.allocate(n).ok_or(PoolError::OutOfBlocks { tier, wanted: n, available: t.alloc.num_free() })?;
        for b in &blocks {
            t.refs[b.index()] = 1;
        }
        Ok(blocks)
    }

    fn take_ref(&mut self, loc: Loc) -> Result<(), PoolError> {
        let t = &mut self.tiers[loc.tier.index()];
        let r = t.refs.get_mut(loc.block.index()).ok_or(AllocatorError::OutOfRange(loc.block))?;
        *r += 1;
        if *r == 1 {
            let owner = t.owner[loc.block.index()];
            if owner < SWAP_OWNER {
                if !self.index.nodes[owner as usize].in_flight {
                    t.reclaimable -= 1;
                }
                self.refresh(NodeId(owner));
            }
        }
        Ok(())
    }

    fn drop_ref(&mut self, loc: Loc) -> Result<(), PoolError> {
        let t = &mut self.tiers[loc.tier.index()];
        let r = t.refs.get_mut(loc.block.index()).ok_or(AllocatorError::OutOfRange(loc.block))?;
        if *r == 0 {
            return Err(PoolError::NotHeld(KvAddr { instance: self.instance, loc }));
        }
        *r -= 1;
        if *r == 0 {
            match t.owner[loc.block.index()] {
                NO_OWNER => t.alloc.free(&[loc.block])?,
                SWAP_OWNER => unreachable!("swap destinations carry no references"),
                node => {
                    if !self.index.nodes[node as usize].in_flight {
                        t.reclaimable += 1;
                    }
                    // The last holder's release is the block's latest use (a request frees its
                    // blocks in prompt order, so a chain's tail is its most recent block).
                    t.policy.released(NodeId(node), self.now);
                    self.refresh(NodeId(node))
                }
            }
        }
        Ok(())
    }

    // ---- eviction --------------------------------------------------------------------------

    fn eligible(&self, n: NodeId) -> bool {
        let node = &self.index.nodes[n.index()];
        !node.in_flight && node.same_tier_children == 0 && self.ref_count(node.loc) == 0
    }

    /// Pins or unpins a node in its tier's policy to match its eligibility.
    fn refresh(&mut self, n: NodeId) {
        let eligible = self.eligible(n);
        let policy = &mut self.tiers[self.index.nodes[n.index()].loc.tier.index()].policy;
        if eligible { policy.unpin(n) } else { policy.pin(n) }
    }

    fn next_lower(&self, tier: Tier) -> Option<Tier> {
        Tier::ALL[tier.index() + 1..].iter().copied().find(|t| self.tiers[t.index()].size() > 0)
    }

    /// Frees slots in `tier` until `n` are free, evicting cold cached blocks.
    fn make_room(&mut self, tier: Tier, n: usize) -> Result<(), PoolError> {
        let t = &self.tiers[tier.index()];
        if t.alloc.num_free() >= n {
            return Ok(());
        }
        let available = t.alloc.num_free() + t.reclaimable;
        if available < n {
            return Err(PoolError::OutOfBlocks { tier, wanted: n, available });
        }
        while self.tiers[tier.index()].alloc.num_free() < n {
            if !self.evict_one(tier)? {
                let t = &self.tiers[tier.index()];
                return Err(PoolError::OutOfBlocks { tier, wanted: n, available: t.alloc.num_free() });
            }
        }
        Ok(())
    }

    /// Evicts the coldest evictable block of `tier`: down one tier when there is room there,
    /// out of the cache otherwise. False when nothing is evictable.
    fn evict_one(&mut self, tier: Tier) -> Result<bool, PoolError> {
        let Some(victim) = self.tiers[tier.index()].policy.victim() else { return Ok(false) };
        if let Some(lower) = self.next_lower(tier)
            && self.make_room(lower, 1).is_ok()
        {
            let to = self.tiers[lower.index()].alloc.allocate(1).expect("room was made")[0];
            let from = self.index.nodes[victim.index()].loc;
            match self.copy(from, Loc { tier: lower, block: to }) {
                Ok(()) => self.retarget(victim, Loc { tier: lower, block: to }),
                // Damaged where it was: it leaves the cache instead of moving down.
                Err(PoolError::Corrupt(_)) => {
                    self.tiers[lower.index()].alloc.free(&[to])?;
                    for n in self.index.subtree_post_order(victim) {
                        self.remove_node(n);
                    }
                }
                Err(e) => return Err(e),
            }
        } else {
            for n in self.index.subtree_post_order(victim) {
                self.remove_node(n);
            }
        }
        Ok(true)
    }

    /// Points node `n` at `to` (a slot the caller allocated and filled), moving the references
    /// of its old slot there and freeing the old slot.
    fn retarget(&mut self, n: NodeId, to: Loc) {
        let from = self.index.nodes[n.index()].loc;
        let (was_from, was_to) = (self.is_reclaimable(from), self.is_reclaimable(to));
        let refs = std::mem::take(&mut self.tiers[from.tier.index()].refs[from.block.index()]);
        self.tiers[from.tier.index()].owner[from.block.index()] = NO_OWNER;
        self.tiers[from.tier.index()].alloc.free(&[from.block]).expect("a cached slot is allocated");
        self.tiers[from.tier.index()].policy.remove(n);
        self.tiers[to.tier.index()].refs[to.block.index()] += refs;
        self.tiers[to.tier.index()].owner[to.block.index()] = n.0;
        self.index.nodes[n.index()].loc = to;
        self.recount(from, was_from);
        self.recount(to, was_to);
        let same = self.index.children(n).filter(|c| self.index.nodes[c.index()].loc.tier == to.tier).count();
        self.index.nodes[n.index()].same_tier_children = same as u32;
        let parent = self.index.nodes[n.index()].parent;
        if parent != NO_OWNER {
            let p = &mut self.index.nodes[parent as usize];
            if p.loc.tier == from.tier {
                p.same_tier_children -= 1;
            }
            if p.loc.tier == to.tier {
                p.same_tier_children += 1;
            }
            self.refresh(NodeId(parent));
        }
        self.tiers[to.tier.index()].policy.insert(n, self.now);
        self.refresh(n);
        let hash = self.index.nodes[n.index()].hash;
        self.emit(KvEventKind::Moved { hash, tier: to.tier });
    }

    /// Removes a leaf from the index; its slot goes to the free list unless requests hold it.
    fn remove_node(&mut self, n: NodeId) {
        let node = &self.index.nodes[n.index()];
        let (loc, parent, hash) = (node.loc, node.parent, node.hash);
        let was = self.is_reclaimable(loc);
        let t = &mut self.tiers[loc.tier.index()];
        t.reclaimable -= usize::from(was);
        t.policy.remove(n);
        t.owner[loc.block.index()] = NO_OWNER;
        if t.refs[loc.block.index()] == 0 {
            t.alloc.free(&[loc.block]).expect("a cached slot is allocated");
        }
        self.index.remove(n);
        if parent != NO_OWNER {
            let p = &mut self.index.nodes[parent as usize];
            if p.loc.tier == loc.tier {
                p.same_tier_children -= 1;
            }
            self.refresh(NodeId(parent));
        }
        self.emit(KvEventKind::Removed { hash });
    }

    /// Copies one block between slots of different tiers, checking it against the checksum its
    /// host or disk slot carries and giving a host or disk destination the block's sum
    /// (`Corrupt`, counted, when the check fails: the destination's bytes are then garbage).
    fn copy(&mut self, from: Loc, to: Loc) -> Result<(), PoolError> {
        let (a, b) = (from.tier.index(), to.tier.index());
        assert_ne!(a, b, "copies go between tiers");
        let (src, dst) = if a < b {
            let (lo, hi) = self.tiers.split_at_mut(b);
            (&lo[a], &mut hi[0])
        } else {
            let (lo, hi) = self.tiers.split_at_mut(a);
            (&hi[0], &mut lo[b])
        };
        let copied = match (&src.store, &mut dst.store) {
            (Store::Arena(s), Store::Arena(d)) => {
                d.copy_blocks_from(s, &[from.block], &[to.block]);
                check::Copied::Into(d)
            }
            (Store::Arena(s), Store::Disk(d)) => {
                let ranges = s.descriptor().byte_ranges(&[from.block]);
                d.write_block(to.block, s.as_bytes(), &ranges)?;
                check::Copied::From(s)
            }
            (Store::Disk(s), Store::Arena(d)) => {
                let ranges = d.descriptor().byte_ranges(&[to.block]);
                s.read_block(from.block, d.as_bytes_mut(), &ranges)?;
                check::Copied::Into(d)
            }
            _ => unreachable!("tiers with slots have storage"),
        };
        self.checker.after_copy(from, to, copied, false)
    }

    // ---- index API -------------------------------------------------------------------------

    /// MemServe `insert`: caches the full blocks of a prompt. `blocks` are the device blocks
    /// holding `tokens` (at least one reference each, held by the caller, who keeps it: free
    /// them as usual, and the index keeps the blocks it adopted). A block whose prefix is cached
    /// already keeps the cached copy (or moves the cached entry onto the caller's device block
    /// when the cached copy sits in a slower tier). Returns the blocks newly added.
    pub fn insert(&mut self, tokens: &[u32], blocks: &[BlockId], now: u64) -> Result<usize, PoolError> {
        self.tick(now);
        let bs = self.geometry.block_size;
        let full = (tokens.len() / bs).min(blocks.len());
        for &b in &blocks[..full] {
            let loc = Self::dev(b);
            self.own(self.addr(loc))?;
            if self.ref_count(loc) == 0 {
                return Err(PoolError::NotHeld(self.addr(loc)));
            }
        }
        let mut parent: Option<NodeId> = None;
        let mut parent_hash: Option<BlockHash> = None;
        // Whether `parent` was added by this call (then the caller holds it: it is pinned).
        let mut parent_added = false;
        let mut hashes = HashStream::to_miss(&tokens[..full * bs], bs);
        let mut stored = std::mem::take(&mut self.stored);
        for (i, &b) in blocks[..full].iter().enumerate() {
            let hash = hashes.next(&self.index).expect("one hash per full block");
            self.index.prefetch_reuse(REUSE_AHEAD);
            let toks = &tokens[i * bs..(i + 1) * bs];
            let (n, added) = match self.index.lookup(parent, hash, toks) {
                Lookup::Hit(n) => {
                    let node = &self.index.nodes[n.index()];
                    if node.loc.tier != Tier::Device {
                        let promotable = !node.in_flight
                            && self.ref_count(node.loc) == 0
                            && self.owner(Self::dev(b)) == NO_OWNER
                            && parent.is_none_or(|p| self.index.nodes[p.index()].loc.tier == Tier::Device);
                        if !promotable {
                            break;
                        }
                        self.retarget(n, Self::dev(b));
                    }
                    self.tiers[0].policy.touch(n, now);
                    (n, false)
                }
                // The hash collides with another block's.
                Lookup::Collision => break,
                Lookup::Miss(vacant) => {
                    if self.owner(Self::dev(b)) != NO_OWNER {
                        // The block is cached under another prefix.
                        break;
                    }
                    let n = self.index.add_at(vacant, parent, hash, toks, Self::dev(b));
                    // The caller holds `b` (checked above): the new node is neither reclaimable
                    // nor evictable, so it enters its policy pinned.
                    debug_assert!(self.ref_count(Self::dev(b)) > 0);
                    self.tiers[0].owner[b.index()] = n.0;
                    self.tiers[0].policy.insert_pinned(n, now);
                    if let Some(p) = parent {
                        self.index.nodes[p.index()].same_tier_children += 1;
                        if !parent_added {
                            self.refresh(p);
                        }
                    }
                    stored.push((i, hash, parent_hash));
                    (n, true)
                }
            };
            parent = Some(n);
            parent_hash = Some(hash);
            parent_added = added;
        }
        // The `Stored` events, after the walk: each clones the shared token buffer's `Arc`,
        // and an atomic increment inside the walk would wait for the walk's pending stores
        // (cache misses) each time. Only hits (before any miss) emit events inside the walk.
        let added = stored.len();
        if added > 0 {
            // The tokens of this call's events, copied once and shared by all of them.
            let shared: Arc<[u32]> = Arc::from(&tokens[..full * bs]);
            self.events.reserve(added);
            for &(i, hash, parent) in &stored {
                let tokens = BlockTokens::new(Arc::clone(&shared), i * bs..(i + 1) * bs);
                self.emit(KvEventKind::Stored { hash, parent, tokens, tier: Tier::Device });
            }
        }
        stored.clear();
        self.stored = stored;
        Ok(added)
    }

    /// MemServe `match`: the longest cached prefix of `tokens` in whole blocks, on any tier,
    /// taking one reference on each block returned (release them with [`free_mem`](Self::free_mem),
    /// or bring them to the device with [`swap_in`](Self::swap_in)). Held blocks are never evicted.
    pub fn match_prefix(&mut self, tokens: &[u32], now: u64) -> PrefixMatch {
        self.tick(now);
        let path = self.walk(tokens);
        let mut addrs = Vec::with_capacity(path.len());
        for n in path {
            let loc = self.index.nodes[n.index()].loc;
            self.take_ref(loc).expect("cached slots are in range");
            self.tiers[loc.tier.index()].policy.touch(n, now);
            addrs.push(self.addr(loc));
        }
        let tokens = addrs.len() * self.geometry.block_size;
        PrefixMatch { addrs, tokens }
    }

    /// Cached blocks of the longest cached prefix of `tokens`, per tier, without taking
    /// references or recording a use (for scheduling decisions).
    pub fn peek_prefix(&self, tokens: &[u32]) -> [usize; 3] {
        let mut out = [0; 3];
        for n in self.walk(tokens) {
            out[self.index.nodes[n.index()].loc.tier.index()] += 1;
        }
        out
    }

    /// What taking the cached prefix of `tokens` would cost the device tier, without taking
    /// references or recording a use (the engine's admission planning): the device blocks
    /// of the longest cached prefix, up to the first block on a slower tier, and how many of them
    /// are held already (by a request or a lease). Taking an unheld block removes it from
    /// [`available`](Self::available); taking a held one costs nothing.
    pub fn peek_device_prefix(&self, tokens: &[u32]) -> DevicePrefix {
        let mut out = DevicePrefix::default();
        for n in self.walk(tokens) {
            let loc = self.index.nodes[n.index()].loc;
            if loc.tier != Tier::Device {
                break;
            }
            out.blocks += 1;
            if self.ref_count(loc) > 0 {
                out.held += 1;
            }
        }
        out
    }

    fn walk(&self, tokens: &[u32]) -> Vec<NodeId> {
        let bs = self.geometry.block_size;
        let mut path = Vec::new();
        let mut parent = None;
        let mut hashes = HashStream::new(tokens, bs);
        for toks in tokens.chunks_exact(bs) {
            let hash = hashes.next(&self.index).expect("one hash per full block");
            let Some(n) = self.index.find(parent, hash, toks) else { break };
            path.push(n);
            parent = Some(n);
        }
        path
    }

    /// The engine's prefix call: matches `tokens`, brings the matched blocks onto the device
    /// tier, and returns the device blocks (one reference each, held by the caller) with the
    /// tokens they cover. Blocks that cannot be brought in for lack of device room are left out
    /// (the match is shortened).
    ///
    /// A block that fails its checksum on the way back is dropped with everything cached below
    /// it, and the match is made again: the prefix comes back shorter, never damaged.
    pub fn acquire_prefix(&mut self, tokens: &[u32], now: u64) -> Result<(Vec<BlockId>, usize), PoolError> {
        'matched: loop {
            let job = self.begin_acquire_prefix(tokens, now)?;
            for (from, to) in job.copies() {
                if let Err(e) = self.copy(from, Self::dev(to)) {
                    let corrupt = matches!(e, PoolError::Corrupt(_)).then(|| self.node_at(from)).flatten();
                    self.abort_swap_in(job)?;
                    match corrupt {
                        Some(node) => {
                            self.drop_corrupt(node);
                            continue 'matched;
                        }
                        None => return Err(e),
                    }
                }
            }
            let blocks = self.finish_swap_in(job)?;
            let tokens = blocks.len() * self.geometry.block_size;
            return Ok((blocks, tokens));
        }
    }

    /// [`acquire_prefix`](Self::acquire_prefix) whose copies from the slower tiers another
    /// thread makes: matches `tokens` and begins the swap-in of the matched blocks (see
    /// [`begin_swap_in`](Self::begin_swap_in)).
    pub fn begin_acquire_prefix(&mut self, tokens: &[u32], now: u64) -> Result<SwapIn, PoolError> {
        let mut m = self.match_prefix(tokens, now);
        let on_device = m.on_device();
        let lower = m.addrs.len() - on_device;
        if lower > 0 && self.make_room(Tier::Device, lower).is_err() {
            let tail = m.addrs.split_off(on_device);
            self.free_mem(&tail)?;
        }
        self.begin_swap_in(&m.addrs)
    }

    /// MemServe `delete`: forgets the prompt's cached blocks: everything cached below its
    /// longest cached prefix, and the blocks of that prefix no other cached prompt goes through.
    /// Blocks that requests still hold stay theirs until released. Returns blocks removed.
    pub fn delete(&mut self, tokens: &[u32]) -> usize {
        let path = self.walk(tokens);
        let Some(&deepest) = path.last() else { return 0 };
        let mut removed = 0;
        for n in self.index.subtree_post_order(deepest) {
            self.remove_node(n);
            removed += 1;
        }
        for &n in path.iter().rev().skip(1) {
            if self.index.has_children(n) {
                break;
            }
            self.remove_node(n);
            removed += 1;
        }
        removed
    }

    /// Every cached block with its parent and tier, ordered by hash: what an index that applies
    /// this pool's events from its first holds (a follower's snapshot, with
    /// [`next_event_seq`](Self::next_event_seq)).
    pub fn index_entries(&self) -> std::collections::BTreeMap<BlockHash, IndexEntry> {
        self.index
            .iter()
            .map(|n| {
                let node = &self.index.nodes[n.index()];
                let parent = (node.parent != NO_OWNER).then(|| self.index.nodes[node.parent as usize].hash);
                (node.hash, IndexEntry { parent, tier: node.loc.tier })
            })
            .collect()
    }
}
