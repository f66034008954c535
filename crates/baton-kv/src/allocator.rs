//! Block allocation with reference counts.

use crate::BlockId;

/// Why an allocator call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocatorError {
    /// A block id outside the arena.
    #[error("{0} is outside the arena")]
    OutOfRange(BlockId),
    /// A reference was taken or dropped on a block nobody holds.
    #[error("{0} is not allocated")]
    NotAllocated(BlockId),
}

/// Hands out blocks and counts references to them.
///
/// A block is free or held; a held block has a reference count of at least one, one for each
/// holder (a running sequence, a cached prefix, a lease). It returns to the free list when the
/// last holder lets go. Allocation prefers low ids, so a fresh arena hands out contiguous runs.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    refs: Vec<u32>,
    /// Free blocks, kept so that `pop` yields the lowest id first.
    free: Vec<BlockId>,
}

impl BlockAllocator {
    /// An allocator over `num_blocks` free blocks.
    pub fn new(num_blocks: usize) -> Self {
        let free = (0..num_blocks as u32).rev().map(BlockId).collect();
        Self { refs: vec![0; num_blocks], free }
    }

    /// Blocks in the arena.
    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    /// Blocks on the free list.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Takes `n` free blocks, each with one reference, or `None` (and takes nothing) when fewer
    /// than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.free.len() {
            return None;
        }
        let blocks = self.free.split_off(self.free.len() - n);
        let blocks: Vec<BlockId> = blocks.into_iter().rev().collect();
        for b in &blocks {
            self.refs[b.index()] = 1;
        }
        Some(blocks)
    }

    /// Adds a reference to a held block.
    pub fn retain(&mut self, block: BlockId) -> Result<(), AllocatorError> {
        let r = self.refs.get_mut(block.index()).ok_or(AllocatorError::OutOfRange(block))?;
        if *r == 0 {
            return Err(AllocatorError::NotAllocated(block));
        }
        *r += 1;
        Ok(())
    }

    /// Drops a reference; the block is free again when it was the last.
    pub fn release(&mut self, block: BlockId) -> Result<(), AllocatorError> {
        let r = self.refs.get_mut(block.index()).ok_or(AllocatorError::OutOfRange(block))?;
        if *r == 0 {
            return Err(AllocatorError::NotAllocated(block));
        }
        *r -= 1;
        if *r == 0 {
            self.free.push(block);
        }
        Ok(())
    }

    /// Drops one reference on each block.
    pub fn release_all(&mut self, blocks: &[BlockId]) -> Result<(), AllocatorError> {
        blocks.iter().try_for_each(|&b| self.release(b))
    }

    /// References held on `block`.
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.refs.get(block.index()).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn fresh_allocator_hands_out_contiguous_low_ids() {
        let mut a = BlockAllocator::new(8);
        assert_eq!(a.allocate(3), Some(vec![BlockId(0), BlockId(1), BlockId(2)]));
        assert_eq!(a.num_free(), 5);
        assert_eq!(a.allocate(6), None);
        assert_eq!(a.num_free(), 5, "a failed allocation takes nothing");
    }

    #[test]
    fn shared_block_is_freed_by_last_holder() {
        let mut a = BlockAllocator::new(2);
        let b = a.allocate(1).expect("free")[0];
        a.retain(b).expect("held");
        a.release(b).expect("held");
        assert_eq!(a.num_free(), 1);
        a.release(b).expect("held");
        assert_eq!(a.num_free(), 2);
        assert_eq!(a.release(b), Err(AllocatorError::NotAllocated(b)));
        assert_eq!(a.retain(BlockId(9)), Err(AllocatorError::OutOfRange(BlockId(9))));
    }

    proptest! {
        /// Under any sequence of allocations and releases, every block is either free or held,
        /// never both, and the free count matches.
        #[test]
        fn every_block_free_or_held(ops in proptest::collection::vec((0usize..5, any::<bool>()), 1..200)) {
            let mut a = BlockAllocator::new(16);
            let mut held: Vec<BlockId> = Vec::new();
            for (n, alloc) in ops {
                if alloc {
                    if let Some(bs) = a.allocate(n) { held.extend(bs); }
                } else if !held.is_empty() {
                    let b = held.swap_remove(n % held.len());
                    a.release(b).expect("held block releases");
                }
                let mut seen = [false; 16];
                for b in &held { prop_assert!(!seen[b.index()]); seen[b.index()] = true; }
                prop_assert_eq!(a.num_free() + held.len(), 16);
                for b in &held { prop_assert_eq!(a.ref_count(*b), 1); }
            }
        }
    }
}
