//! The prefix index: a radix tree over token blocks (MemServe), keyed by chained block hashes
//! (Mooncake).
//!
//! Every edge of the tree is one block of `T` tokens, so the tree is a trie of blocks; a node
//! stands for a whole prefix and carries its chained [`BlockHash`], the tier and slot holding its
//! KV ([`Loc`]) and links to its parent, children and siblings. Nodes are found by hash in one
//! probe of an open-addressing table (the key already is a hash; its slot can be prefetched
//! blocks ahead, see [`HashStream`]), and a hit is
//! confirmed against the parent and the stored tokens, so a hash collision is a miss, never a
//! wrong answer.
//!
//! This module is the tree alone; reference counts, tiers and eviction are the
//! [`MemPool`](crate::MemPool)'s. It does no I/O and reads no clock.

use std::num::NonZeroU64;

use crate::hash_table::{Backing, HashTable, Probe, Slot, prefetch};
use crate::{BlockHash, Loc, NodeId};

const NIL: u32 = u32::MAX;

/// A node as the value of its hash in the index's [`HashTable`] (which reserves 0).
fn value_of(node: u32) -> NonZeroU64 {
    NonZeroU64::MIN.saturating_add(u64::from(node))
}

/// The node a value of the index's [`HashTable`] names.
fn node_of(value: NonZeroU64) -> u32 {
    (value.get() - 1) as u32
}

/// The index's token ids, block after block: a growable array in an anonymous mapping advised
/// to use huge pages, like the index's [`HashTable`] (a new block's tokens land on a random page).
#[derive(Debug)]
struct TokenStore {
    map: memmap2::MmapMut,
    len: usize,
}

impl TokenStore {
    fn with_capacity(n: usize) -> Self {
        let map = memmap2::MmapMut::map_anon(n.max(1024) * 4).expect("memory for the index's tokens");
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        Self { map, len: 0 }
    }

    fn as_slice(&self) -> &[u32] {
        &bytemuck::cast_slice(&self.map)[..self.len]
    }

    fn as_mut_slice(&mut self) -> &mut [u32] {
        &mut bytemuck::cast_slice_mut(&mut self.map)[..self.len]
    }

    fn extend_from_slice(&mut self, tokens: &[u32]) {
        let cap = self.map.len() / 4;
        if self.len + tokens.len() > cap {
            let mut bigger = Self::with_capacity((self.len + tokens.len()).max(2 * cap));
            bigger.len = self.len;
            bigger.as_mut_slice().copy_from_slice(self.as_slice());
            *self = bigger;
        }
        let at = self.len;
        self.len += tokens.len();
        self.as_mut_slice()[at..].copy_from_slice(tokens);
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Node {
    pub(crate) hash: BlockHash,
    pub(crate) parent: u32,
    first_child: u32,
    next_sibling: u32,
    prev_sibling: u32,
    pub(crate) loc: Loc,
    /// Children living in the same tier as this node (they pin it there).
    pub(crate) same_tier_children: u32,
    /// A swap is moving this node's block.
    pub(crate) in_flight: bool,
    /// Bumped each time the slot is freed, so a stale [`NodeId`] can be told apart.
    pub(crate) generation: u32,
    pub(crate) live: bool,
}

/// What the index records about one cached block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeInfo {
    /// The block's chained hash.
    pub hash: BlockHash,
    /// The node of the previous block, `None` for a prompt's first block.
    pub parent: Option<NodeId>,
    /// Where its KV lives.
    pub loc: Loc,
}

/// Blocks whose hash is computed this far ahead of their use, and their hash-table slot
/// prefetched: enough to overlap several cache misses of a 1M-block index.
const HASH_AHEAD: usize = 8;

/// The chained hashes of a prompt's full blocks, computed [`HASH_AHEAD`] blocks ahead of the
/// caller, each prefetching its slot of the index's hash table when computed: a walk down the
/// index then waits on several cache misses at once instead of one after another.
pub(crate) struct HashStream<'a> {
    blocks: std::slice::ChunksExact<'a, u32>,
    ring: [BlockHash; HASH_AHEAD],
    made: usize,
    used: usize,
    last: Option<BlockHash>,
    to_miss: bool,
}

impl<'a> HashStream<'a> {
    /// The hashes of the full blocks of `tokens`, for lookups expected to hit (a match).
    pub(crate) fn new(tokens: &'a [u32], block_size: usize) -> Self {
        Self {
            blocks: tokens.chunks_exact(block_size),
            ring: [BlockHash(0); HASH_AHEAD],
            made: 0,
            used: 0,
            last: None,
            to_miss: false,
        }
    }

    /// Like [`new`](Self::new), for lookups expected to miss (an insert): prefetches the
    /// longer probe too.
    pub(crate) fn to_miss(tokens: &'a [u32], block_size: usize) -> Self {
        Self { to_miss: true, ..Self::new(tokens, block_size) }
    }

    /// The next block's hash, `None` after the last full block.
    #[inline]
    pub(crate) fn next(&mut self, index: &PrefixIndex) -> Option<BlockHash> {
        while self.made < self.used + HASH_AHEAD {
            let Some(block) = self.blocks.next() else { break };
            let h = crate::block_hash(self.last, block);
            index.prefetch_hash(h, self.to_miss);
            self.ring[self.made % HASH_AHEAD] = h;
            self.last = Some(h);
            self.made += 1;
        }
        (self.used < self.made).then(|| {
            let h = self.ring[self.used % HASH_AHEAD];
            self.used += 1;
            h
        })
    }
}

/// Where a [`PrefixIndex::lookup`] that missed would put the block.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Vacant(Slot);

/// What [`PrefixIndex::lookup`] found.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Lookup {
    /// The block is cached under this parent.
    Hit(NodeId),
    /// Another block has the same hash: neither a hit nor addable.
    Collision,
    /// Nothing has the hash.
    Miss(Vacant),
}

/// A radix tree over token blocks.
#[derive(Debug)]
pub struct PrefixIndex {
    block_size: usize,
    pub(crate) nodes: Vec<Node>,
    tokens: TokenStore,
    free_nodes: Vec<u32>,
    by_hash: HashTable,
}

impl PrefixIndex {
    /// An empty index over blocks of `block_size` tokens.
    pub fn new(block_size: usize) -> Self {
        Self::with_capacity(block_size, 0)
    }

    /// An empty index with room for `nodes` nodes.
    pub fn with_capacity(block_size: usize, nodes: usize) -> Self {
        Self {
            block_size,
            nodes: Vec::with_capacity(nodes),
            tokens: TokenStore::with_capacity(nodes * block_size),
            free_nodes: Vec::new(),
            by_hash: HashTable::with_capacity_in(nodes, Backing::HugePages),
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Cached blocks.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    /// The node whose hash is `hash`, if cached.
    pub fn get(&self, hash: BlockHash) -> Option<NodeId> {
        self.by_hash.get(hash.0).map(|v| NodeId(node_of(v)))
    }

    /// Starts loading what a lookup of `hash` will read (see [`lookup`](Self::lookup)).
    #[inline]
    pub(crate) fn prefetch_hash(&self, hash: BlockHash, to_miss: bool) {
        self.by_hash.prefetch(hash.0, to_miss);
    }

    /// Starts loading the node and token slots that the `k`-th next [`add_at`](Self::add_at) will
    /// reuse, if it reuses one.
    #[inline]
    pub(crate) fn prefetch_reuse(&self, k: usize) {
        if let Some(&n) = self.free_nodes.len().checked_sub(k + 1).and_then(|i| self.free_nodes.get(i)) {
            prefetch(&self.nodes[n as usize]);
            prefetch(&self.tokens.as_slice()[n as usize * self.block_size]);
        }
    }

    /// One probe for `hash`: the child of `parent` holding `tokens` ([`Lookup::Hit`]), another
    /// node with the same hash ([`Lookup::Collision`]), or nothing ([`Lookup::Miss`], which
    /// [`add_at`](Self::add_at) takes to add the node without probing again).
    #[inline]
    pub(crate) fn lookup(&self, parent: Option<NodeId>, hash: BlockHash, tokens: &[u32]) -> Lookup {
        match self.by_hash.probe(hash.0) {
            Probe::Found(_, v) => {
                let n = node_of(v);
                let p = parent.map_or(NIL, |p| p.0);
                if self.nodes[n as usize].parent == p && self.tokens_of(n) == tokens {
                    Lookup::Hit(NodeId(n))
                } else {
                    Lookup::Collision
                }
            }
            Probe::Vacant(at) => Lookup::Miss(Vacant(at)),
        }
    }

    /// The child of `parent` holding `tokens` with key `hash`, confirmed against parent and
    /// tokens.
    pub fn find(&self, parent: Option<NodeId>, hash: BlockHash, tokens: &[u32]) -> Option<NodeId> {
        let n = node_of(self.by_hash.get(hash.0)?);
        let node = &self.nodes[n as usize];
        let p = parent.map_or(NIL, |p| p.0);
        (node.parent == p && self.tokens_of(n) == tokens).then_some(NodeId(n))
    }

    fn tokens_of(&self, n: u32) -> &[u32] {
        let s = n as usize * self.block_size;
        &self.tokens.as_slice()[s..s + self.block_size]
    }

    /// What the index records about a live node.
    pub fn info(&self, id: NodeId) -> NodeInfo {
        let n = &self.nodes[id.index()];
        NodeInfo { hash: n.hash, parent: (n.parent != NIL).then_some(NodeId(n.parent)), loc: n.loc }
    }

    /// The tokens of a live node's block.
    pub fn tokens(&self, id: NodeId) -> &[u32] {
        self.tokens_of(id.0)
    }

    /// Whether `id` names a live node of generation `generation`.
    pub(crate) fn is_live(&self, id: NodeId, generation: u32) -> bool {
        self.nodes.get(id.index()).is_some_and(|n| n.live && n.generation == generation)
    }

    /// The children of a node, newest first.
    pub fn children(&self, id: NodeId) -> impl Iterator<Item = NodeId> + '_ {
        let mut c = self.nodes[id.index()].first_child;
        std::iter::from_fn(move || {
            (c != NIL).then(|| {
                let n = c;
                c = self.nodes[n as usize].next_sibling;
                NodeId(n)
            })
        })
    }

    /// Whether a node has children.
    pub fn has_children(&self, id: NodeId) -> bool {
        self.nodes[id.index()].first_child != NIL
    }

    /// The node and all its descendants, children before parents.
    pub fn subtree_post_order(&self, id: NodeId) -> Vec<NodeId> {
        let mut out = Vec::new();
        let mut stack = vec![(id, false)];
        while let Some((n, expanded)) = stack.pop() {
            if expanded {
                out.push(n);
            } else {
                stack.push((n, true));
                stack.extend(self.children(n).map(|c| (c, false)));
            }
        }
        out
    }

    /// Every live node, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.nodes.iter().enumerate().filter(|(_, n)| n.live).map(|(i, _)| NodeId(i as u32))
    }

    /// Adds a child of `parent` for a block that [`lookup`](Self::lookup) just missed (the index
    /// unchanged since), at the slot the lookup found.
    pub(crate) fn add_at(
        &mut self,
        vacant: Vacant,
        parent: Option<NodeId>,
        hash: BlockHash,
        tokens: &[u32],
        loc: Loc,
    ) -> NodeId {
        debug_assert_eq!(tokens.len(), self.block_size);
        let p = parent.map_or(NIL, |p| p.0);
        let first = if p == NIL { NIL } else { self.nodes[p as usize].first_child };
        let mut node = Node {
            hash,
            parent: p,
            first_child: NIL,
            next_sibling: first,
            prev_sibling: NIL,
            loc,
            same_tier_children: 0,
            in_flight: false,
            generation: 0,
            live: true,
        };
        let n = match self.free_nodes.pop() {
            Some(n) => {
                node.generation = self.nodes[n as usize].generation;
                self.nodes[n as usize] = node;
                let s = n as usize * self.block_size;
                self.tokens.as_mut_slice()[s..s + self.block_size].copy_from_slice(tokens);
                n
            }
            None => {
                self.nodes.push(node);
                self.tokens.extend_from_slice(tokens);
                (self.nodes.len() - 1) as u32
            }
        };
        if first != NIL {
            self.nodes[first as usize].prev_sibling = n;
        }
        if p != NIL {
            self.nodes[p as usize].first_child = n;
        }
        if self.by_hash.full() {
            self.by_hash.insert(hash.0, value_of(n));
        } else {
            self.by_hash.fill(vacant.0, hash.0, value_of(n));
        }
        NodeId(n)
    }

    /// Removes a live node that has no children.
    pub(crate) fn remove(&mut self, id: NodeId) {
        let n = id.0;
        let node = self.nodes[n as usize].clone();
        debug_assert!(node.live && node.first_child == NIL, "only live leaves are removed");
        if node.prev_sibling != NIL {
            self.nodes[node.prev_sibling as usize].next_sibling = node.next_sibling;
        } else if node.parent != NIL {
            self.nodes[node.parent as usize].first_child = node.next_sibling;
        }
        if node.next_sibling != NIL {
            self.nodes[node.next_sibling as usize].prev_sibling = node.prev_sibling;
        }
        self.by_hash.remove(node.hash.0);
        let slot = &mut self.nodes[n as usize];
        slot.live = false;
        slot.generation = slot.generation.wrapping_add(1);
        self.free_nodes.push(n);
    }
}

#[cfg(test)]
mod table_tests {
    use super::*;

    #[test]
    fn token_store_grows_keeping_its_tokens() {
        let mut t = TokenStore::with_capacity(0);
        let mut v = Vec::new();
        for i in 0..3000u32 {
            let block = [i, i + 1, i + 2];
            t.extend_from_slice(&block);
            v.extend_from_slice(&block);
        }
        assert_eq!(t.as_slice(), &v[..]);
        t.as_mut_slice()[5] = 7;
        assert_eq!(t.as_slice()[5], 7);
    }
}
