//! KV cache memory for Baton.
//!
//! This crate owns every byte of an instance's KV cache and the bookkeeping around it. It does
//! no network I/O and no model math: the model reads and writes KV through the views this crate
//! hands out, and the transfer layer plans copies from the [`TensorDescriptor`]s it describes.
//!
//! The pieces, bottom up:
//!
//! - [`KvGeometry`] and [`KvLayout`]: how many layers, KV heads, head dims and tokens per block,
//!   and in which order they sit in memory. A [`TensorDescriptor`] turns a layout into shape and
//!   strides, so code that moves KV never hard-codes a layout.
//! - [`KvArena`]: one contiguous region holding all blocks of an instance.
//! - [`BlockAllocator`]: hands out [`BlockId`]s, counts references so a block shared by a
//!   cached prefix and a running request is freed only when both let go.
//! - [`BlockTable`]: the blocks of one sequence, in token order, and the slot of each token.
//!
//! ```
//! use baton_kv::{BlockAllocator, BlockTable, KvArena, KvGeometry, KvLayout};
//!
//! let geometry = KvGeometry::new(2, 2, 16, 16);
//! let mut arena = KvArena::new(geometry, KvLayout::BlockMajor, 8);
//! let mut allocator = BlockAllocator::new(8);
//! let mut table = BlockTable::default();
//! table.extend(allocator.allocate(2).expect("two free blocks"));
//! let (block, slot) = table.slot(17, geometry.block_size);
//! arena.token_mut(0, baton_kv::KvPart::Key, block, slot).fill(1.0);
//! assert_eq!(arena.block(0, baton_kv::KvPart::Key, block)[slot * 32], 1.0);
//! ```

mod allocator;
mod arena;
mod block_table;
mod geometry;

pub use allocator::{AllocatorError, BlockAllocator};
pub use arena::KvArena;
pub use block_table::BlockTable;
pub use geometry::{Dim, KvDtype, KvGeometry, KvLayout, KvPart, TensorDescriptor};

/// Identifies one block of an instance's KV arena: an index into the arena, `0..num_blocks`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

impl BlockId {
    /// The block's index into the arena.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl std::fmt::Display for BlockId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "block#{}", self.0)
    }
}
