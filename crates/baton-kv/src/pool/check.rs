//! The checksums of the slower tiers' blocks (see [`crate::checksum`]): each host and disk slot
//! keeps the CRC-32C of the block it holds, written when a block moves in and checked when it
//! moves on (back to the device, or down to disk). A block that fails its check is never
//! served: the copy fails with [`PoolError::Corrupt`], the block leaves the index with every
//! block cached below it (a suffix is useless without its prefix), and the pool counts it
//! ([`MemPool::corrupt_blocks`]). Callers compute the dropped tokens again: the index no longer
//! offers them.
//!
//! A [`SwapCopier`](super::SwapCopier) checks on another thread: it shares the sums (a slot's
//! sum cannot change while a swap-in holds a reference on the slot) and reports what failed
//! through a [`CorruptLog`], which [`MemPool::abort_swap_in`] reads to drop those blocks.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use super::*;
use crate::block_checksum;

/// One CRC-32C per slot of a tier (unused on the device tier, whose bytes never leave).
pub(super) type Sums = Arc<[AtomicU32]>;

/// A tier's sums, all zero.
pub(super) fn sums(n: usize) -> Sums {
    (0..n).map(|_| AtomicU32::new(0)).collect()
}

/// Blocks found corrupt: how many in all, and those a copier found that the pool has not yet
/// dropped from its index.
#[derive(Debug, Default)]
pub(super) struct CorruptLog {
    total: AtomicU64,
    unhandled: Mutex<Vec<Loc>>,
}

impl CorruptLog {
    fn count(&self, instance: InstanceId, loc: Loc) {
        self.total.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            %instance, tier = %loc.tier, block = loc.block.0,
            "a KV block failed its checksum; it is dropped and its tokens are computed again"
        );
    }

    /// The entries for any of `locs`, taken out of the log.
    fn take(&self, locs: &[Loc]) -> Vec<Loc> {
        let mut found = self.unhandled.lock().unwrap_or_else(PoisonError::into_inner);
        let (mine, rest) = found.drain(..).partition(|l| locs.contains(l));
        *found = rest;
        mine
    }
}

/// What a copy reads and writes, for the check: the tiers' sums and the log.
#[derive(Debug, Clone)]
pub(super) struct Checker {
    pub(super) instance: InstanceId,
    pub(super) sums: [Sums; 3],
    pub(super) log: Arc<CorruptLog>,
    /// Where a copy between the device tier and a slower one is counted.
    pub(super) meter: Arc<crate::CopyMeter>,
    /// Bytes of one block (what a copy moves).
    pub(super) block_bytes: u64,
}

/// Where a copy's bytes can be summed after it: the destination arena, or (a copy onto disk)
/// the source arena it was written from.
pub(super) enum Copied<'a> {
    /// The block now at `to` in this arena.
    Into(&'a KvArena),
    /// The block at `from` of this arena, as written to disk.
    From(&'a KvArena),
}

impl Checker {
    /// After a copy `from` → `to`: checks the block against the sum `from` carries (a host or
    /// disk slot) and gives `to` the block's sum (a host or disk slot). `Corrupt` when the check
    /// fails, counted; `report` also logs it for [`MemPool::abort_swap_in`] (a copier's).
    pub(super) fn after_copy(&self, from: Loc, to: Loc, copied: Copied<'_>, report: bool) -> Result<(), PoolError> {
        match (from.tier, to.tier) {
            (Tier::Device, Tier::Device) => {}
            (Tier::Device, _) => self.meter.add(crate::CopyDirection::DeviceToHost, self.block_bytes),
            (_, Tier::Device) => self.meter.add(crate::CopyDirection::HostToDevice, self.block_bytes),
            _ => {}
        }
        let sum = match copied {
            Copied::Into(arena) => block_checksum(arena, to.block),
            Copied::From(arena) => block_checksum(arena, from.block),
        };
        if from.tier != Tier::Device && self.sums[from.tier.index()][from.block.index()].load(Ordering::Relaxed) != sum
        {
            self.log.count(self.instance, from);
            if report {
                self.log.unhandled.lock().unwrap_or_else(PoisonError::into_inner).push(from);
            }
            return Err(PoolError::Corrupt(KvAddr { instance: self.instance, loc: from }));
        }
        if to.tier != Tier::Device {
            self.sums[to.tier.index()][to.block.index()].store(sum, Ordering::Relaxed);
        }
        Ok(())
    }
}

impl MemPool {
    /// KV blocks that failed their checksum on the way back from the host or disk tier since
    /// the pool was made (each dropped and its tokens computed again).
    pub fn corrupt_blocks(&self) -> u64 {
        self.checker.log.total.load(Ordering::Relaxed)
    }

    /// The meter of bytes copied into and out of the device tier: the pool counts its own tier
    /// copies; the engine hands it to its device backend and transfer plane, which count theirs.
    pub fn copy_meter(&self) -> &Arc<crate::CopyMeter> {
        &self.checker.meter
    }

    /// The cached block at `loc`, with its generation, if one is.
    pub(super) fn node_at(&self, loc: Loc) -> Option<(NodeId, u32)> {
        let owner = self.owner(loc);
        (owner < SWAP_OWNER).then(|| (NodeId(owner), self.index.nodes[owner as usize].generation))
    }

    /// Drops a block that failed its checksum from the index, with everything cached below it;
    /// nothing when the node is gone already. Blocks that requests hold stay theirs.
    pub(super) fn drop_corrupt(&mut self, (node, generation): (NodeId, u32)) {
        if self.index.is_live(node, generation) {
            for n in self.index.subtree_post_order(node) {
                self.remove_node(n);
            }
        }
    }

    /// The blocks of `locs` a copier found corrupt, taken from its log (call before the
    /// references that keep them where they are are dropped).
    pub(super) fn reported_corrupt(&self, locs: &[Loc]) -> Vec<(NodeId, u32)> {
        self.checker.log.take(locs).into_iter().filter_map(|l| self.node_at(l)).collect()
    }
}
