//! The transfer planner, pure: two descriptors and two block lists in, byte-range copies out.
//!
//! Block `src_blocks[i]` of the source goes to block `dst_blocks[i]` of the destination: every
//! element `[layer][k/v][token][head][x]` of the one lands on the same element of the other,
//! whatever either layout. The planner walks each block pair in *granules* — the largest
//! suffix of the canonical order `[L][2][T][H][D]` that is contiguous on both sides (a whole
//! block between two block-major arenas, one `[T][H][D]` slab when either side is layer-major)
//! — then sorts the granules by source offset and merges neighbours that are contiguous on
//! **both** sides (KVDirect §4.2's coalescing). The copies are therefore the maximal runs of
//! the byte mapping: no plan with fewer ranges exists.

use std::ops::Range;

use baton_kv::{BlockId, ByteRange, Dim, TensorDescriptor};

/// One contiguous copy: `src.len == dst.len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RangeCopy {
    /// Bytes of the source region.
    pub src: ByteRange,
    /// Bytes of the destination region.
    pub dst: ByteRange,
}

/// The copies of one transfer, sorted by source offset.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TransferPlan {
    /// The copies.
    pub copies: Vec<RangeCopy>,
}

impl TransferPlan {
    /// Bytes moved.
    pub fn bytes(&self) -> usize {
        self.copies.iter().map(|c| c.src.len).sum()
    }

    /// Number of copies (contiguous runs on both sides).
    pub fn len(&self) -> usize {
        self.copies.len()
    }

    /// Whether nothing is to be copied.
    pub fn is_empty(&self) -> bool {
        self.copies.is_empty()
    }
}

/// Why two block lists cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The descriptors describe different geometries or element sizes.
    #[error("descriptors disagree on {what}: {src} (source) vs {dst} (destination)")]
    Shape {
        /// Which extent.
        what: &'static str,
        /// Source value.
        src: usize,
        /// Destination value.
        dst: usize,
    },
    /// The lists differ in length.
    #[error("{src} source blocks but {dst} destination blocks")]
    Lengths {
        /// Source count.
        src: usize,
        /// Destination count.
        dst: usize,
    },
    /// A block id is beyond its tensor.
    #[error("{side} block {block} is outside a tensor of {blocks} blocks")]
    OutOfRange {
        /// "source" or "destination".
        side: &'static str,
        /// The id.
        block: BlockId,
        /// Blocks in the tensor.
        blocks: usize,
    },
    /// A block appears twice in one list.
    #[error("{side} block {block} is listed twice")]
    Duplicate {
        /// "source" or "destination".
        side: &'static str,
        /// The id.
        block: BlockId,
    },
    /// The layer range is empty-ended or past the last layer.
    #[error("layers {start}..{end} are not within 0..{layers}")]
    Layers {
        /// Start.
        start: usize,
        /// End.
        end: usize,
        /// Layers of the geometry.
        layers: usize,
    },
}

/// The canonical order of one block's elements.
const CANON: [Dim; 5] = [Dim::Layer, Dim::Kv, Dim::Token, Dim::Head, Dim::HeadDim];

/// Plans copying every layer of `src_blocks` (of `src`) onto `dst_blocks` (of `dst`).
pub fn plan(
    src: &TensorDescriptor,
    src_blocks: &[BlockId],
    dst: &TensorDescriptor,
    dst_blocks: &[BlockId],
) -> Result<TransferPlan, PlanError> {
    plan_layers(src, src_blocks, dst, dst_blocks, 0..src.extent(Dim::Layer))
}

/// Like [`plan`], for the layers in `layers` only (push mode writes layer by layer).
pub fn plan_layers(
    src: &TensorDescriptor,
    src_blocks: &[BlockId],
    dst: &TensorDescriptor,
    dst_blocks: &[BlockId],
    layers: Range<usize>,
) -> Result<TransferPlan, PlanError> {
    validate(src, src_blocks, dst, dst_blocks, &layers)?;
    if layers.is_empty() || src_blocks.is_empty() {
        return Ok(TransferPlan::default());
    }
    let all_layers = layers.len() == src.extent(Dim::Layer);
    // Granule: the common contiguous suffix of the canonical order, not spanning layers when
    // only some are copied.
    let mut suffix = contiguous_suffix(src).min(contiguous_suffix(dst));
    if !all_layers {
        suffix = suffix.min(CANON.len() - 1);
    }
    let outer = &CANON[..CANON.len() - suffix];
    let granule_elems: usize = CANON[CANON.len() - suffix..].iter().map(|&d| src.extent(d)).product();
    let granule = granule_elems * src.elem_size;
    let extents: Vec<Range<usize>> =
        outer.iter().map(|&d| if d == Dim::Layer { layers.clone() } else { 0..src.extent(d) }).collect();
    let per_block: usize = extents.iter().map(|r| r.len()).product();

    let mut granules: Vec<(usize, usize)> = Vec::with_capacity(per_block * src_blocks.len());
    let mut idx: Vec<usize> = extents.iter().map(|r| r.start).collect();
    for (&s, &d) in src_blocks.iter().zip(dst_blocks) {
        idx.iter_mut().zip(&extents).for_each(|(i, r)| *i = r.start);
        for _ in 0..per_block {
            let offset = |desc: &TensorDescriptor, block: BlockId| {
                let elems = block.index() * desc.stride(Dim::Block)
                    + outer.iter().zip(&idx).map(|(&dim, &i)| i * desc.stride(dim)).sum::<usize>();
                desc.base + elems * desc.elem_size
            };
            granules.push((offset(src, s), offset(dst, d)));
            for j in (0..idx.len()).rev() {
                idx[j] += 1;
                if idx[j] < extents[j].end {
                    break;
                }
                idx[j] = extents[j].start;
            }
        }
    }
    granules.sort_unstable();
    let mut copies: Vec<RangeCopy> = Vec::new();
    for (s, d) in granules {
        match copies.last_mut() {
            Some(last) if last.src.end() == s && last.dst.end() == d => {
                last.src.len += granule;
                last.dst.len += granule;
            }
            _ => copies.push(RangeCopy {
                src: ByteRange { offset: s, len: granule },
                dst: ByteRange { offset: d, len: granule },
            }),
        }
    }
    Ok(TransferPlan { copies })
}

/// Number of innermost canonical dimensions that are dense in `desc` (0 to 5).
fn contiguous_suffix(desc: &TensorDescriptor) -> usize {
    let mut run = 1;
    let mut k = 0;
    for &dim in CANON.iter().rev() {
        let n = desc.extent(dim);
        if n != 1 && desc.stride(dim) != run {
            break;
        }
        run *= n;
        k += 1;
    }
    k
}

fn validate(
    src: &TensorDescriptor,
    src_blocks: &[BlockId],
    dst: &TensorDescriptor,
    dst_blocks: &[BlockId],
    layers: &Range<usize>,
) -> Result<(), PlanError> {
    for (what, dim) in [
        ("layers", Dim::Layer),
        ("k/v", Dim::Kv),
        ("block size", Dim::Token),
        ("kv heads", Dim::Head),
        ("head dim", Dim::HeadDim),
    ] {
        if src.extent(dim) != dst.extent(dim) {
            return Err(PlanError::Shape { what, src: src.extent(dim), dst: dst.extent(dim) });
        }
    }
    if src.elem_size != dst.elem_size {
        return Err(PlanError::Shape { what: "element size", src: src.elem_size, dst: dst.elem_size });
    }
    if src_blocks.len() != dst_blocks.len() {
        return Err(PlanError::Lengths { src: src_blocks.len(), dst: dst_blocks.len() });
    }
    let n = src.extent(Dim::Layer);
    if layers.start > layers.end || layers.end > n {
        return Err(PlanError::Layers { start: layers.start, end: layers.end, layers: n });
    }
    for (side, desc, blocks) in [("source", src, src_blocks), ("destination", dst, dst_blocks)] {
        let total = desc.extent(Dim::Block);
        let mut seen = vec![false; total];
        for &b in blocks {
            let slot = seen.get_mut(b.index()).ok_or(PlanError::OutOfRange { side, block: b, blocks: total })?;
            if std::mem::replace(slot, true) {
                return Err(PlanError::Duplicate { side, block: b });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_kv::{KvGeometry, KvLayout, KvPart};
    use proptest::prelude::*;

    fn ids(v: &[u32]) -> Vec<BlockId> {
        v.iter().copied().map(BlockId).collect()
    }

    fn geometry() -> KvGeometry {
        KvGeometry::new(3, 2, 4, 5)
    }

    #[test]
    fn block_major_runs_on_both_sides_are_one_copy() {
        let g = geometry();
        let s = TensorDescriptor::new(&g, KvLayout::BlockMajor, 16);
        let d = TensorDescriptor::new(&g, KvLayout::BlockMajor, 16);
        let p = plan(&s, &ids(&[2, 3, 4, 9]), &d, &ids(&[10, 11, 12, 13])).expect("plan");
        assert_eq!(p.len(), 2, "2,3,4 → 10,11,12 is one run; 9 → 13 breaks the source run");
        assert_eq!(p.bytes(), 4 * g.block_elems() * 4);
    }

    #[test]
    fn layer_major_to_block_major_is_one_copy_per_slab() {
        let g = geometry();
        let s = TensorDescriptor::new(&g, KvLayout::LayerMajor, 8);
        let d = TensorDescriptor::new(&g, KvLayout::BlockMajor, 8);
        let p = plan(&s, &ids(&[0, 1]), &d, &ids(&[0, 1])).expect("plan");
        assert_eq!(p.len(), 2 * 2 * 3);
        let first = p.copies.iter().find(|c| c.src.offset == s.offset(1, KvPart::Value, 1, 0, 0) * 4);
        assert_eq!(first.map(|c| c.dst.offset), Some(d.offset(1, KvPart::Value, 1, 0, 0) * 4));
    }

    #[test]
    fn layer_major_both_sides_merges_across_blocks() {
        let g = geometry();
        let s = TensorDescriptor::new(&g, KvLayout::LayerMajor, 8);
        let d = TensorDescriptor::new(&g, KvLayout::LayerMajor, 8);
        assert_eq!(plan(&s, &ids(&[3, 4, 5]), &d, &ids(&[0, 1, 2])).expect("plan").len(), 2 * 3);
    }

    #[test]
    fn layer_subset_never_spans_other_layers() {
        let g = geometry();
        let s = TensorDescriptor::new(&g, KvLayout::BlockMajor, 8);
        let p = plan_layers(&s, &ids(&[0, 1]), &s.clone(), &ids(&[4, 5]), 1..2).expect("plan");
        assert_eq!(p.bytes(), 2 * 2 * g.slab_elems() * 4);
        assert_eq!(p.len(), 2);
    }

    #[test]
    fn bad_inputs_are_errors() {
        let g = geometry();
        let s = TensorDescriptor::new(&g, KvLayout::BlockMajor, 4);
        let other = TensorDescriptor::new(&KvGeometry::new(3, 2, 4, 8), KvLayout::BlockMajor, 4);
        assert!(matches!(plan(&s, &ids(&[0]), &other, &ids(&[0])), Err(PlanError::Shape { .. })));
        assert!(matches!(plan(&s, &ids(&[0, 1]), &s, &ids(&[0])), Err(PlanError::Lengths { .. })));
        assert!(matches!(plan(&s, &ids(&[4]), &s, &ids(&[0])), Err(PlanError::OutOfRange { .. })));
        assert!(matches!(plan(&s, &ids(&[0, 1]), &s, &ids(&[2, 2])), Err(PlanError::Duplicate { .. })));
    }

    /// A dense descriptor with the block dimension at `block_pos` among the canonical order,
    /// optionally with heads and tokens swapped (a layout neither built-in one has).
    fn descriptor(g: &KvGeometry, blocks: usize, block_pos: usize, swap_th: bool, base: usize) -> TensorDescriptor {
        let mut order: Vec<Dim> = CANON.to_vec();
        if swap_th {
            order.swap(2, 3);
        }
        order.insert(block_pos, Dim::Block);
        let dims: [Dim; 6] = [order[0], order[1], order[2], order[3], order[4], order[5]];
        TensorDescriptor { elem_size: 2, base, ..TensorDescriptor::dense(g, dims, blocks) }
    }

    fn layout() -> impl Strategy<Value = (usize, bool)> {
        (0usize..4, proptest::bool::weighted(0.2))
    }

    proptest! {
        /// Every byte of the source blocks lands on the right destination byte, nothing else in
        /// the destination changes, and the plan has exactly as many copies as the byte mapping
        /// has maximal runs (so it is minimal).
        #[test]
        fn copies_are_exact_and_minimal(
            layers in 1usize..4, heads in 1usize..3, dim in 1usize..4, bs in 1usize..4,
            src_layout in layout(), dst_layout in layout(),
            src_base in 0usize..8, dst_base in 0usize..8,
            pairs in proptest::collection::vec((0u32..10, 0u32..10), 0..8),
            runs in any::<bool>(),
            layer_cut in 0usize..4,
        ) {
            let mut g = KvGeometry::new(layers, heads, dim, bs);
            g.dtype = baton_kv::KvDtype::F16;
            let (blocks_s, blocks_d) = (12, 10);
            let s = descriptor(&g, blocks_s, src_layout.0, src_layout.1, src_base);
            let d = descriptor(&g, blocks_d, dst_layout.0, dst_layout.1, dst_base);
            // Distinct ids; with `runs`, consecutive on both sides (the coalescing case).
            let (mut sb, mut db) = (Vec::new(), Vec::new());
            for (i, (a, b)) in pairs.iter().enumerate() {
                let (a, b) = if runs { (i as u32 + 2, i as u32 + 1) } else { (*a, *b) };
                if !sb.contains(&BlockId(a)) && !db.contains(&BlockId(b)) {
                    sb.push(BlockId(a));
                    db.push(BlockId(b));
                }
            }
            let layer_range = if layer_cut > 0 && layer_cut < layers { layer_cut - 1..layer_cut + 1 } else { 0..layers };
            let p = plan_layers(&s, &sb, &d, &db, layer_range.clone()).expect("plan");

            let src_len = s.base + s.num_bytes();
            let dst_len = d.base + d.num_bytes();
            let src: Vec<u8> = (0..src_len).map(|i| (i * 131 % 251) as u8).collect();
            let mut dst = vec![0xEEu8; dst_len];
            let mut written = vec![false; dst_len];
            for c in &p.copies {
                prop_assert_eq!(c.src.len, c.dst.len);
                dst[c.dst.offset..c.dst.end()].copy_from_slice(&src[c.src.offset..c.src.end()]);
                for w in &mut written[c.dst.offset..c.dst.end()] {
                    prop_assert!(!*w, "two copies write one byte");
                    *w = true;
                }
            }
            // The mapping, byte by byte.
            let mut mapping = Vec::new();
            for (&a, &b) in sb.iter().zip(&db) {
                for l in layer_range.clone() { for part in [KvPart::Key, KvPart::Value] {
                    for t in 0..bs { for h in 0..heads { for x in 0..dim {
                        let se = s.offset(l, part, a.index(), t, h) + x;
                        let de = d.offset(l, part, b.index(), t, h) + x;
                        for k in 0..2 { mapping.push((s.base + se * 2 + k, d.base + de * 2 + k)); }
                    }}}
                }}
            }
            let mut expected_written = vec![false; dst_len];
            for &(sbyte, dbyte) in &mapping {
                prop_assert_eq!(dst[dbyte], src[sbyte]);
                expected_written[dbyte] = true;
            }
            prop_assert_eq!(&written, &expected_written, "a byte outside the destination blocks was touched");
            for (i, w) in expected_written.iter().enumerate() {
                if !w { prop_assert_eq!(dst[i], 0xEE); }
            }
            mapping.sort_unstable();
            let runs_count = mapping.windows(2).filter(|w| !(w[1].0 == w[0].0 + 1 && w[1].1 == w[0].1 + 1)).count()
                + usize::from(!mapping.is_empty());
            prop_assert_eq!(p.len(), runs_count);
        }
    }
}
