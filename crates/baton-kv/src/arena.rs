//! The KV arena: one contiguous region holding every block of an instance.

use crate::{BlockId, KvGeometry, KvLayout, KvPart, TensorDescriptor};

/// All KV blocks of one instance in one float32 region, laid out as its [`TensorDescriptor`]
/// says. The arena knows addresses, not owners: which blocks are in use is the
/// [`crate::BlockAllocator`]'s business.
#[derive(Debug)]
pub struct KvArena {
    geometry: KvGeometry,
    descriptor: TensorDescriptor,
    data: Vec<f32>,
}

impl KvArena {
    /// A zeroed arena of `num_blocks` blocks.
    pub fn new(geometry: KvGeometry, layout: KvLayout, num_blocks: usize) -> Self {
        let descriptor = TensorDescriptor::new(&geometry, layout, num_blocks);
        let data = vec![0.0; descriptor.num_elems()];
        Self { geometry, descriptor, data }
    }

    /// The arena's geometry.
    pub fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }

    /// The arena's descriptor (layout, shape, strides).
    pub fn descriptor(&self) -> &TensorDescriptor {
        &self.descriptor
    }

    /// Number of blocks the arena holds.
    pub fn num_blocks(&self) -> usize {
        self.descriptor.extent(crate::Dim::Block)
    }

    /// The `[T][H][D]` slab of keys or values of one block in one layer.
    pub fn block(&self, layer: usize, part: KvPart, block: BlockId) -> &[f32] {
        let start = self.descriptor.offset(layer, part, block.index(), 0, 0);
        &self.data[start..start + self.geometry.slab_elems()]
    }

    /// The `[H][D]` keys or values of one token slot in one layer, for writing.
    pub fn token_mut(&mut self, layer: usize, part: KvPart, block: BlockId, slot: usize) -> &mut [f32] {
        let start = self.descriptor.offset(layer, part, block.index(), slot, 0);
        &mut self.data[start..start + self.geometry.token_elems()]
    }

    /// The whole region, in descriptor order.
    pub fn as_slice(&self) -> &[f32] {
        &self.data
    }

    /// The whole region, mutable, in descriptor order.
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        &mut self.data
    }

    /// Copies every element of `src` blocks onto `dst` blocks of `other`, which may have another
    /// layout but must have the same geometry. Used to move a sequence's KV between arenas.
    pub fn copy_blocks_from(&mut self, other: &KvArena, src: &[BlockId], dst: &[BlockId]) {
        assert_eq!(self.geometry, other.geometry, "copy between arenas of different geometry");
        assert_eq!(src.len(), dst.len(), "copy needs as many destination blocks as sources");
        for (&s, &d) in src.iter().zip(dst) {
            for layer in 0..self.geometry.layers {
                for part in [KvPart::Key, KvPart::Value] {
                    let from = other.descriptor.offset(layer, part, s.index(), 0, 0);
                    let to = self.descriptor.offset(layer, part, d.index(), 0, 0);
                    let n = self.geometry.slab_elems();
                    self.data[to..to + n].copy_from_slice(&other.data[from..from + n]);
                }
            }
        }
    }
}
