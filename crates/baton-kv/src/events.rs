//! KV events: how a pool reports the changes to its index.
//!
//! A [`MemPool`](crate::MemPool) reports every change to its index as a [`KvEvent`] with a
//! per-instance sequence number: a block stored, moved to another tier, or removed. Whoever
//! follows an instance's cache applies the stream in order from a snapshot (the pool's
//! [`index_entries`](crate::MemPool::index_entries) and
//! [`next_event_seq`](crate::MemPool::next_event_seq)) and holds what the pool holds: in Baton
//! that is baton-sched's `GlobalPromptTrees`, the index the conductor and the simulator route
//! by. A gap in the sequence is an [`EventError::Gap`], so the follower knows to resynchronise
//! rather than drift.

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
}
