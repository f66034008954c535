//! The prefix index: a radix tree over token blocks (MemServe), keyed by chained block hashes
//! (Mooncake).
//!
//! Every edge of the tree is one block of `T` tokens, so the tree is a trie of blocks; a node
//! stands for a whole prefix and carries its chained [`BlockHash`], the tier and slot holding its
//! KV ([`Loc`]) and links to its parent, children and siblings. Nodes are found by hash in one
//! hash-map probe (the key already is a hash, so the map does not hash it again), and a hit is
//! confirmed against the parent and the stored tokens, so a hash collision is a miss, never a
//! wrong answer.
//!
//! This module is the tree alone; reference counts, tiers and eviction are the
//! [`MemPool`](crate::MemPool)'s. It does no I/O and reads no clock.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::{BlockHash, Loc, NodeId};

const NIL: u32 = u32::MAX;

/// A hasher for keys that already are well-mixed 64-bit hashes.
#[derive(Default)]
struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = v;
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

/// A radix tree over token blocks.
#[derive(Debug)]
pub struct PrefixIndex {
    block_size: usize,
    pub(crate) nodes: Vec<Node>,
    tokens: Vec<u32>,
    free_nodes: Vec<u32>,
    by_hash: HashMap<BlockHash, u32, BuildHasherDefault<PassThrough>>,
}

impl PrefixIndex {
    /// An empty index over blocks of `block_size` tokens.
    pub fn new(block_size: usize) -> Self {
        Self { block_size, nodes: Vec::new(), tokens: Vec::new(), free_nodes: Vec::new(), by_hash: HashMap::default() }
    }

    /// An empty index with room for `nodes` nodes.
    pub fn with_capacity(block_size: usize, nodes: usize) -> Self {
        let mut i = Self::new(block_size);
        i.nodes.reserve(nodes);
        i.tokens.reserve(nodes * block_size);
        i.by_hash.reserve(nodes);
        i
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
        self.by_hash.get(&hash).map(|&n| NodeId(n))
    }

    /// The child of `parent` holding `tokens` with key `hash`, confirmed against parent and
    /// tokens.
    pub fn find(&self, parent: Option<NodeId>, hash: BlockHash, tokens: &[u32]) -> Option<NodeId> {
        let n = *self.by_hash.get(&hash)?;
        let node = &self.nodes[n as usize];
        let p = parent.map_or(NIL, |p| p.0);
        (node.parent == p && self.tokens_of(n) == tokens).then_some(NodeId(n))
    }

    fn tokens_of(&self, n: u32) -> &[u32] {
        let s = n as usize * self.block_size;
        &self.tokens[s..s + self.block_size]
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

    /// Adds a child of `parent` for a block not yet in the index.
    pub(crate) fn add(&mut self, parent: Option<NodeId>, hash: BlockHash, tokens: &[u32], loc: Loc) -> NodeId {
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
                self.tokens[s..s + self.block_size].copy_from_slice(tokens);
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
        self.by_hash.insert(hash, n);
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
        self.by_hash.remove(&node.hash);
        let slot = &mut self.nodes[n as usize];
        slot.live = false;
        slot.generation = slot.generation.wrapping_add(1);
        self.free_nodes.push(n);
    }
}
