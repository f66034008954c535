//! Eviction policies: LRU and LFU behind one interface, with pinning.
//!
//! A policy orders the cached entries of one tier and names the coldest one that is not pinned.
//! It never reads a clock: [`Lru`] and [`Lfu`] order uses by a counter of their own, in the order
//! of the calls (the `now` the caller passes, a step number, is part of the interface for a
//! policy that wants it; these two do not).
//! The pool pins an entry while it must not leave its tier: a request holds it, a swap is moving
//! it, or a child in the same tier depends on it.

use std::collections::BTreeSet;

/// Index of an entry of the prefix index (a node), dense from zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

impl NodeId {
    /// The node's index.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// Which eviction policy a tier uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PolicyKind {
    /// Least recently used first.
    #[default]
    Lru,
    /// Least frequently used first, least recently used among equals.
    Lfu,
}

impl PolicyKind {
    /// A fresh, empty policy of this kind.
    pub fn build(self) -> Box<dyn EvictionPolicy> {
        match self {
            PolicyKind::Lru => Box::new(Lru::default()),
            PolicyKind::Lfu => Box::new(Lfu::default()),
        }
    }
}

/// Orders the entries of one tier for eviction.
pub trait EvictionPolicy: std::fmt::Debug + Send {
    /// Starts tracking `node`, unpinned, as used at `now`.
    fn insert(&mut self, node: NodeId, now: u64);
    /// Starts tracking `node`, pinned, as used at `now`: [`insert`](Self::insert) then
    /// [`pin`](Self::pin) in one call (a block cached while a request holds it).
    fn insert_pinned(&mut self, node: NodeId, now: u64) {
        self.insert(node, now);
        self.pin(node);
    }
    /// Records a use of a tracked `node` at `now`.
    fn touch(&mut self, node: NodeId, now: u64);
    /// Records that the last request holding `node` let go of it at `now`: for recency a use
    /// (the default, [`touch`](Self::touch)); LFU does not count the request a second time, as
    /// it counted it when the request took the block.
    fn released(&mut self, node: NodeId, now: u64) {
        self.touch(node, now);
    }
    /// Stops tracking `node`.
    fn remove(&mut self, node: NodeId);
    /// Keeps a tracked `node` from being named a victim until [`unpin`](Self::unpin).
    fn pin(&mut self, node: NodeId);
    /// Makes a pinned `node` a candidate again, in its place by its last use (unpinning is not
    /// a use: a caller that let go of a block it used touches it first).
    fn unpin(&mut self, node: NodeId);
    /// The coldest unpinned node, if any.
    fn victim(&self) -> Option<NodeId>;
    /// Tracked nodes that are not pinned.
    fn evictable(&self) -> usize;
    /// Whether `node` is tracked.
    fn contains(&self, node: NodeId) -> bool;
}

/// Least recently used, over unpinned nodes, in the order of their last *use*.
///
/// A use is [`insert`](EvictionPolicy::insert), [`insert_pinned`](EvictionPolicy::insert_pinned),
/// [`touch`](EvictionPolicy::touch) or [`released`](EvictionPolicy::released), numbered by a
/// counter of the policy's own (so two uses in one call of the pool keep their order); `now` is
/// not read. [`unpin`](EvictionPolicy::unpin) is not a use: a node that becomes a candidate again
/// takes its place by its last use. This matters for prefix chains: a parent is used with or
/// before its child, so when the pool evicts a chain's leaf and the parent becomes the new leaf,
/// the parent is at least as cold and the same chain goes on leaving, tail first, before a warmer
/// chain loses a block. (Had unpinning counted as a use, every eviction would send the chain to
/// the back, and a full pool would trim the tail of every cached prompt in turn instead of
/// dropping the coldest one.)
pub type Lru = Ranked<false>;

/// Least frequently used, ties broken by least recent use (as [`Lru`] orders uses). A request
/// counts once: when it takes a block ([`touch`](EvictionPolicy::touch)), not again when it lets
/// go ([`released`](EvictionPolicy::released), a use for recency only).
pub type Lfu = Ranked<true>;

/// [`Lru`] and [`Lfu`]: unpinned nodes in an ordered set over `(uses, last use, node)`, where
/// `uses` stays 0 unless `FREQUENCY`. `O(log n)` per call.
#[derive(Debug, Default)]
pub struct Ranked<const FREQUENCY: bool> {
    entries: Vec<Option<Rank>>,
    order: BTreeSet<(u64, u64, u32)>,
    clock: u64,
}

#[derive(Debug, Clone, Copy)]
struct Rank {
    uses: u64,
    last: u64,
    pinned: bool,
}

impl<const FREQUENCY: bool> Ranked<FREQUENCY> {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn track(&mut self, node: NodeId, pinned: bool) {
        self.remove(node);
        let rank = Rank { uses: u64::from(FREQUENCY), last: self.tick(), pinned };
        if node.index() >= self.entries.len() {
            self.entries.resize(node.index() + 1, None);
        }
        self.entries[node.index()] = Some(rank);
        if !pinned {
            self.order.insert((rank.uses, rank.last, node.0));
        }
    }

    /// Records a use of a tracked node, counting it toward its frequency if `counts`.
    fn used(&mut self, node: NodeId, counts: bool) {
        let last = self.tick();
        let Some(Some(r)) = self.entries.get_mut(node.index()) else { return };
        let old = (r.uses, r.last, node.0);
        r.uses += u64::from(FREQUENCY && counts);
        r.last = last;
        if !r.pinned {
            self.order.remove(&old);
            self.order.insert((r.uses, r.last, node.0));
        }
    }
}

impl<const FREQUENCY: bool> EvictionPolicy for Ranked<FREQUENCY> {
    fn insert(&mut self, node: NodeId, _now: u64) {
        self.track(node, false);
    }

    fn insert_pinned(&mut self, node: NodeId, _now: u64) {
        self.track(node, true);
    }

    fn touch(&mut self, node: NodeId, _now: u64) {
        self.used(node, true);
    }

    fn released(&mut self, node: NodeId, _now: u64) {
        self.used(node, false);
    }

    fn remove(&mut self, node: NodeId) {
        if let Some(slot) = self.entries.get_mut(node.index())
            && let Some(r) = slot.take()
            && !r.pinned
        {
            self.order.remove(&(r.uses, r.last, node.0));
        }
    }

    fn pin(&mut self, node: NodeId) {
        if let Some(Some(r)) = self.entries.get_mut(node.index())
            && !r.pinned
        {
            r.pinned = true;
            self.order.remove(&(r.uses, r.last, node.0));
        }
    }

    fn unpin(&mut self, node: NodeId) {
        if let Some(Some(r)) = self.entries.get_mut(node.index())
            && r.pinned
        {
            r.pinned = false;
            self.order.insert((r.uses, r.last, node.0));
        }
    }

    fn victim(&self) -> Option<NodeId> {
        self.order.first().map(|&(_, _, n)| NodeId(n))
    }

    fn evictable(&self) -> usize {
        self.order.len()
    }

    fn contains(&self, node: NodeId) -> bool {
        self.entries.get(node.index()).is_some_and(Option::is_some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_evicts_least_recent_and_skips_pinned() {
        let mut p = Lru::default();
        for i in 0..4 {
            p.insert(NodeId(i), u64::from(i));
        }
        p.touch(NodeId(0), 10);
        assert_eq!(p.victim(), Some(NodeId(1)));
        p.pin(NodeId(1));
        assert_eq!(p.victim(), Some(NodeId(2)));
        assert_eq!(p.evictable(), 3);
        p.remove(NodeId(2));
        p.remove(NodeId(3));
        p.unpin(NodeId(1));
        assert_eq!(p.victim(), Some(NodeId(1)), "unpinning is not a use");
        p.touch(NodeId(1), 11);
        assert_eq!(p.victim(), Some(NodeId(0)));
    }

    #[test]
    fn lru_orders_uses_by_call_not_by_now() {
        let mut p = Lru::default();
        p.insert(NodeId(9), 10);
        // A chain used in one later call: parent 0, then child 1, then grandchild 2, though
        // the caller's `now` is smaller.
        for i in 0..3 {
            p.insert_pinned(NodeId(i), 5);
        }
        // The grandchild becomes a candidate: it was used after 9.
        p.unpin(NodeId(2));
        assert_eq!(p.victim(), Some(NodeId(9)));
        p.remove(NodeId(9));
        assert_eq!(p.victim(), Some(NodeId(2)));
        // Its parent, unpinned once the grandchild left, is colder than a node used since.
        p.remove(NodeId(2));
        p.insert(NodeId(7), 6);
        p.unpin(NodeId(1));
        assert_eq!(p.victim(), Some(NodeId(1)));
    }

    #[test]
    fn insert_pinned_is_insert_then_pin() {
        for kind in [PolicyKind::Lru, PolicyKind::Lfu] {
            let (mut a, mut b) = (kind.build(), kind.build());
            for i in 0..4 {
                a.insert(NodeId(i), u64::from(i));
                b.insert(NodeId(i), u64::from(i));
            }
            // A fresh node and one already tracked and listed.
            for n in [NodeId(7), NodeId(1)] {
                a.insert(n, 9);
                a.pin(n);
                b.insert_pinned(n, 9);
            }
            for x in [&mut a, &mut b] {
                x.unpin(NodeId(1));
            }
            assert_eq!(a.evictable(), b.evictable(), "{kind:?}");
            assert!(b.contains(NodeId(7)));
            while let Some(v) = a.victim() {
                assert_eq!(b.victim(), Some(v), "{kind:?}");
                a.remove(v);
                b.remove(v);
            }
            assert_eq!(b.victim(), None);
        }
    }

    #[test]
    fn lfu_counts_a_release_as_recency_not_as_another_use() {
        let mut p = Lfu::default();
        p.insert(NodeId(0), 1);
        p.insert_pinned(NodeId(1), 2);
        p.released(NodeId(1), 3);
        p.unpin(NodeId(1));
        assert_eq!(p.victim(), Some(NodeId(0)), "both used once, 0 less recently");
        p.touch(NodeId(0), 4);
        assert_eq!(p.victim(), Some(NodeId(1)), "the release was not a second use");
    }

    #[test]
    fn lfu_evicts_least_frequent_then_least_recent() {
        let mut p = Lfu::default();
        for i in 0..3 {
            p.insert(NodeId(i), u64::from(i));
        }
        p.touch(NodeId(0), 5);
        p.touch(NodeId(1), 6);
        assert_eq!(p.victim(), Some(NodeId(2)));
        p.pin(NodeId(2));
        assert_eq!(p.victim(), Some(NodeId(0)));
        p.touch(NodeId(0), 7);
        assert_eq!(p.victim(), Some(NodeId(1)));
        assert!(p.contains(NodeId(2)));
        p.remove(NodeId(2));
        assert!(!p.contains(NodeId(2)));
        assert_eq!(p.evictable(), 2);
    }
}
