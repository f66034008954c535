//! Global prompt trees: where the cluster's KV blocks are cached, as the scheduler knows it.
//!
//! MemServe's global scheduler keeps one set of prompt trees per instance type (prefill-only,
//! decode-only, colocated); Mooncake's conductor keeps the block keys of every prefill instance.
//! Here a tree is one instance's set of chained block hashes (a chained hash names its whole
//! prefix, so a set of hashes *is* a prefix tree), tagged with the instance's [`Role`].
//!
//! Entries come from two sources:
//! - [`KvEvent`]s of the instance's pool ([`apply`](GlobalPromptTrees::apply)): confirmed, kept
//!   until a `Removed` event;
//! - the scheduler's own routing ([`apply_predict`](GlobalPromptTrees::apply_predict) of a
//!   decision's [`Predict`], applied by whoever carries the decision out): after sending a request
//!   to an instance it expects the prompt's blocks to be cached there. Such entries are
//!   unconfirmed and expire after a TTL unless an event confirms them (MemServe §6: "global prompt
//!   trees with a time-to-live").
//!
//! Time is passed in; nothing here reads a clock.
//!
//! A worker's events come in batches ([`apply_all`](GlobalPromptTrees::apply_all): one tree
//! lookup per batch, not per event). Each tree's blocks live in an open-addressing
//! [`HashTable`] on the heap, keyed by block hash (the key already is a hash), one 16-byte slot
//! per block with its [`Entry`] packed into the value where `std`'s map took 24 bytes and a
//! control byte: less memory to grow into and to probe. Walks prefetch the slots of the blocks
//! ahead (a batch's events, a prompt's blocks), and
//! [`prefetch_prompt`](GlobalPromptTrees::prefetch_prompt) starts every tree's first probe of a
//! prompt at once, so a decision waits on several cache misses together, not one after
//! another.

use std::collections::BTreeMap;
use std::num::NonZeroU64;

use baton_kv::hash_table::{HashTable, Probe};
use baton_kv::{BlockHash, EventError, InstanceId, KvEvent, KvEventKind, Tier};

use crate::Micros;
use crate::role::Role;

/// One change to an instance's index as [`GlobalPromptTrees::apply_all`] takes it: a
/// [`KvEventKind`] without the block's tokens, which the trees do not keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockUpdate {
    /// A block was cached.
    Stored {
        /// The block.
        hash: BlockHash,
        /// Where.
        tier: Tier,
    },
    /// A cached block moved to another tier.
    Moved {
        /// The block.
        hash: BlockHash,
        /// Its tier now.
        tier: Tier,
    },
    /// A block left the cache.
    Removed {
        /// The block.
        hash: BlockHash,
    },
}

impl BlockUpdate {
    /// The block changed.
    pub fn hash(&self) -> BlockHash {
        match self {
            BlockUpdate::Stored { hash, .. } | BlockUpdate::Moved { hash, .. } | BlockUpdate::Removed { hash } => *hash,
        }
    }

    /// Starts loading the slot of `blocks` this change will probe (past it, for a new block).
    fn prefetch(&self, blocks: &HashTable) {
        blocks.prefetch(self.hash().0, matches!(self, BlockUpdate::Stored { .. }));
    }
}

impl From<&KvEventKind> for BlockUpdate {
    fn from(kind: &KvEventKind) -> Self {
        match kind {
            KvEventKind::Stored { hash, tier, .. } => BlockUpdate::Stored { hash: *hash, tier: *tier },
            KvEventKind::Moved { hash, tier } => BlockUpdate::Moved { hash: *hash, tier: *tier },
            KvEventKind::Removed { hash } => BlockUpdate::Removed { hash: *hash },
        }
    }
}

/// What the trees know of one block on one instance: an event confirmed it (and said its
/// tier), or the scheduler predicted it, until a time. Stored packed in a [`HashTable`]
/// value ([`pack`](Entry::pack)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    /// Reported by the instance's events: kept until a `Removed` event.
    Confirmed(Tier),
    /// Routed there by the scheduler: lapses at `expires_at` unless an event confirms it.
    Predicted {
        /// When the prediction lapses, at most [`Entry::LATEST`].
        expires_at: Micros,
    },
}

impl Entry {
    /// The latest a prediction can lapse: a table value is an entry's code plus one (0 marks an
    /// empty slot), predictions taking the codes up to this and confirmed entries the three
    /// above it, one per tier. Only a prediction made within microseconds of `u64::MAX` notices.
    const LATEST: Micros = u64::MAX - 1 - Tier::ALL.len() as u64;

    /// The entry as a table value.
    #[inline]
    fn pack(self) -> NonZeroU64 {
        NonZeroU64::MIN.saturating_add(match self {
            Entry::Predicted { expires_at } => expires_at.min(Self::LATEST),
            Entry::Confirmed(tier) => Self::LATEST + 1 + tier.index() as u64,
        })
    }

    /// The entry a table value holds.
    #[inline]
    fn unpack(v: NonZeroU64) -> Self {
        match v.get() - 1 {
            expires_at @ ..=Self::LATEST => Entry::Predicted { expires_at },
            code => Entry::Confirmed(Tier::ALL[(code - Self::LATEST - 1) as usize]),
        }
    }

    fn live(&self, now: Micros) -> bool {
        match self {
            Entry::Confirmed(_) => true,
            Entry::Predicted { expires_at } => now < *expires_at,
        }
    }

    /// The tier an event reported (`None` while predicted).
    fn tier(&self) -> Option<Tier> {
        match self {
            Entry::Confirmed(tier) => Some(*tier),
            Entry::Predicted { .. } => None,
        }
    }

    /// When a prediction lapses (`None` once confirmed).
    fn expires_at(&self) -> Option<Micros> {
        match self {
            Entry::Confirmed(_) => None,
            Entry::Predicted { expires_at } => Some(*expires_at),
        }
    }
}

/// Blocks of a prompt whose slots a walk prefetches ahead of the one it probes: enough to
/// overlap several cache misses of a large tree.
const AHEAD: usize = 8;

#[derive(Debug, Clone)]
struct Tree {
    role: Role,
    next_seq: u64,
    blocks: HashTable,
}

impl Tree {
    fn new(role: Role, next_seq: u64) -> Self {
        Self { role, next_seq, blocks: HashTable::new() }
    }

    #[inline]
    fn get(&self, hash: BlockHash) -> Option<Entry> {
        self.blocks.get(hash.0).map(Entry::unpack)
    }

    fn entries(&self) -> impl Iterator<Item = (BlockHash, Entry)> + '_ {
        self.blocks.iter().map(|(h, v)| (BlockHash(h), Entry::unpack(v)))
    }

    /// Leading blocks of `hashes` held with an entry that passes `keep`. A walk that misses
    /// the first block costs one probe; one that hits prefetches [`AHEAD`] blocks ahead.
    fn leading(&self, hashes: &[BlockHash], keep: impl Fn(Entry) -> bool) -> usize {
        for (i, h) in hashes.iter().enumerate() {
            if !self.get(*h).is_some_and(&keep) {
                return i;
            }
            // The walk goes on: from its first hit, keep the blocks ahead loading.
            let (from, n) = if i == 0 { (1, AHEAD) } else { (i + AHEAD, 1) };
            for a in hashes.iter().skip(from).take(n) {
                self.blocks.prefetch(a.0, false);
            }
        }
        hashes.len()
    }
}

/// What carrying a routed request out changes in the global prompt trees: its prompt's blocks
/// are expected at its prefill instance once the prefill ends (an unconfirmed entry, dropped at
/// the trees' TTL unless a KV event confirms it). A decision only reads the trees; the caller
/// applies this to them ([`GlobalPromptTrees::apply_predict`]) once it acts on the decision, so
/// the simulator and the conductor run the same decision with no lock or write inside it.
/// [`Predict::of`] makes one from a decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Predict {
    /// The instance expected to cache the prompt.
    pub instance: InstanceId,
    /// The prompt's chained block hashes.
    pub hashes: Vec<BlockHash>,
}

/// How much of a prompt one instance holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InstancePrefix {
    /// The instance.
    pub instance: InstanceId,
    /// Its role.
    pub role: Role,
    /// Leading blocks of the prompt it holds (confirmed or predicted, not expired).
    pub blocks: usize,
}

/// Per-instance prompt trees fed by KV events, with a TTL for unconfirmed entries.
#[derive(Debug, Clone)]
pub struct GlobalPromptTrees {
    ttl_us: Micros,
    trees: BTreeMap<InstanceId, Tree>,
    /// Predictions in the order they lapse (the TTL is fixed, so in the order they were made):
    /// [`expire`](Self::expire) pops only what lapsed, never walks the confirmed entries.
    lapses: std::collections::VecDeque<(Micros, InstanceId, BlockHash)>,
}

impl GlobalPromptTrees {
    /// Empty trees; predicted entries live `ttl_us`.
    pub fn new(ttl_us: Micros) -> Self {
        Self { ttl_us, trees: BTreeMap::new(), lapses: std::collections::VecDeque::new() }
    }

    /// The TTL of unconfirmed entries.
    pub fn ttl_us(&self) -> Micros {
        self.ttl_us
    }

    /// Registers an instance (or changes its role, keeping its blocks).
    pub fn set_role(&mut self, instance: InstanceId, role: Role) {
        self.trees.entry(instance).or_insert_with(|| Tree::new(role, 0)).role = role;
    }

    /// Forgets an instance (it left, or must be resynchronised after a gap).
    pub fn remove_instance(&mut self, instance: InstanceId) {
        self.trees.remove(&instance);
    }

    /// Applies one KV event of a registered instance (an unknown instance is registered as
    /// [`Role::Colocated`]). Events of an instance must come in sequence; on a gap nothing is
    /// applied and the caller should resynchronise (remove the instance and replay its index).
    /// `Moved`/`Removed` of a block the tree does not hold are ignored (it may have expired).
    pub fn apply(&mut self, event: &KvEvent) -> Result<(), EventError> {
        self.apply_all(event.instance, [(event.seq, BlockUpdate::from(&event.kind))]).map(|_| ())
    }

    /// Applies a batch of `instance`'s events, `(sequence number, change)` in order, as
    /// [`apply`](Self::apply) would one by one, finding the instance's tree once. Returns how
    /// many were applied; on a gap, those before it stay applied and the error names it.
    pub fn apply_all(
        &mut self,
        instance: InstanceId,
        events: impl IntoIterator<Item = (u64, BlockUpdate)>,
    ) -> Result<usize, EventError> {
        let tree = self.trees.entry(instance).or_insert_with(|| Tree::new(Role::Colocated, 0));
        // The events [`AHEAD`] of the one being applied, their blocks' slots loading meanwhile:
        // a large tree's slots are cache misses, and this way several are waited on at once.
        let mut events = events.into_iter();
        let mut ring: [Option<(u64, BlockUpdate)>; AHEAD] = [None; AHEAD];
        for slot in &mut ring {
            *slot = events.next();
            if let Some((_, u)) = slot {
                u.prefetch(&tree.blocks);
            }
        }
        let mut next = 0;
        let mut applied = 0;
        while let Some((seq, update)) = ring[next].take() {
            ring[next] = events.next();
            if let Some((_, u)) = &ring[next] {
                u.prefetch(&tree.blocks);
            }
            next = (next + 1) % AHEAD;
            if seq != tree.next_seq {
                return Err(EventError::Gap { instance, expected: tree.next_seq, got: seq });
            }
            tree.next_seq += 1;
            applied += 1;
            match update {
                BlockUpdate::Stored { hash, tier } => {
                    tree.blocks.insert(hash.0, Entry::Confirmed(tier).pack());
                }
                BlockUpdate::Moved { hash, tier } => {
                    if let Probe::Found(at, _) = tree.blocks.probe(hash.0) {
                        tree.blocks.set(at, Entry::Confirmed(tier).pack());
                    }
                }
                BlockUpdate::Removed { hash } => {
                    tree.blocks.remove(hash.0);
                }
            }
        }
        Ok(applied)
    }

    /// Replaces what is known of `instance` by a snapshot of its index: exactly `blocks`
    /// (confirmed, with their tiers), its events continuing from `next_seq`. Predicted entries
    /// of blocks the snapshot lacks are kept (a routed request's blocks may not be stored yet).
    pub fn replace_instance(
        &mut self,
        instance: InstanceId,
        role: Role,
        next_seq: u64,
        blocks: impl IntoIterator<Item = (BlockHash, Tier)>,
    ) {
        let old = self.trees.remove(&instance);
        let blocks = blocks.into_iter();
        let mut tree = Tree::new(role, next_seq);
        // A worker's snapshot is its whole index: the tree is sized once, for it.
        tree.blocks.reserve(blocks.size_hint().0);
        if let Some(old) = old {
            for (hash, e) in old.entries().filter(|(_, e)| e.expires_at().is_some()) {
                tree.blocks.insert(hash.0, e.pack());
            }
        }
        for (hash, tier) in blocks {
            tree.blocks.insert(hash.0, Entry::Confirmed(tier).pack());
        }
        self.trees.insert(instance, tree);
    }

    /// The confirmed blocks of an instance (those its events or snapshot reported), with tiers,
    /// ordered by hash.
    pub fn confirmed(&self, instance: InstanceId) -> Vec<(BlockHash, Tier)> {
        let mut out: Vec<(BlockHash, Tier)> = self
            .trees
            .get(&instance)
            .map(|t| t.entries().filter_map(|(h, e)| e.tier().map(|tier| (h, tier))).collect())
            .unwrap_or_default();
        out.sort_unstable();
        out
    }

    /// Confirmed blocks of an instance per tier (device, host, disk).
    pub fn confirmed_by_tier(&self, instance: InstanceId) -> [usize; 3] {
        let mut n = [0; 3];
        if let Some(t) = self.trees.get(&instance) {
            for tier in t.entries().filter_map(|(_, e)| e.tier()) {
                n[tier as usize] += 1;
            }
        }
        n
    }

    /// Records that `instance` is expected to cache `hashes` (the scheduler routed a request with
    /// this prompt there). Confirmed entries stay confirmed; predicted ones get a fresh TTL.
    pub fn predict(&mut self, instance: InstanceId, hashes: &[BlockHash], now: Micros) {
        let Some(tree) = self.trees.get_mut(&instance) else { return };
        let expires = now.saturating_add(self.ttl_us).min(Entry::LATEST);
        let blocks = &mut tree.blocks;
        blocks.reserve(hashes.len());
        for h in hashes.iter().take(AHEAD) {
            blocks.prefetch(h.0, true);
        }
        for (i, h) in hashes.iter().enumerate() {
            if let Some(a) = hashes.get(i + AHEAD) {
                blocks.prefetch(a.0, true);
            }
            match blocks.probe(h.0) {
                Probe::Vacant(at) => {
                    blocks.fill(at, h.0, Entry::Predicted { expires_at: expires }.pack());
                    self.lapses.push_back((expires, instance, *h));
                }
                Probe::Found(at, v) => {
                    if let Entry::Predicted { expires_at } = Entry::unpack(v) {
                        blocks.set(at, Entry::Predicted { expires_at: expires_at.max(expires) }.pack());
                    }
                }
            }
        }
    }

    /// Applies a decision's [`Predict`]: [`predict`](Self::predict) of its prompt at its
    /// instance. The caller does this once it acts on the decision (the decision never writes).
    pub fn apply_predict(&mut self, p: &Predict, now: Micros) {
        self.predict(p.instance, &p.hashes, now);
    }

    /// Drops predicted entries whose TTL has passed. Costs what lapsed, not the index's size:
    /// each live prediction has one place in a queue ordered by when it was made; one refreshed
    /// since goes to the back with its new time (lookups check the time anyway, so a late
    /// removal is never a wrong answer).
    pub fn expire(&mut self, now: Micros) {
        while let Some(&(at, instance, hash)) = self.lapses.front() {
            if at > now {
                break;
            }
            self.lapses.pop_front();
            let Some(tree) = self.trees.get_mut(&instance) else { continue };
            match tree.get(hash).and_then(|e| e.expires_at()) {
                Some(t) if t <= now => {
                    tree.blocks.remove(hash.0);
                }
                Some(t) => self.lapses.push_back((t, instance, hash)),
                None => {}
            }
        }
    }

    /// Starts loading, in every instance's tree, the slot of the prompt's first block, which
    /// each [`prefix_len`](Self::prefix_len) of the prompt probes first: the cache misses of
    /// a policy's walk over the instances then overlap instead of coming one after another.
    /// Only a hint: nothing changes.
    pub fn prefetch_prompt(&self, hashes: &[BlockHash]) {
        if let Some(first) = hashes.first() {
            for tree in self.trees.values() {
                tree.blocks.prefetch(first.0, false);
            }
        }
    }

    /// Leading blocks of `hashes` that `instance` holds at `now`.
    pub fn prefix_len(&self, instance: InstanceId, hashes: &[BlockHash], now: Micros) -> usize {
        self.trees.get(&instance).map_or(0, |t| t.leading(hashes, |e| e.live(now)))
    }

    /// Leading blocks of `hashes` that `instance`'s own events say it holds (predictions not
    /// counted): what a request sent there now reuses.
    pub fn confirmed_prefix_len(&self, instance: InstanceId, hashes: &[BlockHash]) -> usize {
        self.trees.get(&instance).map_or(0, |t| t.leading(hashes, |e| e.tier().is_some()))
    }

    /// Tier of a confirmed block on an instance.
    pub fn tier_of(&self, instance: InstanceId, hash: BlockHash) -> Option<Tier> {
        self.trees.get(&instance).and_then(|t| t.get(hash)).and_then(|e| e.tier())
    }

    /// Every instance whose role passes `roles` with at least one leading block, longest first
    /// (ties by id).
    pub fn matches(&self, hashes: &[BlockHash], now: Micros, roles: impl Fn(Role) -> bool) -> Vec<InstancePrefix> {
        let mut out: Vec<InstancePrefix> = self
            .trees
            .iter()
            .filter(|(_, t)| roles(t.role))
            .map(|(&id, t)| InstancePrefix { instance: id, role: t.role, blocks: self.prefix_len(id, hashes, now) })
            .filter(|m| m.blocks > 0)
            .collect();
        out.sort_by(|a, b| b.blocks.cmp(&a.blocks).then(a.instance.cmp(&b.instance)));
        out
    }

    /// Blocks known on an instance (confirmed and live predicted).
    pub fn len(&self, instance: InstanceId, now: Micros) -> usize {
        self.trees.get(&instance).map_or(0, |t| t.entries().filter(|(_, e)| e.live(now)).count())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(instance: u32, seq: u64, kind: KvEventKind) -> KvEvent {
        KvEvent { instance: InstanceId(instance), seq, kind }
    }

    fn stored(h: u64) -> KvEventKind {
        KvEventKind::Stored { hash: BlockHash(h), parent: None, tokens: Default::default(), tier: Tier::Device }
    }

    #[test]
    fn events_feed_the_trees_and_gaps_are_reported() {
        let mut t = GlobalPromptTrees::new(1000);
        t.set_role(InstanceId(1), Role::Prefill);
        t.apply(&ev(1, 0, stored(10))).expect("apply");
        t.apply(&ev(1, 1, stored(11))).expect("apply");
        let hashes = [BlockHash(10), BlockHash(11), BlockHash(12)];
        assert_eq!(t.prefix_len(InstanceId(1), &hashes, 0), 2);
        t.apply(&ev(1, 2, KvEventKind::Moved { hash: BlockHash(11), tier: Tier::Host })).expect("apply");
        assert_eq!(t.tier_of(InstanceId(1), BlockHash(11)), Some(Tier::Host));
        t.apply(&ev(1, 3, KvEventKind::Removed { hash: BlockHash(10) })).expect("apply");
        assert_eq!(t.prefix_len(InstanceId(1), &hashes, 0), 0);
        assert!(matches!(t.apply(&ev(1, 9, stored(1))), Err(EventError::Gap { expected: 4, got: 9, .. })));
        // Confirmed entries never expire.
        assert_eq!(t.len(InstanceId(1), u64::MAX), 1);
    }

    #[test]
    fn a_batch_applies_as_its_events_one_by_one_and_stops_at_a_gap() {
        let kinds = [
            stored(10),
            stored(11),
            KvEventKind::Moved { hash: BlockHash(11), tier: Tier::Disk },
            KvEventKind::Removed { hash: BlockHash(10) },
            stored(12),
        ];
        let (mut one, mut batch) = (GlobalPromptTrees::new(1000), GlobalPromptTrees::new(1000));
        for (seq, kind) in kinds.iter().enumerate() {
            one.apply(&ev(1, seq as u64, kind.clone())).expect("in order");
        }
        let updates = kinds.iter().enumerate().map(|(seq, k)| (seq as u64, BlockUpdate::from(k)));
        assert_eq!(batch.apply_all(InstanceId(1), updates), Ok(5));
        assert_eq!(batch.confirmed(InstanceId(1)), one.confirmed(InstanceId(1)));
        // A gap stops the batch there: what came before it stays applied.
        let gapped =
            [(5, BlockUpdate::Removed { hash: BlockHash(12) }), (7, BlockUpdate::Removed { hash: BlockHash(11) })];
        assert!(matches!(batch.apply_all(InstanceId(1), gapped), Err(EventError::Gap { expected: 6, got: 7, .. })));
        assert_eq!(batch.confirmed(InstanceId(1)), vec![(BlockHash(11), Tier::Disk)]);
    }

    #[test]
    fn a_snapshot_replaces_an_instance_and_events_continue_from_it() {
        let mut t = GlobalPromptTrees::new(1000);
        t.set_role(InstanceId(1), Role::Prefill);
        t.apply(&ev(1, 0, stored(10))).expect("apply");
        t.predict(InstanceId(1), &[BlockHash(77)], 0);
        t.replace_instance(
            InstanceId(1),
            Role::Prefill,
            40,
            [(BlockHash(11), Tier::Device), (BlockHash(12), Tier::Host)],
        );
        assert_eq!(t.confirmed(InstanceId(1)), vec![(BlockHash(11), Tier::Device), (BlockHash(12), Tier::Host)]);
        assert_eq!(t.confirmed_by_tier(InstanceId(1)), [1, 1, 0]);
        assert_eq!(t.prefix_len(InstanceId(1), &[BlockHash(77)], 1), 1, "predictions survive a snapshot");
        assert_eq!(t.confirmed_prefix_len(InstanceId(1), &[BlockHash(77)]), 0, "a prediction is not confirmed");
        assert_eq!(t.confirmed_prefix_len(InstanceId(1), &[BlockHash(11), BlockHash(12), BlockHash(77)]), 2);
        assert!(t.apply(&ev(1, 1, stored(13))).is_err(), "events continue from the snapshot's number");
        t.apply(&ev(1, 40, stored(13))).expect("apply");
        assert_eq!(t.confirmed(InstanceId(1)).len(), 3);
    }

    #[test]
    fn predicted_entries_expire_unless_confirmed() {
        let mut t = GlobalPromptTrees::new(1000);
        t.set_role(InstanceId(1), Role::Prefill);
        t.set_role(InstanceId(2), Role::Decode);
        let hashes = [BlockHash(1), BlockHash(2)];
        t.predict(InstanceId(1), &hashes, 0);
        assert_eq!(t.prefix_len(InstanceId(1), &hashes, 999), 2);
        assert_eq!(t.prefix_len(InstanceId(1), &hashes, 1000), 0, "TTL passed");
        t.apply(&ev(1, 0, stored(1))).expect("apply");
        assert_eq!(t.prefix_len(InstanceId(1), &hashes, 5000), 1, "the confirmed block stays");
        t.expire(5000);
        assert_eq!(t.len(InstanceId(1), 0), 1);
        t.predict(InstanceId(2), &hashes, 5000);
        let m = t.matches(&hashes, 5000, Role::prefills);
        assert_eq!(m, vec![InstancePrefix { instance: InstanceId(1), role: Role::Prefill, blocks: 1 }]);
        assert_eq!(t.matches(&hashes, 5000, |_| true)[0].instance, InstanceId(2));
    }

    #[test]
    fn entries_pack_into_nonzero_values_and_back() {
        let entries = [
            Entry::Confirmed(Tier::Device),
            Entry::Confirmed(Tier::Host),
            Entry::Confirmed(Tier::Disk),
            Entry::Predicted { expires_at: 0 },
            Entry::Predicted { expires_at: 120_000_000 },
            Entry::Predicted { expires_at: Entry::LATEST },
        ];
        for e in entries {
            assert_eq!(Entry::unpack(e.pack()), e);
        }
        let packed: std::collections::HashSet<u64> = entries.iter().map(|e| e.pack().get()).collect();
        assert_eq!(packed.len(), entries.len(), "distinct entries, distinct values");
        // A later expiry is clamped, and lapses only at the end of time.
        let end = Entry::unpack(Entry::Predicted { expires_at: u64::MAX }.pack());
        assert_eq!(end, Entry::Predicted { expires_at: Entry::LATEST });
        assert!(end.live(u64::MAX - 5) && !end.live(u64::MAX));
    }

    /// What the trees should answer, kept the plainest way: a map per instance.
    #[derive(Default)]
    struct Model {
        trees: BTreeMap<InstanceId, (u64, std::collections::HashMap<BlockHash, Entry>)>,
    }

    /// Random events (in order, and now and then out of order), predictions, expiries and
    /// snapshots of a few instances over few distinct blocks, through the trees' growth:
    /// every answer agrees with the model's. (A lapsed prediction may linger until an
    /// [`expire`](GlobalPromptTrees::expire) reaches it, where the model drops it at once; only
    /// a `Moved` event could tell, so blocks that may hold one, predicted blocks (below 2000)
    /// without a live entry, are not moved.)
    #[test]
    fn random_operations_agree_with_a_plain_model() {
        let ttl = 50;
        let mut t = GlobalPromptTrees::new(ttl);
        let mut m = Model::default();
        let mut x = 0x9E37_79B9_7F4A_7C15_u64;
        let mut rand = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let tiers = Tier::ALL;
        let mut now = 0;
        for step in 0..30_000u64 {
            let inst = InstanceId(rand(3) as u32);
            let hash = BlockHash(rand(3000));
            now += rand(3);
            let (next_seq, blocks) = m.trees.entry(inst).or_default();
            match rand(100) {
                0..=59 => {
                    let seq = if rand(50) == 0 { *next_seq + 1 } else { *next_seq };
                    let update = match rand(4) {
                        0 | 1 => BlockUpdate::Stored { hash, tier: tiers[rand(3) as usize] },
                        2 => BlockUpdate::Moved { hash, tier: tiers[rand(3) as usize] },
                        _ => BlockUpdate::Removed { hash },
                    };
                    let may_linger = hash.0 < 2000 && !blocks.get(&hash).is_some_and(|e| e.live(now));
                    if matches!(update, BlockUpdate::Moved { .. }) && may_linger {
                        continue;
                    }
                    let got = t.apply_all(inst, [(seq, update)]);
                    if seq != *next_seq {
                        assert!(got.is_err(), "a gap is refused");
                        continue;
                    }
                    assert_eq!(got, Ok(1));
                    *next_seq += 1;
                    match update {
                        BlockUpdate::Stored { hash, tier } => {
                            blocks.insert(hash, Entry::Confirmed(tier));
                        }
                        BlockUpdate::Moved { hash, tier } => {
                            if let Some(e) = blocks.get_mut(&hash) {
                                *e = Entry::Confirmed(tier);
                            }
                        }
                        BlockUpdate::Removed { hash } => {
                            blocks.remove(&hash);
                        }
                    }
                }
                60..=84 => {
                    let hashes: Vec<BlockHash> = (0..rand(20)).map(|i| BlockHash((hash.0 + i) % 2000)).collect();
                    t.predict(inst, &hashes, now);
                    if t.trees.contains_key(&inst) {
                        for h in hashes {
                            let e = blocks.entry(h).or_insert(Entry::Predicted { expires_at: 0 });
                            if let Entry::Predicted { expires_at } = e {
                                *expires_at = (*expires_at).max(now + ttl);
                            }
                        }
                    }
                }
                85..=94 => {
                    t.expire(now);
                    for (_, blocks) in m.trees.values_mut() {
                        blocks.retain(|_, e| e.expires_at().is_none_or(|at| at > now));
                    }
                }
                95..=97 => {
                    let snapshot: Vec<(BlockHash, Tier)> =
                        (0..rand(400)).map(|i| (BlockHash(rand(3000) + i % 2), tiers[rand(3) as usize])).collect();
                    *next_seq = rand(1000);
                    t.replace_instance(inst, Role::Prefill, *next_seq, snapshot.iter().copied());
                    blocks.retain(|_, e| e.expires_at().is_some());
                    blocks.extend(snapshot.iter().map(|&(h, tier)| (h, Entry::Confirmed(tier))));
                }
                _ => {
                    t.remove_instance(inst);
                    m.trees.remove(&inst);
                }
            }
            if step % 101 == 0 {
                for (&inst, (_, blocks)) in &m.trees {
                    let mut confirmed: Vec<(BlockHash, Tier)> =
                        blocks.iter().filter_map(|(&h, e)| Some((h, e.tier()?))).collect();
                    confirmed.sort_unstable();
                    assert_eq!(t.confirmed(inst), confirmed, "step {step}");
                    assert_eq!(t.len(inst, now), blocks.values().filter(|e| e.live(now)).count());
                    let prompt: Vec<BlockHash> = (0..40).map(|i| BlockHash((step + i) % 3000)).collect();
                    let leading = |ok: &dyn Fn(&Entry) -> bool| {
                        prompt.iter().take_while(|h| blocks.get(h).is_some_and(ok)).count()
                    };
                    assert_eq!(t.prefix_len(inst, &prompt, now), leading(&|e| e.live(now)));
                    assert_eq!(t.confirmed_prefix_len(inst, &prompt), leading(&|e| e.tier().is_some()));
                    for h in &prompt {
                        assert_eq!(t.tier_of(inst, *h), blocks.get(h).and_then(Entry::tier));
                    }
                }
            }
        }
    }
}
