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

use crate::{BlockHash, Loc, NodeId};

const NIL: u32 = u32::MAX;

/// Hints the CPU to bring the cache line at `p` closer; never faults, whatever the address.
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    // SAFETY: a prefetch is only a hint: it reads nothing architecturally and cannot fault.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Slots of a [`HashTable`] per 64-byte cache line (the mapping is page-aligned).
const SLOTS_PER_LINE: usize = 4;

/// Open-addressing hash map from block hash to node, with linear probing and backward-shift
/// deletion (no tombstones). The keys are already hashes, so a probe costs one multiply, and
/// the home slot of a key is known before the probe, so callers can prefetch it while they do
/// other work. Load stays at most 3/4 (at most 3/8 right after growing).
///
/// A slot is `[hash, node + 1]`, `[_, 0]` when empty. The slots live in an anonymous mapping
/// advised to use huge pages: a probe of a large index lands on a random page, and with 4 KiB
/// pages nearly every probe would also miss the TLB.
#[derive(Debug)]
struct HashTable {
    map: memmap2::MmapMut,
    /// `64 - log2(slots)`.
    shift: u32,
    len: usize,
}

/// The index's token ids, block after block: a growable array in an anonymous mapping advised
/// to use huge pages, like [`HashTable`] (a new block's tokens land on a random page).
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

/// Where a probe ended: at the key's slot, or at the empty slot where the key would go.
enum Probe {
    Found(u32),
    Vacant(usize),
}

impl HashTable {
    fn with_capacity(n: usize) -> Self {
        let slots = (n.saturating_mul(4) / 3 + 1).next_power_of_two().max(16);
        let map = memmap2::MmapMut::map_anon(slots * 16).expect("memory for the index's hash table");
        // Only advice: without huge pages the table works the same, with more TLB misses.
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        Self { map, shift: 64 - slots.trailing_zeros(), len: 0 }
    }

    #[inline]
    fn slots(&self) -> &[[u64; 2]] {
        bytemuck::cast_slice(&self.map)
    }

    #[inline]
    fn slots_mut(&mut self) -> &mut [[u64; 2]] {
        bytemuck::cast_slice_mut(&mut self.map)
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots().len() - 1
    }

    /// The home slot of `hash` (Fibonacci hashing: robust even to poorly mixed keys).
    #[inline]
    fn home(&self, hash: u64) -> usize {
        (hash.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    /// Prefetches the cache line holding `hash`'s home slot and, with `to_miss` unless the home
    /// slot starts its line, the next line too: a probe for a missing key reads past its home
    /// slot (2.5 slots on average at half load), and a run crossing into an unfetched line
    /// costs a full miss. A probe that finds its key reads 1.5 slots on average: one line.
    #[inline]
    fn prefetch(&self, hash: u64, to_miss: bool) {
        let slots = self.slots();
        let i = self.home(hash);
        prefetch(&slots[i]);
        if to_miss && !i.is_multiple_of(SLOTS_PER_LINE) {
            prefetch(&slots[(i + SLOTS_PER_LINE - 1) & (slots.len() - 1)]);
        }
    }

    #[inline]
    fn probe(&self, hash: u64) -> Probe {
        let slots = self.slots();
        let mask = slots.len() - 1;
        let mut i = self.home(hash);
        loop {
            let [h, node] = slots[i];
            if node == 0 {
                return Probe::Vacant(i);
            }
            if h == hash {
                return Probe::Found((node - 1) as u32);
            }
            i = (i + 1) & mask;
        }
    }

    #[inline]
    fn get(&self, hash: u64) -> Option<u32> {
        match self.probe(hash) {
            Probe::Found(n) => Some(n),
            Probe::Vacant(_) => None,
        }
    }

    /// Whether one more key would push the load past 3/4.
    #[inline]
    fn full(&self) -> bool {
        (self.len + 1) * 4 > self.slots().len() * 3
    }

    /// Fills the vacant slot `at` that a probe for `hash` just returned (the table unchanged since).
    #[inline]
    fn fill(&mut self, at: usize, hash: u64, node: u32) {
        debug_assert!(self.slots()[at][1] == 0 && !self.full());
        self.slots_mut()[at] = [hash, u64::from(node) + 1];
        self.len += 1;
    }

    /// Inserts a key that is not in the table, growing it first when needed.
    fn insert(&mut self, hash: u64, node: u32) {
        if self.full() {
            self.grow();
        }
        match self.probe(hash) {
            Probe::Vacant(at) => self.fill(at, hash, node),
            Probe::Found(_) => unreachable!("the key is new"),
        }
    }

    fn grow(&mut self) {
        let old = std::mem::replace(self, Self::with_capacity(self.slots().len()));
        for &[hash, node] in old.slots().iter().filter(|e| e[1] != 0) {
            self.insert(hash, (node - 1) as u32);
        }
    }

    /// Removes a key that is in the table, shifting later entries of its run back.
    fn remove(&mut self, hash: u64) {
        let mask = self.mask();
        let mut i = self.home(hash);
        let slots = self.slots();
        while slots[i][0] != hash || slots[i][1] == 0 {
            debug_assert!(slots[i][1] != 0, "removed keys are in the table");
            i = (i + 1) & mask;
        }
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let e = self.slots()[j];
            if e[1] == 0 {
                break;
            }
            // The entry at `j` may fill the hole at `i` unless its home lies cyclically in (i, j].
            let k = self.home(e[0]);
            let stays = if i <= j { i < k && k <= j } else { i < k || k <= j };
            if !stays {
                self.slots_mut()[i] = e;
                i = j;
            }
        }
        self.slots_mut()[i] = [0, 0];
        self.len -= 1;
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
pub(crate) struct Vacant(usize);

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
            by_hash: HashTable::with_capacity(nodes),
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Cached blocks.
    pub fn len(&self) -> usize {
        self.by_hash.len
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.by_hash.len == 0
    }

    /// The node whose hash is `hash`, if cached.
    pub fn get(&self, hash: BlockHash) -> Option<NodeId> {
        self.by_hash.get(hash.0).map(NodeId)
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
            Probe::Found(n) => {
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
        let n = self.by_hash.get(hash.0)?;
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
            self.by_hash.insert(hash.0, n);
        } else {
            self.by_hash.fill(vacant.0, hash.0, n);
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

    #[test]
    fn hash_table_agrees_with_a_hash_map_through_inserts_removes_and_growth() {
        let mut t = HashTable::with_capacity(4);
        let mut m = std::collections::HashMap::new();
        let mut x = 0x1234_5678_u64;
        for step in 0..20_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Few distinct keys, some of them tiny, so runs collide and wrap around.
            let key = if step % 3 == 0 { x % 64 } else { x % 4096 };
            if m.remove(&key).is_some() {
                t.remove(key);
            } else {
                t.insert(key, step);
                m.insert(key, step);
            }
            assert_eq!(t.len, m.len());
            if step % 997 == 0 {
                for k in 0..4096 {
                    assert_eq!(t.get(k), m.get(&k).copied(), "key {k} at step {step}");
                }
            }
        }
    }
}
