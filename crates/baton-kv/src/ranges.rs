//! Block ids to byte ranges: the address arithmetic the transfer planner builds on.
//!
//! A block occupies, in any layout, a set of equally long contiguous chunks: the innermost
//! dimensions that are dense form one chunk, and every other non-block dimension multiplies the
//! number of chunks. Block-major (`[blocks][L][2][T][H][D]`) gives one chunk per block, and
//! consecutive ids merge into one range; layer-major gives `2·L` chunks per block, and
//! consecutive ids merge within each (layer, key/value) slab.

use crate::{BlockId, Dim, TensorDescriptor};

/// A contiguous byte range of a region: `[offset, offset + len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ByteRange {
    /// First byte, from the start of the region.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

impl ByteRange {
    /// One past the last byte.
    pub fn end(&self) -> usize {
        self.offset + self.len
    }
}

impl TensorDescriptor {
    /// Elements in one contiguous chunk of a block, and the positions (in `dims` order) of the
    /// non-block dimensions outside that chunk.
    fn chunking(&self) -> (usize, Vec<usize>) {
        let mut run = 1;
        let mut k = 6;
        while k > 0 && self.dims[k - 1] != Dim::Block && self.strides[k - 1] == run {
            run *= self.shape[k - 1];
            k -= 1;
        }
        let outer = (0..k).filter(|&i| self.dims[i] != Dim::Block).collect();
        (run, outer)
    }

    /// Contiguous chunks per block (1 in block-major, `2·L` in layer-major).
    pub fn chunks_per_block(&self) -> usize {
        let (_, outer) = self.chunking();
        outer.iter().map(|&i| self.shape[i]).product()
    }

    /// Byte ranges the given blocks occupy, base offset included.
    ///
    /// Order: for each combination of the dimensions outside a contiguous chunk (outermost
    /// first; none in block-major), the blocks in list order. Neighbouring ranges in that order
    /// that touch are merged, so consecutive ids in a block-major arena come out as one range.
    /// The ranges of one block alone come out in its canonical `[L][2][T][H][D]` order in both
    /// built-in layouts. The union of the ranges is exactly the bytes of the listed blocks.
    pub fn byte_ranges(&self, blocks: &[BlockId]) -> Vec<ByteRange> {
        let (run, outer) = self.chunking();
        let chunk = run * self.elem_size;
        let block_stride = self.stride(Dim::Block) * self.elem_size;
        let combos: usize = outer.iter().map(|&i| self.shape[i]).product();
        let mut out: Vec<ByteRange> = Vec::with_capacity(combos.min(64) * blocks.len().min(64));
        let mut idx = vec![0usize; outer.len()];
        for _ in 0..combos {
            let base =
                self.base + outer.iter().zip(&idx).map(|(&i, &x)| x * self.strides[i]).sum::<usize>() * self.elem_size;
            for b in blocks {
                let offset = base + b.index() * block_stride;
                match out.last_mut() {
                    Some(last) if last.end() == offset => last.len += chunk,
                    _ => out.push(ByteRange { offset, len: chunk }),
                }
            }
            // Next combination, innermost outer dimension fastest.
            for j in (0..outer.len()).rev() {
                idx[j] += 1;
                if idx[j] < self.shape[outer[j]] {
                    break;
                }
                idx[j] = 0;
            }
        }
        out
    }

    /// Bytes the whole tensor spans from its base.
    pub fn num_bytes(&self) -> usize {
        self.num_elems() * self.elem_size
    }
}

#[cfg(test)]
mod tests {
    use crate::{BlockId, KvGeometry, KvLayout, KvPart, TensorDescriptor};
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    fn ids(v: &[u32]) -> Vec<BlockId> {
        v.iter().copied().map(BlockId).collect()
    }

    #[test]
    fn block_major_consecutive_ids_are_one_range() {
        let g = KvGeometry::new(3, 2, 4, 5);
        let d = TensorDescriptor::new(&g, KvLayout::BlockMajor, 10);
        let bytes = g.block_elems() * 4;
        let r = d.byte_ranges(&ids(&[2, 3, 4, 8]));
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].offset, r[0].len), (2 * bytes, 3 * bytes));
        assert_eq!((r[1].offset, r[1].len), (8 * bytes, bytes));
    }

    #[test]
    fn layer_major_block_is_two_l_ranges() {
        let g = KvGeometry::new(3, 2, 4, 5);
        let d = TensorDescriptor::new(&g, KvLayout::LayerMajor, 10);
        assert_eq!(d.chunks_per_block(), 6);
        assert_eq!(d.byte_ranges(&ids(&[7])).len(), 6);
        assert_eq!(d.byte_ranges(&ids(&[7, 8])).len(), 6, "neighbours merge within each slab");
        let first = d.byte_ranges(&ids(&[7]))[1];
        assert_eq!(first.offset, d.offset(0, KvPart::Value, 7, 0, 0) * 4);
    }

    proptest! {
        /// The ranges cover exactly the bytes of the listed blocks, computed element by element
        /// through `offset`, and never more than `2·L` ranges per block.
        #[test]
        fn ranges_cover_exactly_the_blocks(
            layers in 1usize..4, heads in 1usize..3, dim in 1usize..4, bs in 1usize..4,
            block_major in any::<bool>(), base in 0usize..64,
            blocks in proptest::collection::btree_set(0u32..12, 0..8),
            shuffle in any::<u64>(),
        ) {
            let g = KvGeometry::new(layers, heads, dim, bs);
            let layout = if block_major { KvLayout::BlockMajor } else { KvLayout::LayerMajor };
            let mut d = TensorDescriptor::new(&g, layout, 12);
            d.base = base;
            let mut list: Vec<BlockId> = blocks.iter().copied().map(BlockId).collect();
            let n = list.len();
            if n > 1 { list.rotate_left((shuffle as usize) % n); }
            let ranges = d.byte_ranges(&list);
            let mut got = BTreeSet::new();
            for r in &ranges {
                for byte in r.offset..r.end() { prop_assert!(got.insert(byte), "ranges overlap at {}", byte); }
            }
            let mut want = BTreeSet::new();
            for b in &list {
                for l in 0..layers { for part in [KvPart::Key, KvPart::Value] {
                    for t in 0..bs { for h in 0..heads { for x in 0..dim {
                        let e = d.offset(l, part, b.index(), t, h) + x;
                        for k in 0..4 { want.insert(base + e * 4 + k); }
                    }}}
                }}
            }
            prop_assert_eq!(got, want);
            prop_assert!(ranges.len() <= n * d.chunks_per_block());
            if block_major && n > 0 {
                prop_assert_eq!(ranges.len(), crate::count_runs(&list));
            }
        }
    }
}
