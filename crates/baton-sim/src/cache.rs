//! An instance's prefix cache of block hashes: device and host tiers, LRU each, emitting
//! `baton-kv` [`KvEventKind`]s for every change (stored, moved to host, removed) so the
//! scheduler's global prompt trees are fed exactly as a MemPool would feed them.
//!
//! Eviction follows the pool's (`baton_kv::MemPool`): a tier gives up its least recently used
//! *leaf*, a block with no child in the tier, so the coldest cached prompt leaves from its tail
//! and whole before a warmer prompt loses a block, and what stays of a prompt is always a prefix
//! that a lookup can use.

use std::collections::{BTreeMap, HashMap};

use baton_kv::{BlockHash, KvEventKind, Tier};

/// One tier: its blocks' last uses, and its leaves ordered by last use.
#[derive(Debug, Default)]
struct Lru {
    cap: usize,
    stamp_of: HashMap<BlockHash, u64>,
    /// Blocks of this tier with no child in it, by last use: the eviction candidates.
    leaves: BTreeMap<u64, BlockHash>,
    /// Children in this tier, per block of this tier that has some.
    children: HashMap<BlockHash, u32>,
}

impl Lru {
    fn new(cap: usize) -> Self {
        Self { cap, ..Self::default() }
    }

    fn contains(&self, h: &BlockHash) -> bool {
        self.stamp_of.contains_key(h)
    }

    /// Records a use of `h` (adding it if new) at `stamp`; `parent` is its parent block, and
    /// `kids` how many of its children this tier holds already.
    fn touch(&mut self, h: BlockHash, parent: Option<BlockHash>, kids: u32, stamp: u64) {
        match self.stamp_of.insert(h, stamp) {
            Some(old) => {
                if self.leaves.remove(&old).is_some() {
                    self.leaves.insert(stamp, h);
                }
            }
            None => {
                if kids > 0 {
                    self.children.insert(h, kids);
                } else {
                    self.leaves.insert(stamp, h);
                }
                if let Some(p) = parent.filter(|p| self.contains(p)) {
                    let n = self.children.entry(p).or_insert(0);
                    *n += 1;
                    if *n == 1 {
                        self.leaves.remove(&self.stamp_of[&p]);
                    }
                }
            }
        }
    }

    /// Takes `h` out of the tier; its parent may become a leaf (at its own last use).
    fn remove(&mut self, h: &BlockHash, parent: Option<BlockHash>) -> bool {
        let Some(stamp) = self.stamp_of.remove(h) else { return false };
        self.leaves.remove(&stamp);
        self.children.remove(h);
        if let Some(p) = parent.filter(|p| self.contains(p))
            && let Some(n) = self.children.get_mut(&p)
        {
            *n -= 1;
            if *n == 0 {
                self.children.remove(&p);
                self.leaves.insert(self.stamp_of[&p], p);
            }
        }
        true
    }

    /// The least recently used leaf.
    fn victim(&self) -> Option<BlockHash> {
        self.leaves.first_key_value().map(|(_, &h)| h)
    }

    fn len(&self) -> usize {
        self.stamp_of.len()
    }
}

/// Where the leading blocks of a prompt are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Hit {
    /// Leading blocks cached (either tier).
    pub(crate) blocks: usize,
    /// Of those, how many are on the host tier (must be loaded first).
    pub(crate) on_host: usize,
}

/// Two-tier LRU prefix cache.
#[derive(Debug)]
pub(crate) struct BlockCache {
    device: Lru,
    host: Lru,
    clock: u64,
    events: Vec<KvEventKind>,
    /// Every block ever cached: its parent and its children (hashes name whole prefixes, so
    /// these never change).
    parent_of: HashMap<BlockHash, BlockHash>,
    children_of: HashMap<BlockHash, Vec<BlockHash>>,
}

impl BlockCache {
    pub(crate) fn new(device_blocks: usize, host_blocks: usize) -> Self {
        Self {
            device: Lru::new(device_blocks),
            host: Lru::new(host_blocks),
            clock: 0,
            events: Vec::new(),
            parent_of: HashMap::new(),
            children_of: HashMap::new(),
        }
    }

    /// Leading blocks of `hashes` held.
    pub(crate) fn lookup(&self, hashes: &[BlockHash]) -> Hit {
        let mut hit = Hit::default();
        for h in hashes {
            if self.device.contains(h) {
                hit.blocks += 1;
            } else if self.host.contains(h) {
                hit.blocks += 1;
                hit.on_host += 1;
            } else {
                break;
            }
        }
        hit
    }

    /// Children of `h` that `tier` holds.
    fn kids_in(&self, h: BlockHash, tier: &Lru) -> u32 {
        self.children_of.get(&h).map_or(0, |c| c.iter().filter(|k| tier.contains(k)).count() as u32)
    }

    /// Marks blocks used (and inserts missing ones), in prompt order, on the device tier.
    pub(crate) fn insert(&mut self, hashes: &[BlockHash]) {
        let mut parent = None;
        for &h in hashes {
            if let Some(p) = parent
                && !self.parent_of.contains_key(&h)
            {
                self.parent_of.insert(h, p);
                self.children_of.entry(p).or_default().push(h);
            }
            self.clock += 1;
            if self.device.contains(&h) {
                self.device.touch(h, parent, 0, self.clock);
            } else if self.device.cap > 0 {
                if self.host.remove(&h, parent) {
                    self.events.push(KvEventKind::Moved { hash: h, tier: Tier::Device });
                } else {
                    self.events.push(KvEventKind::Stored {
                        hash: h,
                        parent,
                        tokens: Default::default(),
                        tier: Tier::Device,
                    });
                }
                let kids = self.kids_in(h, &self.device);
                self.device.touch(h, parent, kids, self.clock);
                self.evict();
            }
            parent = Some(h);
        }
    }

    fn evict(&mut self) {
        while self.device.len() > self.device.cap {
            let Some(v) = self.device.victim() else { break };
            let parent = self.parent_of.get(&v).copied();
            self.device.remove(&v, parent);
            if self.host.cap > 0 {
                self.clock += 1;
                let kids = self.kids_in(v, &self.host);
                self.host.touch(v, parent, kids, self.clock);
                self.events.push(KvEventKind::Moved { hash: v, tier: Tier::Host });
            } else {
                self.events.push(KvEventKind::Removed { hash: v });
            }
        }
        while self.host.len() > self.host.cap {
            let Some(v) = self.host.victim() else { break };
            self.host.remove(&v, self.parent_of.get(&v).copied());
            self.events.push(KvEventKind::Removed { hash: v });
        }
    }

    /// Blocks held on (device, host).
    pub(crate) fn usage(&self) -> (usize, usize) {
        (self.device.len(), self.host.len())
    }

    /// Events since the last call.
    pub(crate) fn drain_events(&mut self) -> std::vec::Drain<'_, KvEventKind> {
        self.events.drain(..)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hs(r: std::ops::Range<u64>) -> Vec<BlockHash> {
        r.map(BlockHash).collect()
    }

    #[test]
    fn lru_spills_leaves_to_host_then_drops_and_reports_events() {
        let mut c = BlockCache::new(2, 1);
        c.insert(&hs(0..2));
        assert_eq!(c.lookup(&hs(0..3)), Hit { blocks: 2, on_host: 0 });
        c.insert(&hs(5..6)); // evicts block 1, the oldest leaf, to host
        assert_eq!(c.lookup(&hs(0..2)), Hit { blocks: 2, on_host: 1 });
        c.insert(&hs(6..7)); // 0 is now a leaf and the oldest: to host, where 1 falls off
        assert_eq!(c.lookup(&hs(0..2)), Hit { blocks: 1, on_host: 1 });
        let ev: Vec<_> = c.drain_events().collect();
        assert_eq!(ev.len(), 4 + 2 + 1);
        assert!(matches!(ev.last(), Some(KvEventKind::Removed { hash: BlockHash(1) })));
        // Bringing a host block back is a move, not a store.
        c.insert(&hs(0..1));
        assert!(matches!(c.drain_events().next(), Some(KvEventKind::Moved { hash: BlockHash(0), tier: Tier::Device })));
        assert_eq!(c.usage(), (2, 1), "5, the oldest leaf, made room");
    }

    #[test]
    fn a_full_cache_drops_the_coldest_prompt_whole_before_trimming_others() {
        let mut c = BlockCache::new(12, 0);
        let (a, b, cc, d) = (hs(0..4), hs(10..14), hs(20..24), hs(30..34));
        for x in [&a, &b, &cc, &d] {
            c.insert(x);
        }
        let held = [&a, &b, &cc, &d].map(|x| c.lookup(x).blocks);
        assert_eq!(held, [0, 4, 4, 4]);
        // Two blocks of room: the coldest prompt loses its tail and keeps a usable head.
        c.insert(&b);
        c.insert(&hs(40..42));
        assert_eq!([&b, &cc, &d].map(|x| c.lookup(x).blocks), [4, 2, 4]);
    }
}
