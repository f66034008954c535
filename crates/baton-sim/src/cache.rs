//! An instance's prefix cache of block hashes: device and host tiers, LRU each, emitting
//! `baton-kv` [`KvEventKind`]s for every change (stored, moved to host, removed) so the
//! scheduler's global prompt trees are fed exactly as a MemPool would feed them.

use std::collections::{BTreeMap, HashMap};

use baton_kv::{BlockHash, KvEventKind, Tier};

#[derive(Debug, Default)]
struct Lru {
    cap: usize,
    stamp_of: HashMap<BlockHash, u64>,
    by_stamp: BTreeMap<u64, BlockHash>,
}

impl Lru {
    fn new(cap: usize) -> Self {
        Self { cap, ..Self::default() }
    }

    fn contains(&self, h: &BlockHash) -> bool {
        self.stamp_of.contains_key(h)
    }

    fn touch(&mut self, h: BlockHash, stamp: u64) {
        if let Some(old) = self.stamp_of.insert(h, stamp) {
            self.by_stamp.remove(&old);
        }
        self.by_stamp.insert(stamp, h);
    }

    fn remove(&mut self, h: &BlockHash) -> bool {
        match self.stamp_of.remove(h) {
            Some(s) => {
                self.by_stamp.remove(&s);
                true
            }
            None => false,
        }
    }

    fn pop_lru(&mut self) -> Option<BlockHash> {
        let (_, h) = self.by_stamp.pop_first()?;
        self.stamp_of.remove(&h);
        Some(h)
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
}

impl BlockCache {
    pub(crate) fn new(device_blocks: usize, host_blocks: usize) -> Self {
        Self { device: Lru::new(device_blocks), host: Lru::new(host_blocks), clock: 0, events: Vec::new() }
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

    /// Marks blocks used (and inserts missing ones), in prompt order, on the device tier.
    pub(crate) fn insert(&mut self, hashes: &[BlockHash]) {
        let mut parent = None;
        for &h in hashes {
            self.clock += 1;
            if self.device.contains(&h) {
                self.device.touch(h, self.clock);
            } else if self.device.cap > 0 {
                if self.host.remove(&h) {
                    self.events.push(KvEventKind::Moved { hash: h, tier: Tier::Device });
                } else {
                    self.events.push(KvEventKind::Stored {
                        hash: h,
                        parent,
                        tokens: Default::default(),
                        tier: Tier::Device,
                    });
                }
                self.device.touch(h, self.clock);
                self.evict();
            }
            parent = Some(h);
        }
    }

    fn evict(&mut self) {
        while self.device.len() > self.device.cap {
            let Some(v) = self.device.pop_lru() else { break };
            if self.host.cap > 0 {
                self.clock += 1;
                self.host.touch(v, self.clock);
                self.events.push(KvEventKind::Moved { hash: v, tier: Tier::Host });
            } else {
                self.events.push(KvEventKind::Removed { hash: v });
            }
        }
        while self.host.len() > self.host.cap {
            let Some(v) = self.host.pop_lru() else { break };
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
    fn lru_spills_to_host_then_drops_and_reports_events() {
        let mut c = BlockCache::new(2, 1);
        c.insert(&hs(0..2));
        assert_eq!(c.lookup(&hs(0..3)), Hit { blocks: 2, on_host: 0 });
        c.insert(&hs(5..6)); // evicts block 0 to host
        assert_eq!(c.lookup(&hs(0..2)), Hit { blocks: 2, on_host: 1 });
        c.insert(&hs(6..7)); // evicts 1 to host, 0 falls off
        assert_eq!(c.lookup(&hs(0..2)), Hit::default());
        let ev: Vec<_> = c.drain_events().collect();
        assert_eq!(ev.len(), 4 + 2 + 1);
        assert!(matches!(ev.last(), Some(KvEventKind::Removed { hash: BlockHash(0) })));
        // Bringing a host block back is a move, not a store.
        c.insert(&hs(1..2));
        assert!(matches!(c.drain_events().next(), Some(KvEventKind::Moved { hash: BlockHash(1), tier: Tier::Device })));
        assert_eq!(c.usage(), (2, 1));
    }
}
