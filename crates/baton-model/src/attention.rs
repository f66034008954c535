//! Paged attention on the CPU: queries attend to keys and values read through each sequence's
//! block table, one block slab at a time, with an online softmax (no `[tokens × context]`
//! score matrix is ever built). A 16-bit arena's blocks are widened to float32: once a layer
//! per step when the step's rows share them (prefill), else slice by slice as each is read.

use std::collections::HashMap;

use baton_kv::{BlockId, KvArena, KvDtype, KvGeometry, KvLayout, KvPart, Slab};

use crate::gemv::{weighted_rows_add, xwt_strided};

/// Shape of one layer's attention.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttentionShape {
    pub(crate) num_heads: usize,
    pub(crate) num_kv_heads: usize,
    pub(crate) head_dim: usize,
    /// Multiplier of `q·k`.
    pub(crate) scale: f32,
    /// Sliding window in tokens (a query at `p` sees `p - window + 1 ..= p`), or `None`.
    pub(crate) window: Option<usize>,
}

/// Where one row of the batch sits: its sequence's block table and its position.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowPos<'a> {
    pub(crate) blocks: &'a [BlockId],
    pub(crate) pos: usize,
}

/// Causal attention of every row of `q` (`[rows][num_heads][head_dim]`, RoPE applied) over the
/// keys and values of positions `..= pos` of its own sequence, which must already be in `kv`.
/// With `widening` (a 16-bit arena, see [`Widening::plan`]), the blocks rows share are widened
/// once into a float32 copy first, and the rows that read only those attend over the copy.
pub(crate) fn paged_attention(
    q: &[f32],
    rows: &[RowPos<'_>],
    kv: &KvArena,
    layer: usize,
    shape: AttentionShape,
    widening: Option<&Widening>,
) -> Vec<f32> {
    // Work too small to share runs on this thread: handing it to the pool (a heap-allocated job
    // a task, threads woken) costs more than the work, once a layer a step — unless the pool's
    // threads are kept awake through the step, when a few microseconds are worth sharing.
    let work = rows.iter().map(|r| r.pos + 1).sum::<usize>() * shape.num_heads * shape.head_dim;
    let tasks = rows.len() * shape.num_kv_heads;
    let parallel = tasks > 1 && (work >= PARALLEL_WORK || crate::pool::threads_awake());
    attend_rows(q, rows, kv, layer, shape, widening, parallel)
}

/// Query-key products (positions × heads × head dimension) below which a layer's attention
/// runs on the calling thread, unless the pool's threads are kept awake.
const PARALLEL_WORK: usize = 1 << 16;

/// [`paged_attention`], its (row, kv head) tasks shared with the pool's threads
/// ([`crate::pool::for_each_chunk`]) or in turn on this thread.
fn attend_rows(
    q: &[f32],
    rows: &[RowPos<'_>],
    kv: &KvArena,
    layer: usize,
    shape: AttentionShape,
    widening: Option<&Widening>,
    parallel: bool,
) -> Vec<f32> {
    let AttentionShape { num_heads, num_kv_heads, head_dim, .. } = shape;
    let group = num_heads / num_kv_heads;
    let wide = widening.map(|w| (widen_layer(kv, layer, &w.order), w));
    let mut out = vec![0.0; q.len()];
    // One task per (row, kv head): the group of query heads sharing that kv head is contiguous
    // in both `q` and `out`, so each key and value is loaded once for the whole group.
    let task = |(task, out): (usize, &mut [f32])| {
        let (row, kv_head) = (task / num_kv_heads, task % num_kv_heads);
        let q_start = (row * num_heads + kv_head * group) * head_dim;
        let q = &q[q_start..q_start + group * head_dim];
        match wide.as_ref().and_then(|(copy, w)| Some((copy, w.tables[row].as_deref()?))) {
            Some((copy, blocks)) => {
                attend_group(q, out, RowPos { blocks, pos: rows[row].pos }, copy, 0, kv_head, shape);
            }
            None => attend_group(q, out, rows[row], kv, layer, kv_head, shape),
        }
    };
    if parallel {
        crate::pool::for_each_chunk(&mut out, group * head_dim, || (), |_, i, piece| task((i, piece)));
    } else {
        out.chunks_mut(group * head_dim).enumerate().for_each(task);
    }
    out
}

/// How a step over a 16-bit arena widens the blocks its rows share: each such block once a
/// layer, into a float32 copy. Planned once a step, used by every layer.
#[derive(Debug)]
pub(crate) struct Widening {
    /// The blocks to widen, each once, in first-read order: those read by rows whose every
    /// block (positions `..= pos`) another row reads too.
    order: Vec<BlockId>,
    /// Per row: its block table in the copy (`order`'s indices) when it reads only shared
    /// blocks, else `None` (it widens the slices it reads as it goes).
    tables: Vec<Option<Vec<BlockId>>>,
}

impl Widening {
    /// The plan for `rows` over `kv`, or `None` (a float32 arena is read in place; rows that
    /// share nothing, as in decode, widen as they read, in cache, which costs less than writing
    /// and reading a copy). The copy holds only blocks read at least twice this step, so a step
    /// of many decode rows beside a prefill chunk copies no decode context.
    pub(crate) fn plan(rows: &[RowPos<'_>], kv: &KvArena) -> Option<Self> {
        if kv.geometry().dtype == KvDtype::F32 {
            return None;
        }
        let block_size = kv.geometry().block_size;
        let read = |r: &RowPos<'_>| r.blocks[..=r.pos / block_size].to_vec();
        let mut readers: HashMap<BlockId, usize> = HashMap::new();
        for r in rows {
            for b in read(r) {
                *readers.entry(b).or_default() += 1;
            }
        }
        let mut local: HashMap<BlockId, BlockId> = HashMap::new();
        let mut order = Vec::new();
        let tables: Vec<Option<Vec<BlockId>>> = rows
            .iter()
            .map(|r| {
                let blocks = read(r);
                blocks.iter().all(|b| readers[b] >= 2).then(|| {
                    blocks
                        .iter()
                        .map(|&b| {
                            *local.entry(b).or_insert_with(|| {
                                order.push(b);
                                BlockId(order.len() as u32 - 1)
                            })
                        })
                        .collect()
                })
            })
            .collect();
        (!order.is_empty()).then_some(Self { order, tables })
    }
}

/// The keys and values of `layer` of `blocks`, widened into a one-layer float32 arena (its
/// block `i` is `blocks[i]`).
fn widen_layer(kv: &KvArena, layer: usize, blocks: &[BlockId]) -> KvArena {
    let g = *kv.geometry();
    let one = KvGeometry { layers: 1, dtype: KvDtype::F32, ..g };
    let mut wide = KvArena::new_private(one, KvLayout::BlockMajor, blocks.len());
    let n = g.slab_elems();
    let descriptor = wide.descriptor().clone();
    let all = wide.as_mut_slice();
    for (i, &b) in blocks.iter().enumerate() {
        for part in [KvPart::Key, KvPart::Value] {
            let at = descriptor.offset(0, part, i, 0, 0);
            kv.slab(layer, part, b).rows_to_f32(0, n, 1, n, &mut all[at..at + n]);
        }
    }
    wide
}

fn attend_group(
    q: &[f32],
    out: &mut [f32],
    row: RowPos<'_>,
    kv: &KvArena,
    layer: usize,
    kv_head: usize,
    shape: AttentionShape,
) {
    let g = kv.geometry();
    let (block_size, head_dim, stride) = (g.block_size, shape.head_dim, g.token_elems());
    let group = q.len() / head_dim;
    let first = shape.window.map_or(0, |w| (row.pos + 1).saturating_sub(w));
    let mut max = vec![f32::NEG_INFINITY; group];
    let mut denom = vec![0f32; group];
    // `[token][query head]` of one block: scores, then softmax weights.
    let mut scores = vec![0f32; block_size * group];
    // A 16-bit arena's keys and values of this head, widened to float32 a block at a time.
    let widen = kv.geometry().dtype != KvDtype::F32;
    let (mut wide_keys, mut wide_values) = if widen {
        (vec![0f32; block_size * head_dim], vec![0f32; block_size * head_dim])
    } else {
        (Vec::new(), Vec::new())
    };
    let last = row.pos / block_size;
    for b in first / block_size..=last {
        // The next block's rows come from memory while this one's are worked on.
        if b < last {
            kv.prefetch_head(layer, row.blocks[b + 1], kv_head);
        }
        let lo = (b * block_size).max(first) - b * block_size;
        let hi = (row.pos + 1 - b * block_size).min(block_size);
        let n = hi - lo;
        let base = lo * stride + kv_head * head_dim;
        let (keys, values, stride) =
            match (kv.slab(layer, KvPart::Key, row.blocks[b]), kv.slab(layer, KvPart::Value, row.blocks[b])) {
                (Slab::F32(k), Slab::F32(v)) => (&k[base..], &v[base..], stride),
                (k, v) => {
                    k.rows_to_f32(base, stride, n, head_dim, &mut wide_keys);
                    v.rows_to_f32(base, stride, n, head_dim, &mut wide_values);
                    (&wide_keys[..], &wide_values[..], head_dim)
                }
            };
        let s = &mut scores[..n * group];
        xwt_strided(q, group, keys, stride, n, head_dim, s);
        for qi in 0..group {
            let mut block_max = f32::NEG_INFINITY;
            for t in 0..n {
                s[t * group + qi] *= shape.scale;
                block_max = block_max.max(s[t * group + qi]);
            }
            let new_max = max[qi].max(block_max);
            if new_max > max[qi] {
                let correction = (max[qi] - new_max).exp();
                denom[qi] *= correction;
                out[qi * head_dim..(qi + 1) * head_dim].iter_mut().for_each(|x| *x *= correction);
                max[qi] = new_max;
            }
            for t in 0..n {
                let p = (s[t * group + qi] - new_max).exp();
                s[t * group + qi] = p;
                denom[qi] += p;
            }
        }
        weighted_rows_add(out, group, s, values, stride, n, head_dim);
    }
    for (o, d) in out.chunks_exact_mut(head_dim).zip(denom) {
        let inv = 1.0 / d;
        o.iter_mut().for_each(|x| *x *= inv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 16-bit arena attends exactly as a float32 arena holding the same (widened) values,
    /// on both paths: rows sharing blocks (a prefill chunk: widened once into a copy) and rows
    /// that do not (decode: widened slice by slice).
    #[test]
    fn sixteen_bit_attention_equals_float32_over_the_same_values() {
        let (heads, kv_heads, dim, bs) = (4, 2, 8, 4);
        let shape =
            AttentionShape { num_heads: heads, num_kv_heads: kv_heads, head_dim: dim, scale: 0.3, window: None };
        for dtype in [KvDtype::F16, KvDtype::Bf16] {
            let g = KvGeometry { dtype, ..KvGeometry::new(2, kv_heads, dim, bs) };
            let mut half = KvArena::new_private(g, KvLayout::LayerMajor, 8);
            let mut full = KvArena::new_private(KvGeometry { dtype: KvDtype::F32, ..g }, KvLayout::LayerMajor, 8);
            let mut x = 0.37f32;
            for layer in 0..2 {
                for b in 0..8 {
                    for slot in 0..bs {
                        for part in [KvPart::Key, KvPart::Value] {
                            let row: Vec<f32> = (0..kv_heads * dim)
                                .map(|_| {
                                    x = (x * 3.7 + 0.11).fract();
                                    x - 0.5
                                })
                                .collect();
                            half.write_token(layer, part, BlockId(b), slot, &row);
                        }
                    }
                }
            }
            // The float32 arena holds exactly what the 16-bit one stores.
            for layer in 0..2 {
                for b in 0..8 {
                    for part in [KvPart::Key, KvPart::Value] {
                        let n = g.slab_elems();
                        let mut wide = vec![0f32; n];
                        half.slab(layer, part, BlockId(b)).rows_to_f32(0, n, 1, n, &mut wide);
                        for slot in 0..bs {
                            let t = slot * g.token_elems();
                            full.token_mut(layer, part, BlockId(b), slot)
                                .copy_from_slice(&wide[t..t + g.token_elems()]);
                        }
                    }
                }
            }
            let (seq_a, seq_b) = ([BlockId(3), BlockId(0), BlockId(6)], [BlockId(5), BlockId(1)]);
            let prefill: Vec<RowPos<'_>> = (5..11).map(|pos| RowPos { blocks: &seq_a, pos }).collect();
            let decode = [RowPos { blocks: &seq_a, pos: 10 }, RowPos { blocks: &seq_b, pos: 6 }];
            let mut mixed = prefill.clone();
            mixed.push(RowPos { blocks: &seq_b, pos: 6 });
            for rows in [&prefill[..], &decode[..], &mixed[..]] {
                let q: Vec<f32> = (0..rows.len() * heads * dim).map(|i| ((i * 7 % 13) as f32 - 6.0) / 6.0).collect();
                for layer in 0..2 {
                    let plan = Widening::plan(rows, &half);
                    assert_eq!(plan.is_some(), rows.len() > 2, "prefill rows share blocks, decode rows do not");
                    if let Some(p) = &plan {
                        // Every block of seq_a is read by several prefill rows; seq_b's decode
                        // row (in the mixed step) shares nothing and widens as it reads.
                        let copied: Vec<bool> = p.tables.iter().map(Option::is_some).collect();
                        let want: Vec<bool> = rows.iter().map(|r| r.blocks == seq_a).collect();
                        assert_eq!(copied, want);
                    }
                    let attended = paged_attention(&q, rows, &half, layer, shape, plan.as_ref());
                    assert_eq!(
                        attended,
                        paged_attention(&q, rows, &full, layer, shape, None),
                        "{dtype:?}, {} rows, layer {layer}",
                        rows.len()
                    );
                    // On rayon's pool or on this thread (small work), the same result.
                    for parallel in [false, true] {
                        let other = attend_rows(&q, rows, &half, layer, shape, plan.as_ref(), parallel);
                        assert_eq!(attended, other, "parallel {parallel}");
                    }
                }
            }
        }
    }
}
