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

use std::collections::{BTreeMap, HashMap};

use baton_kv::{BlockHash, EventError, InstanceId, KvEvent, KvEventKind, Tier};

use crate::Micros;
use crate::snapshot::Role;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    /// Tier as last reported (`None` while unconfirmed).
    tier: Option<Tier>,
    /// `None` when confirmed by an event; otherwise when the prediction lapses.
    expires_at: Option<Micros>,
}

impl Entry {
    fn live(&self, now: Micros) -> bool {
        self.expires_at.is_none_or(|t| now < t)
    }
}

#[derive(Debug, Clone)]
struct Tree {
    role: Role,
    next_seq: u64,
    blocks: HashMap<BlockHash, Entry>,
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
        self.trees.entry(instance).or_insert_with(|| Tree { role, next_seq: 0, blocks: HashMap::new() }).role = role;
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
        let tree = self.trees.entry(event.instance).or_insert_with(|| Tree {
            role: Role::Colocated,
            next_seq: 0,
            blocks: HashMap::new(),
        });
        if event.seq != tree.next_seq {
            return Err(EventError::Gap { instance: event.instance, expected: tree.next_seq, got: event.seq });
        }
        tree.next_seq += 1;
        match &event.kind {
            KvEventKind::Stored { hash, tier, .. } => {
                tree.blocks.insert(*hash, Entry { tier: Some(*tier), expires_at: None });
            }
            KvEventKind::Moved { hash, tier } => {
                if let Some(e) = tree.blocks.get_mut(hash) {
                    e.tier = Some(*tier);
                    e.expires_at = None;
                }
            }
            KvEventKind::Removed { hash } => {
                tree.blocks.remove(hash);
            }
        }
        Ok(())
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
        let mut tree = Tree { role, next_seq, blocks: HashMap::new() };
        if let Some(old) = old {
            tree.blocks.extend(old.blocks.into_iter().filter(|(_, e)| e.expires_at.is_some()));
        }
        for (hash, tier) in blocks {
            tree.blocks.insert(hash, Entry { tier: Some(tier), expires_at: None });
        }
        self.trees.insert(instance, tree);
    }

    /// The confirmed blocks of an instance (those its events or snapshot reported), with tiers,
    /// ordered by hash.
    pub fn confirmed(&self, instance: InstanceId) -> Vec<(BlockHash, Tier)> {
        let mut out: Vec<(BlockHash, Tier)> = self
            .trees
            .get(&instance)
            .map(|t| t.blocks.iter().filter_map(|(h, e)| e.tier.map(|tier| (*h, tier))).collect())
            .unwrap_or_default();
        out.sort_unstable();
        out
    }

    /// Confirmed blocks of an instance per tier (device, host, disk).
    pub fn confirmed_by_tier(&self, instance: InstanceId) -> [usize; 3] {
        let mut n = [0; 3];
        if let Some(t) = self.trees.get(&instance) {
            for tier in t.blocks.values().filter_map(|e| e.tier) {
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
                    v.insert(Entry { tier: None, expires_at: Some(expires) });
                    self.lapses.push_back((expires, instance, *h));
                }
                std::collections::hash_map::Entry::Occupied(mut o) => {
                    if let Some(t) = o.get_mut().expires_at.as_mut() {
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
            match tree.blocks.get(&hash).and_then(|e| e.expires_at) {
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
            hashes.iter().take_while(|h| t.blocks.get(h).is_some_and(|e| e.expires_at.is_none())).count()
        })
    }

    /// Tier of a confirmed block on an instance.
    pub fn tier_of(&self, instance: InstanceId, hash: BlockHash) -> Option<Tier> {
        self.trees.get(&instance).and_then(|t| t.blocks.get(&hash)).and_then(|e| e.tier)
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
