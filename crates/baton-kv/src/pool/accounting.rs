//! Accounting: the owners of every slot of a tier counted ([`TierOwners`], [`MemPool::usage`]),
//! and the check that each slot has exactly one owner and that the index, the eviction
//! policies and the counters agree ([`MemPool::check_invariants`]).

use super::*;

/// Blocks of each kind of owner in one tier: they add up to the tier's size.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierOwners {
    /// On the free list.
    pub free: usize,
    /// Held by requests only.
    pub held: usize,
    /// In the index (possibly also held by requests).
    pub cached: usize,
    /// Cached and evictable now (no reference, not moving, no child in the tier).
    pub evictable: usize,
    /// Cached and held by no request: reclaimable, though only leaf by leaf (a chain of them
    /// counts here whole and in `evictable` by its last block).
    pub unheld_cached: usize,
    /// Destinations of unfinished swaps.
    pub in_flight: usize,
}

impl MemPool {
    /// Blocks of each owner kind in a tier.
    pub fn usage(&self, tier: Tier) -> TierOwners {
        let t = &self.tiers[tier.index()];
        let mut u = TierOwners { free: t.alloc.num_free(), evictable: t.policy.evictable(), ..TierOwners::default() };
        for (i, &o) in t.owner.iter().enumerate() {
            match o {
                NO_OWNER if t.refs[i] > 0 => u.held += 1,
                NO_OWNER => {}
                SWAP_OWNER => u.in_flight += 1,
                _ => {
                    u.cached += 1;
                    u.unheld_cached += usize::from(t.refs[i] == 0);
                }
            }
        }
        u
    }

    /// Checks that every slot of every tier has exactly one owner and that the index, the
    /// eviction policies and the counters agree. `O(blocks · log blocks)`: for tests and
    /// debugging.
    pub fn check_invariants(&self) -> Result<(), String> {
        for tier in Tier::ALL {
            let t = &self.tiers[tier.index()];
            let mut free = 0;
            let mut evictable = 0;
            for i in 0..t.size() {
                let b = BlockId(i as u32);
                let is_free = t.alloc.is_free(b);
                let (o, r) = (t.owner[i], t.refs[i]);
                let owners = usize::from(is_free) + usize::from(o != NO_OWNER) + usize::from(o == NO_OWNER && r > 0);
                if owners != 1 {
                    return Err(format!("{tier} {b}: {owners} owners (free {is_free}, owner {o}, refs {r})"));
                }
                if (is_free || o == SWAP_OWNER) && r != 0 {
                    return Err(format!("{tier} {b}: free or in flight with {r} references"));
                }
                free += usize::from(is_free);
                if o < SWAP_OWNER {
                    let n = NodeId(o);
                    let node = self.index.nodes.get(n.index()).ok_or(format!("{tier} {b}: unknown node"))?;
                    if !node.live || node.loc != (Loc { tier, block: b }) {
                        return Err(format!("{tier} {b}: node {o} does not point here"));
                    }
                    if !t.policy.contains(n) {
                        return Err(format!("{tier} {b}: node {o} untracked by the policy"));
                    }
                    evictable += usize::from(self.eligible(n));
                }
            }
            if free != t.alloc.num_free() {
                return Err(format!("{tier}: {free} free slots, allocator says {}", t.alloc.num_free()));
            }
            if evictable != t.policy.evictable() {
                return Err(format!("{tier}: {evictable} evictable, policy says {}", t.policy.evictable()));
            }
            let reclaimable = self.reclaimable_by_scan(tier);
            if reclaimable != t.reclaimable {
                return Err(format!("{tier}: {reclaimable} reclaimable by a scan, counted {}", t.reclaimable));
            }
        }
        let mut live = 0;
        for n in self.index.iter() {
            live += 1;
            let node = &self.index.nodes[n.index()];
            if self.owner(node.loc) != n.0 {
                return Err(format!("node {} at {:?} is not its slot's owner", n.0, node.loc));
            }
            if self.index.get(node.hash) != Some(n) {
                return Err(format!("node {} is not found by its hash", n.0));
            }
            let same = self.index.children(n).filter(|c| self.index.nodes[c.index()].loc.tier == node.loc.tier).count();
            if same != node.same_tier_children as usize {
                return Err(format!("node {}: {} same-tier children, counted {}", n.0, same, node.same_tier_children));
            }
            if node.parent != NO_OWNER {
                let p = &self.index.nodes[node.parent as usize];
                if !p.live || p.loc.tier > node.loc.tier {
                    return Err(format!("node {}: parent is dead or in a slower tier", n.0));
                }
                let parent_hash = Some(p.hash);
                if block_hash(parent_hash, self.index.tokens(n)) != node.hash {
                    return Err(format!("node {}: hash does not chain from its parent", n.0));
                }
            }
        }
        if live != self.index.len() {
            return Err(format!("{live} live nodes, {} hashed", self.index.len()));
        }
        Ok(())
    }
}
