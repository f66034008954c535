//! Eviction policies: LRU and LFU behind one interface, with pinning.
//!
//! A policy orders the cached entries of one tier and names the coldest one that is not pinned.
//! It never reads a clock: the caller passes `now` (any monotone counter, such as a step number).
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
    /// Stops tracking `node`.
    fn remove(&mut self, node: NodeId);
    /// Keeps a tracked `node` from being named a victim until [`unpin`](Self::unpin).
    fn pin(&mut self, node: NodeId);
    /// Makes a pinned `node` a candidate again.
    fn unpin(&mut self, node: NodeId);
    /// The coldest unpinned node, if any.
    fn victim(&self) -> Option<NodeId>;
    /// Tracked nodes that are not pinned.
    fn evictable(&self) -> usize;
    /// Whether `node` is tracked.
    fn contains(&self, node: NodeId) -> bool;
}

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Absent,
    Pinned,
    Listed,
}

#[derive(Debug, Clone, Copy)]
struct Link {
    prev: u32,
    next: u32,
    slot: Slot,
}

/// Least recently used: an intrusive doubly linked list of unpinned nodes, `O(1)` per call.
/// Unpinning counts as a use (the request that held the block just let go of it).
#[derive(Debug)]
pub struct Lru {
    links: Vec<Link>,
    head: u32,
    tail: u32,
    listed: usize,
}

impl Default for Lru {
    fn default() -> Self {
        Self { links: Vec::new(), head: NIL, tail: NIL, listed: 0 }
    }
}

impl Lru {
    fn link(&mut self, n: u32) -> &mut Link {
        let i = n as usize;
        if i >= self.links.len() {
            self.links.resize(i + 1, Link { prev: NIL, next: NIL, slot: Slot::Absent });
        }
        &mut self.links[i]
    }

    fn slot(&self, n: NodeId) -> Slot {
        self.links.get(n.index()).map_or(Slot::Absent, |l| l.slot)
    }

    fn push_back(&mut self, n: u32) {
        let tail = self.tail;
        *self.link(n) = Link { prev: tail, next: NIL, slot: Slot::Listed };
        if tail == NIL {
            self.head = n;
        } else {
            self.links[tail as usize].next = n;
        }
        self.tail = n;
        self.listed += 1;
    }

    fn unlink(&mut self, n: u32) {
        let Link { prev, next, .. } = self.links[n as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.links[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.links[next as usize].prev = prev;
        }
        self.listed -= 1;
    }
}

impl EvictionPolicy for Lru {
    fn insert(&mut self, node: NodeId, _now: u64) {
        match self.slot(node) {
            Slot::Listed => self.unlink(node.0),
            Slot::Pinned | Slot::Absent => {}
        }
        self.push_back(node.0);
    }

    fn insert_pinned(&mut self, node: NodeId, _now: u64) {
        if self.slot(node) == Slot::Listed {
            self.unlink(node.0);
        }
        *self.link(node.0) = Link { prev: NIL, next: NIL, slot: Slot::Pinned };
    }

    fn touch(&mut self, node: NodeId, _now: u64) {
        if self.slot(node) == Slot::Listed {
            self.unlink(node.0);
            self.push_back(node.0);
        }
    }

    fn remove(&mut self, node: NodeId) {
        if self.slot(node) == Slot::Listed {
            self.unlink(node.0);
        }
        if let Some(l) = self.links.get_mut(node.index()) {
            l.slot = Slot::Absent;
        }
    }

    fn pin(&mut self, node: NodeId) {
        if self.slot(node) == Slot::Listed {
            self.unlink(node.0);
            self.links[node.index()].slot = Slot::Pinned;
        }
    }

    fn unpin(&mut self, node: NodeId) {
        if self.slot(node) == Slot::Pinned {
            self.push_back(node.0);
        }
    }

    fn victim(&self) -> Option<NodeId> {
        (self.head != NIL).then_some(NodeId(self.head))
    }

    fn evictable(&self) -> usize {
        self.listed
    }

    fn contains(&self, node: NodeId) -> bool {
        self.slot(node) != Slot::Absent
    }
}

#[derive(Debug, Clone, Copy)]
struct Freq {
    count: u64,
    last: u64,
    pinned: bool,
}

/// Least frequently used, ties broken by least recent use: an ordered set over
/// `(uses, last use, node)`, `O(log n)` per call.
#[derive(Debug, Default)]
pub struct Lfu {
    entries: Vec<Option<Freq>>,
    order: BTreeSet<(u64, u64, u32)>,
}

impl Lfu {
    fn entry(&mut self, n: NodeId) -> &mut Option<Freq> {
        if n.index() >= self.entries.len() {
            self.entries.resize(n.index() + 1, None);
        }
        &mut self.entries[n.index()]
    }
}

impl EvictionPolicy for Lfu {
    fn insert(&mut self, node: NodeId, now: u64) {
        self.remove(node);
        *self.entry(node) = Some(Freq { count: 1, last: now, pinned: false });
        self.order.insert((1, now, node.0));
    }

    fn insert_pinned(&mut self, node: NodeId, now: u64) {
        self.remove(node);
        *self.entry(node) = Some(Freq { count: 1, last: now, pinned: true });
    }

    fn touch(&mut self, node: NodeId, now: u64) {
        let Some(Some(f)) = self.entries.get_mut(node.index()) else { return };
        let old = (f.count, f.last, node.0);
        f.count += 1;
        f.last = now;
        let new = (f.count, f.last, node.0);
        if !f.pinned {
            self.order.remove(&old);
            self.order.insert(new);
        }
    }

    fn remove(&mut self, node: NodeId) {
        if let Some(slot) = self.entries.get_mut(node.index())
            && let Some(f) = slot.take()
            && !f.pinned
        {
            self.order.remove(&(f.count, f.last, node.0));
        }
    }

    fn pin(&mut self, node: NodeId) {
        if let Some(Some(f)) = self.entries.get_mut(node.index())
            && !f.pinned
        {
            f.pinned = true;
            self.order.remove(&(f.count, f.last, node.0));
        }
    }

    fn unpin(&mut self, node: NodeId) {
        if let Some(Some(f)) = self.entries.get_mut(node.index())
            && f.pinned
        {
            f.pinned = false;
            self.order.insert((f.count, f.last, node.0));
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
        assert_eq!(p.victim(), Some(NodeId(0)), "unpinning counts as a use");
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
