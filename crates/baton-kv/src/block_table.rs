//! A sequence's block table.

use crate::BlockId;

/// The blocks of one sequence in token order: token `p` lives in block `p / T` at slot `p % T`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<BlockId>,
}

impl BlockTable {
    /// A table over `blocks`, in token order.
    pub fn new(blocks: Vec<BlockId>) -> Self {
        Self { blocks }
    }

    /// The blocks, in token order.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Number of blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether the table holds no block.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Appends blocks at the end.
    pub fn extend(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        self.blocks.extend(blocks);
    }

    /// Removes and returns every block.
    pub fn take(&mut self) -> Vec<BlockId> {
        std::mem::take(&mut self.blocks)
    }

    /// Block and slot of token position `pos` with `block_size` tokens per block.
    ///
    /// Panics when the table is too short for `pos`: the planner allocates before a token is
    /// written, so that is a bug, not an input error.
    pub fn slot(&self, pos: usize, block_size: usize) -> (BlockId, usize) {
        (self.blocks[pos / block_size], pos % block_size)
    }

    /// Tokens the table can hold with `block_size` tokens per block.
    pub fn capacity(&self, block_size: usize) -> usize {
        self.blocks.len() * block_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_maps_positions_through_blocks() {
        let t = BlockTable::new(vec![BlockId(7), BlockId(3)]);
        assert_eq!(t.slot(0, 4), (BlockId(7), 0));
        assert_eq!(t.slot(5, 4), (BlockId(3), 1));
        assert_eq!(t.capacity(4), 8);
    }
}
