//! KV events and the remote index that applies them.
//!
//! A [`MemPool`](crate::MemPool) reports every change to its index as a [`KvEvent`] with a
//! per-instance sequence number: a block stored, moved to another tier, or removed. A
//! [`RemoteIndex`] (the conductor's global prompt tree, or a simulator's) applies the stream and
//! ends equal to the source's index; a gap in the sequence is reported, so the consumer knows to
//! resynchronise rather than drift.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::Arc;

use crate::{BlockHash, InstanceId, Tier};

/// One change to an instance's prefix index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEvent {
    /// The instance whose index changed.
    pub instance: InstanceId,
    /// Per-instance sequence number, from 0, without gaps.
    pub seq: u64,
    /// What changed.
    pub kind: KvEventKind,
}

/// The tokens of one block: a window of a buffer that the blocks of one insert share, so an
/// event costs no allocation of its own. Dereferences to `[u32]`; compares as that slice.
#[derive(Clone, Default)]
pub struct BlockTokens {
    buf: Arc<[u32]>,
    start: usize,
    end: usize,
}

impl BlockTokens {
    /// The tokens `buf[range]`.
    ///
    /// # Panics
    ///
    /// If `range` is out of `buf`'s bounds.
    pub fn new(buf: Arc<[u32]>, range: Range<usize>) -> Self {
        assert!(range.start <= range.end && range.end <= buf.len(), "token range out of bounds");
        Self { buf, start: range.start, end: range.end }
    }

    /// The tokens.
    pub fn as_slice(&self) -> &[u32] {
        &self.buf[self.start..self.end]
    }
}

impl std::ops::Deref for BlockTokens {
    type Target = [u32];

    fn deref(&self) -> &[u32] {
        self.as_slice()
    }
}

impl From<Vec<u32>> for BlockTokens {
    fn from(tokens: Vec<u32>) -> Self {
        let end = tokens.len();
        Self { buf: tokens.into(), start: 0, end }
    }
}

impl From<&[u32]> for BlockTokens {
    fn from(tokens: &[u32]) -> Self {
        Self { buf: tokens.into(), start: 0, end: tokens.len() }
    }
}

impl PartialEq for BlockTokens {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for BlockTokens {}

impl std::fmt::Debug for BlockTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.as_slice().fmt(f)
    }
}

/// What changed in an index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEventKind {
    /// A block was cached.
    Stored {
        /// Its chained hash.
        hash: BlockHash,
        /// The previous block's hash (`None` for a prompt's first block).
        parent: Option<BlockHash>,
        /// Its tokens.
        tokens: BlockTokens,
        /// Where it lives.
        tier: Tier,
    },
    /// A cached block moved to another tier.
    Moved {
        /// Its chained hash.
        hash: BlockHash,
        /// The tier it lives in now.
        tier: Tier,
    },
    /// A block left the cache.
    Removed {
        /// Its chained hash.
        hash: BlockHash,
    },
}

/// What an index records about a cached block, as events carry it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexEntry {
    /// The previous block's hash.
    pub parent: Option<BlockHash>,
    /// Where the block lives.
    pub tier: Tier,
}

/// Why an event could not be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventError {
    /// Events were lost between the source and this index.
    #[error("{instance}: expected event {expected}, got {got}")]
    Gap {
        /// The instance.
        instance: InstanceId,
        /// The next sequence number this index expected.
        expected: u64,
        /// The one it got.
        got: u64,
    },
    /// The event names a block this index does not hold.
    #[error("{instance}: block {hash} is not in the index")]
    Unknown {
        /// The instance.
        instance: InstanceId,
        /// The block.
        hash: BlockHash,
    },
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct InstanceIndex {
    next_seq: u64,
    entries: HashMap<BlockHash, IndexEntry>,
}

/// An index of other instances' caches, kept by applying their events (MemServe's global prompt
/// trees; Mooncake's conductor view). Keyed by chained hash, so matching a prompt needs only its
/// block hashes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RemoteIndex {
    instances: BTreeMap<InstanceId, InstanceIndex>,
}

impl RemoteIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one event. Events of an instance must come in sequence order.
    pub fn apply(&mut self, event: &KvEvent) -> Result<(), EventError> {
        let inst = self.instances.entry(event.instance).or_default();
        if event.seq != inst.next_seq {
            return Err(EventError::Gap { instance: event.instance, expected: inst.next_seq, got: event.seq });
        }
        let unknown = |hash| EventError::Unknown { instance: event.instance, hash };
        match &event.kind {
            KvEventKind::Stored { hash, parent, tier, .. } => {
                inst.entries.insert(*hash, IndexEntry { parent: *parent, tier: *tier });
            }
            KvEventKind::Moved { hash, tier } => inst.entries.get_mut(hash).ok_or_else(|| unknown(*hash))?.tier = *tier,
            KvEventKind::Removed { hash } => {
                inst.entries.remove(hash).ok_or_else(|| unknown(*hash))?;
            }
        }
        inst.next_seq += 1;
        Ok(())
    }

    /// Forgets an instance (it left the cluster, or is being resynchronised).
    pub fn remove_instance(&mut self, instance: InstanceId) {
        self.instances.remove(&instance);
    }

    /// The cached blocks of one instance, ordered by hash.
    pub fn entries(&self, instance: InstanceId) -> BTreeMap<BlockHash, IndexEntry> {
        self.instances.get(&instance).map(|i| i.entries.iter().map(|(h, e)| (*h, *e)).collect()).unwrap_or_default()
    }

    /// For each instance holding at least one block, how many leading blocks of the prompt
    /// whose block hashes are `hashes` it holds (on any tier). Longest first.
    pub fn overlaps(&self, hashes: &[BlockHash]) -> Vec<(InstanceId, usize)> {
        let mut out: Vec<(InstanceId, usize)> = self
            .instances
            .iter()
            .map(|(&id, inst)| (id, hashes.iter().take_while(|h| inst.entries.contains_key(h)).count()))
            .filter(|&(_, n)| n > 0)
            .collect();
        out.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        out
    }
}
