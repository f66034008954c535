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
//! - the scheduler's own routing ([`predict`](GlobalPromptTrees::predict)): after sending a request
//!   to an instance it expects the prompt's blocks to be cached there. Such entries are
//!   unconfirmed and expire after a TTL unless an event confirms them (MemServe §6: "global prompt
//!   trees with a time-to-live").
//!
//! Time is passed in; nothing here reads a clock.
//!
//! A worker's events come in batches ([`apply_all`](GlobalPromptTrees::apply_all): one tree
//! lookup per batch, not per event), and the maps keyed by block hash hash with
//! [`BlockHasher`]: the key already is a hash.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use baton_kv::{BlockHash, EventError, InstanceId, KvEvent, KvEventKind, Tier};

use crate::Micros;
use crate::snapshot::Role;

/// The hasher of maps keyed by [`BlockHash`]. A block hash already is a well-mixed 64-bit
/// hash (xxHash rounds and a splitmix64 avalanche, [`baton_kv::block_hash`]), so SipHash's keyed
/// rounds bought nothing and cost most of an event's apply. One multiply by a 64-bit odd
/// constant, folded (the high half of the 128-bit product XOR the low half), keeps both the
/// bits the map's bucket index takes (the low ones) and those its control bytes take (the
/// high ones) mixed, even for keys that differ in a few bits only.
///
/// It is not keyed: a peer that chose colliding hashes on purpose could slow its own tree's
/// probes. Only authenticated workers feed the trees, and their hashes are checked against
/// nothing else here, so that is the threat a worker already is.
#[derive(Debug, Clone, Copy, Default)]
pub struct BlockHasher(u64);

impl Hasher for BlockHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used by `BlockHash`; this keeps any other key correct.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.0 ^= n;
    }

    #[inline]
    fn finish(&self) -> u64 {
        let p = u128::from(self.0).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (p as u64) ^ ((p >> 64) as u64)
    }
}

/// A map keyed by block hash, hashed with [`BlockHasher`].
pub type BlockMap<V> = HashMap<BlockHash, V, BuildHasherDefault<BlockHasher>>;

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
/// tier), or the scheduler predicted it, until a time. One enum rather than two options: 16
/// bytes, so a map slot takes 24, a quarter less memory to fill, grow and probe than 32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    /// Reported by the instance's events: kept until a `Removed` event.
    Confirmed(Tier),
    /// Routed there by the scheduler: lapses at `expires_at` unless an event confirms it.
    Predicted {
        /// When the prediction lapses.
        expires_at: Micros,
    },
}

impl Entry {
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

#[derive(Debug, Clone)]
struct Tree {
    role: Role,
    next_seq: u64,
    blocks: BlockMap<Entry>,
}

impl Tree {
    fn new(role: Role, next_seq: u64) -> Self {
        Self { role, next_seq, blocks: BlockMap::default() }
    }
}

/// How much of a prompt one instance holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixMatch {
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
        let mut applied = 0;
        for (seq, update) in events {
            if seq != tree.next_seq {
                return Err(EventError::Gap { instance, expected: tree.next_seq, got: seq });
            }
            tree.next_seq += 1;
            applied += 1;
            match update {
                BlockUpdate::Stored { hash, tier } => {
                    tree.blocks.insert(hash, Entry::Confirmed(tier));
                }
                BlockUpdate::Moved { hash, tier } => {
                    if let Some(e) = tree.blocks.get_mut(&hash) {
                        *e = Entry::Confirmed(tier);
                    }
                }
                BlockUpdate::Removed { hash } => {
                    tree.blocks.remove(&hash);
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
        tree.blocks.reserve(blocks.size_hint().0);
        if let Some(old) = old {
            tree.blocks.extend(old.blocks.into_iter().filter(|(_, e)| e.expires_at().is_some()));
        }
        for (hash, tier) in blocks {
            tree.blocks.insert(hash, Entry::Confirmed(tier));
        }
        self.trees.insert(instance, tree);
    }

    /// The confirmed blocks of an instance (those its events or snapshot reported), with tiers,
    /// ordered by hash.
    pub fn confirmed(&self, instance: InstanceId) -> Vec<(BlockHash, Tier)> {
        let mut out: Vec<(BlockHash, Tier)> = self
            .trees
            .get(&instance)
            .map(|t| t.blocks.iter().filter_map(|(h, e)| e.tier().map(|tier| (*h, tier))).collect())
            .unwrap_or_default();
        out.sort_unstable();
        out
    }

    /// Confirmed blocks of an instance per tier (device, host, disk).
    pub fn confirmed_by_tier(&self, instance: InstanceId) -> [usize; 3] {
        let mut n = [0; 3];
        if let Some(t) = self.trees.get(&instance) {
            for tier in t.blocks.values().filter_map(Entry::tier) {
                n[tier as usize] += 1;
            }
        }
        n
    }

    /// Records that `instance` is expected to cache `hashes` (the scheduler routed a request with
    /// this prompt there). Confirmed entries stay confirmed; predicted ones get a fresh TTL.
    pub fn predict(&mut self, instance: InstanceId, hashes: &[BlockHash], now: Micros) {
        let Some(tree) = self.trees.get_mut(&instance) else { return };
        let expires = now.saturating_add(self.ttl_us);
        for h in hashes {
            match tree.blocks.entry(*h) {
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(Entry::Predicted { expires_at: expires });
                    self.lapses.push_back((expires, instance, *h));
                }
                std::collections::hash_map::Entry::Occupied(mut o) => {
                    if let Entry::Predicted { expires_at: t } = o.get_mut() {
                        *t = (*t).max(expires);
                    }
                }
            }
        }
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
            match tree.blocks.get(&hash).and_then(Entry::expires_at) {
                Some(t) if t <= now => {
                    tree.blocks.remove(&hash);
                }
                Some(t) => self.lapses.push_back((t, instance, hash)),
                None => {}
            }
        }
    }

    /// Leading blocks of `hashes` that `instance` holds at `now`.
    pub fn prefix_len(&self, instance: InstanceId, hashes: &[BlockHash], now: Micros) -> usize {
        self.trees
            .get(&instance)
            .map_or(0, |t| hashes.iter().take_while(|h| t.blocks.get(h).is_some_and(|e| e.live(now))).count())
    }

    /// Leading blocks of `hashes` that `instance`'s own events say it holds (predictions not
    /// counted): what a request sent there now reuses.
    pub fn confirmed_prefix_len(&self, instance: InstanceId, hashes: &[BlockHash]) -> usize {
        self.trees.get(&instance).map_or(0, |t| {
            hashes.iter().take_while(|h| t.blocks.get(h).is_some_and(|e| matches!(e, Entry::Confirmed(_)))).count()
        })
    }

    /// Tier of a confirmed block on an instance.
    pub fn tier_of(&self, instance: InstanceId, hash: BlockHash) -> Option<Tier> {
        self.trees.get(&instance).and_then(|t| t.blocks.get(&hash)).and_then(Entry::tier)
    }

    /// Every instance whose role passes `roles` with at least one leading block, longest first
    /// (ties by id).
    pub fn matches(&self, hashes: &[BlockHash], now: Micros, roles: impl Fn(Role) -> bool) -> Vec<PrefixMatch> {
        let mut out: Vec<PrefixMatch> = self
            .trees
            .iter()
            .filter(|(_, t)| roles(t.role))
            .map(|(&id, t)| PrefixMatch { instance: id, role: t.role, blocks: self.prefix_len(id, hashes, now) })
            .filter(|m| m.blocks > 0)
            .collect();
        out.sort_by(|a, b| b.blocks.cmp(&a.blocks).then(a.instance.cmp(&b.instance)));
        out
    }

    /// Blocks known on an instance (confirmed and live predicted).
    pub fn len(&self, instance: InstanceId, now: Micros) -> usize {
        self.trees.get(&instance).map_or(0, |t| t.blocks.values().filter(|e| e.live(now)).count())
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
    fn block_hasher_spreads_keys_that_differ_in_few_bits() {
        use std::hash::{BuildHasher, BuildHasherDefault};
        let build = BuildHasherDefault::<BlockHasher>::default();
        // Keys differing only in their high bits (or only in their low bits) land in many
        // buckets of a 1024-bucket table (the low bits) and carry varied control bytes (the
        // top seven).
        for keys in [(0..1024u64).map(|i| i << 54).collect::<Vec<_>>(), (0..1024u64).collect()] {
            let buckets: std::collections::HashSet<u64> =
                keys.iter().map(|&k| build.hash_one(BlockHash(k)) & 1023).collect();
            let tops: std::collections::HashSet<u64> =
                keys.iter().map(|&k| build.hash_one(BlockHash(k)) >> 57).collect();
            assert!(buckets.len() > 500, "{} buckets", buckets.len());
            assert!(tops.len() > 100, "{} control bytes", tops.len());
        }
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
        assert_eq!(m, vec![PrefixMatch { instance: InstanceId(1), role: Role::Prefill, blocks: 1 }]);
        assert_eq!(t.matches(&hashes, 5000, |_| true)[0].instance, InstanceId(2));
    }
}
