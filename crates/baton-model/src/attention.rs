//! Paged attention on the CPU: queries attend to keys and values read through each sequence's
//! block table, one block slab at a time, with an online softmax (no `[tokens × context]`
//! score matrix is ever built). A 16-bit arena's blocks are widened to float32: once a layer
//! per step when the step's rows share them (prefill), else slice by slice as each is read.
//!
//! A row's result does not depend on its batch: its context is always cut into the same
//! pieces — runs of [`PIECE_BLOCKS`] blocks from the first block it sees, a function of its
//! position and window alone — each attended with its own online softmax and merged in order
//! ([`merge_pieces`]), whether the pieces run one after the other on one thread (many rows:
//! prefill, big decode batches) or spread over the pool's threads (few rows, long contexts),
//! whatever the number of threads. So the same row sums and rounds the same way alone, beside a
//! prefill chunk, or in a decode batch of 32.

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
    // One task shares its pieces when its context is long (Gemma 3's one KV head).
    let block_size = kv.geometry().block_size;
    let shares = tasks > 1 || rows.iter().any(|r| pieces_of(r.pos, shape.window, block_size) > 1);
    let parallel = shares && (work >= PARALLEL_WORK || crate::pool::threads_awake());
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
    // Where row `r` reads: the widened copy where it reads only shared blocks, else the arena.
    let context = |r: usize| match wide.as_ref().and_then(|(copy, w)| Some((copy, w.tables[r].as_deref()?))) {
        Some((copy, blocks)) => Context { row: RowPos { blocks, pos: rows[r].pos }, kv: copy, layer: 0 },
        None => Context { row: rows[r], kv, layer },
    };
    // One task per (row, kv head): the group of query heads sharing that kv head is contiguous
    // in both `q` and `out`, so each key and value is loaded once for the whole group. A
    // task's row, kv head and query group:
    let of_task = |task: usize| {
        let (row, kv_head) = (task / num_kv_heads, task % num_kv_heads);
        let q_start = (row * num_heads + kv_head * group) * head_dim;
        (row, kv_head, &q[q_start..q_start + group * head_dim])
    };
    let block_size = kv.geometry().block_size;
    let width = group * head_dim + 2 * group;
    // Piece `piece` of a task's context into `part` (`[outputs | maxima | sums]`, see
    // [`merge_pieces`]).
    let attend_piece = |task: usize, piece: usize, part: &mut [f32]| {
        let (row, kv_head, q) = of_task(task);
        let (o, rest) = part.split_at_mut(group * head_dim);
        let (max, denom) = rest.split_at_mut(group);
        o.fill(0.0);
        max.fill(f32::NEG_INFINITY);
        denom.fill(0.0);
        let blocks = piece_blocks(rows[row].pos, shape.window, block_size, piece);
        attend_blocks(q, o, context(row), kv_head, shape, blocks, (max, denom));
    };
    // A whole task: its one piece normalized, or its pieces in turn, merged.
    let task = |(task, out): (usize, &mut [f32])| {
        let (row, kv_head, q) = of_task(task);
        let pieces = pieces_of(rows[row].pos, shape.window, block_size);
        if pieces == 1 {
            attend_group(q, out, context(row), kv_head, shape);
            return;
        }
        let mut parts = vec![0f32; pieces * width];
        for (piece, part) in parts.chunks_exact_mut(width).enumerate() {
            attend_piece(task, piece, part);
        }
        merge_pieces(&parts, out, group, head_dim);
    };
    let tasks = rows.len() * num_kv_heads;
    // Where each task's pieces start in the list of all tasks' pieces.
    let mut first_piece = Vec::with_capacity(tasks + 1);
    first_piece.push(0);
    for t in 0..tasks {
        let row = &rows[t / num_kv_heads];
        first_piece.push(first_piece[t] + pieces_of(row.pos, shape.window, block_size));
    }
    let all_pieces = first_piece[tasks];
    if parallel && tasks < 2 * rayon::current_num_threads() && all_pieces > tasks {
        // Few tasks over long contexts (a decode step of one or two rows): their pieces are
        // shared between the threads (SmolLM2's three kv heads on two threads would leave one
        // thread idle half the time), then each task's merged as on one thread.
        let mut parts = vec![0f32; all_pieces * width];
        crate::pool::for_each_chunk(
            &mut parts,
            width,
            || (),
            |_, i, part| {
                let task = first_piece.partition_point(|&f| f <= i) - 1;
                if first_piece[task + 1] - first_piece[task] > 1 {
                    attend_piece(task, i - first_piece[task], part);
                }
            },
        );
        for (t, out) in out.chunks_exact_mut(group * head_dim).enumerate() {
            let pieces = &parts[first_piece[t] * width..first_piece[t + 1] * width];
            if pieces.len() == width {
                // A short context: whole, as `task` attends it.
                task((t, out));
            } else {
                merge_pieces(pieces, out, group, head_dim);
            }
        }
    } else if parallel {
        crate::pool::for_each_chunk(&mut out, group * head_dim, || (), |_, i, piece| task((i, piece)));
    } else {
        out.chunks_mut(group * head_dim).enumerate().for_each(task);
    }
    out
}

/// Blocks a piece of a row's context spans (see the module's docs): every row's context is
/// cut alike, alone or batched, on one thread or several.
pub(crate) const PIECE_BLOCKS: usize = 8;

/// How many pieces of [`PIECE_BLOCKS`] the context of a query at `pos` is cut into.
fn pieces_of(pos: usize, window: Option<usize>, block_size: usize) -> usize {
    seen_blocks(pos, window, block_size).len().div_ceil(PIECE_BLOCKS)
}

/// The blocks of piece `piece` of the context of a query at `pos`.
fn piece_blocks(pos: usize, window: Option<usize>, block_size: usize, piece: usize) -> std::ops::Range<usize> {
    let seen = seen_blocks(pos, window, block_size);
    let start = seen.start + piece * PIECE_BLOCKS;
    start..(start + PIECE_BLOCKS).min(seen.end)
}

/// The blocks of its table a query at `pos` reads: from the one holding the window's first
/// position (or the first) to the one holding `pos`.
fn seen_blocks(pos: usize, window: Option<usize>, block_size: usize) -> std::ops::Range<usize> {
    let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
    first / block_size..pos / block_size + 1
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

/// Where a row's keys and values are read: its position and block table in `kv`'s `layer`.
#[derive(Clone, Copy)]
struct Context<'a> {
    row: RowPos<'a>,
    kv: &'a KvArena,
    layer: usize,
}

/// The query heads `q` (`[group][head_dim]`) that share kv head `kv_head` attending over
/// positions `..= pos` of the row's sequence, into `out` (zeroed).
fn attend_group(q: &[f32], out: &mut [f32], at: Context<'_>, kv_head: usize, shape: AttentionShape) {
    let group = q.len() / shape.head_dim;
    let (mut max, mut denom) = (vec![f32::NEG_INFINITY; group], vec![0f32; group]);
    let blocks = seen_blocks(at.row.pos, shape.window, at.kv.geometry().block_size);
    attend_blocks(q, out, at, kv_head, shape, blocks, (&mut max, &mut denom));
    for (o, d) in out.chunks_exact_mut(shape.head_dim).zip(denom) {
        let inv = 1.0 / d;
        o.iter_mut().for_each(|x| *x *= inv);
    }
}

/// [`attend_group`] over the blocks `blocks` of `row`'s table only (those of [`seen_blocks`]
/// among them, and the positions of them it sees), unnormalized: `out` gathers the values weighted by `exp(score − max)`, and `max`
/// and `denom` (per query head, `-inf` and 0 to start) the running maximum and sum of those
/// weights, as an online softmax carries them. Pieces of a context over disjoint blocks
/// combine ([`merge_pieces`]).
fn attend_blocks(
    q: &[f32],
    out: &mut [f32],
    Context { row, kv, layer }: Context<'_>,
    kv_head: usize,
    shape: AttentionShape,
    blocks: std::ops::Range<usize>,
    (max, denom): (&mut [f32], &mut [f32]),
) {
    let g = kv.geometry();
    let (block_size, head_dim, stride) = (g.block_size, shape.head_dim, g.token_elems());
    let group = q.len() / head_dim;
    let first = shape.window.map_or(0, |w| (row.pos + 1).saturating_sub(w));
    // `[token][query head]` of one block: scores, then softmax weights.
    let mut scores = vec![0f32; block_size * group];
    // A 16-bit arena's keys and values of this head, widened to float32 a block at a time.
    let widen = kv.geometry().dtype != KvDtype::F32;
    let (mut wide_keys, mut wide_values) = if widen {
        (vec![0f32; block_size * head_dim], vec![0f32; block_size * head_dim])
    } else {
        (Vec::new(), Vec::new())
    };
    let last = (row.pos / block_size).min(blocks.end.saturating_sub(1));
    for b in (first / block_size).max(blocks.start)..=last {
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
}

/// Combines [`attend_blocks`] pieces of one (row, kv head) over disjoint blocks, each
/// `[group·head_dim outputs | group maxima | group sums]`, into `out` (`[group][head_dim]`),
/// normalized.
fn merge_pieces(pieces: &[f32], out: &mut [f32], group: usize, head_dim: usize) {
    let width = group * head_dim + 2 * group;
    out.fill(0.0);
    for qi in 0..group {
        let max = pieces.chunks_exact(width).map(|p| p[group * head_dim + qi]).fold(f32::NEG_INFINITY, f32::max);
        let mut denom = 0f32;
        let o = &mut out[qi * head_dim..(qi + 1) * head_dim];
        for p in pieces.chunks_exact(width) {
            let (m, d) = (p[group * head_dim + qi], p[group * head_dim + group + qi]);
            if d == 0.0 {
                continue;
            }
            let w = (m - max).exp();
            denom += d * w;
            o.iter_mut().zip(&p[qi * head_dim..(qi + 1) * head_dim]).for_each(|(o, v)| *o += v * w);
        }
        let inv = 1.0 / denom;
        o.iter_mut().for_each(|x| *x *= inv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes pseudo-random keys and values in `(-0.5, 0.5)` into every slot of blocks
    /// `0..blocks` of every layer of `kv`, from `seed`.
    fn fill(kv: &mut KvArena, blocks: u32, seed: f32) {
        let g = *kv.geometry();
        let mut x = seed;
        for layer in 0..g.layers {
            for b in 0..blocks {
                for slot in 0..g.block_size {
                    for part in [KvPart::Key, KvPart::Value] {
                        let row: Vec<f32> = (0..g.token_elems())
                            .map(|_| {
                                x = (x * 3.7 + 0.11).fract();
                                x - 0.5
                            })
                            .collect();
                        kv.write_token(layer, part, BlockId(b), slot, &row);
                    }
                }
            }
        }
    }

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
            fill(&mut half, 8, 0.37);
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

    /// A long context's pieces, merged, equal one online softmax over the whole context up to
    /// float rounding; and a row's result is the same bits on one thread or several, alone or
    /// beside other rows (a prefill chunk's, other decode rows'): float32 and bfloat16 arenas,
    /// three kv heads and one, with and without a window (the pieces cut the window's blocks,
    /// not the whole table's), contexts ending mid-block and on a block's last slot.
    #[test]
    fn a_rows_pieces_merge_alike_in_every_batch() {
        let pools: Vec<rayon::ThreadPool> =
            [2, 3].iter().map(|&n| rayon::ThreadPoolBuilder::new().num_threads(n).build().expect("pool")).collect();
        for (heads, kv_heads, dtype) in [(6, 3, KvDtype::F32), (6, 3, KvDtype::Bf16), (4, 1, KvDtype::F32)] {
            let (dim, bs) = (16, 4);
            let g = KvGeometry { dtype, ..KvGeometry::new(1, kv_heads, dim, bs) };
            let mut kv = KvArena::new_private(g, KvLayout::BlockMajor, 48);
            fill(&mut kv, 48, 0.41);
            let blocks: Vec<BlockId> = (0..40).rev().map(BlockId).collect();
            let others: Vec<BlockId> = (40..48).map(BlockId).collect();
            // A window's pieces cut the blocks it sees: 24..40 at position 158.
            assert_eq!(seen_blocks(158, Some(61), bs), 24..40);
            for (pos, window) in [(158, None), (159, None), (70, None), (158, Some(61))] {
                let shape =
                    AttentionShape { num_heads: heads, num_kv_heads: kv_heads, head_dim: dim, scale: 0.7, window };
                assert!(pieces_of(pos, window, bs) > 1, "position {pos} splits");
                let row = RowPos { blocks: &blocks, pos };
                let q: Vec<f32> = (0..heads * dim).map(|i| ((i * 11 % 17) as f32 - 8.0) / 5.0).collect();
                let alone = attend_rows(&q, &[row], &kv, 0, shape, None, false);
                // One online softmax over every block the row sees.
                let group = heads / kv_heads;
                let mut unsplit = vec![0f32; q.len()];
                for (h, out) in unsplit.chunks_exact_mut(group * dim).enumerate() {
                    let at = Context { row, kv: &kv, layer: 0 };
                    attend_group(&q[h * group * dim..(h + 1) * group * dim], out, at, h, shape);
                }
                for (i, (a, b)) in alone.iter().zip(&unsplit).enumerate() {
                    assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{dtype:?} position {pos} [{i}]: {a} vs {b}");
                }
                // Pieces shared between threads, and the row beside a short prefill chunk of
                // another sequence and a decode row (its own tasks then run whole on one
                // thread each).
                let batch: Vec<RowPos<'_>> =
                    (20..28).map(|p| RowPos { blocks: &others, pos: p }).chain([row]).collect();
                let mut qs: Vec<f32> = (0..8 * heads * dim).map(|i| ((i * 5 % 19) as f32 - 9.0) / 7.0).collect();
                qs.extend_from_slice(&q);
                for pool in &pools {
                    for parallel in [false, true] {
                        let split = pool.install(|| attend_rows(&q, &[row], &kv, 0, shape, None, parallel));
                        assert_eq!(split, alone, "{dtype:?} position {pos}, parallel {parallel}");
                        let both = [row, RowPos { blocks: &others, pos: 30 }];
                        let mut q2 = q.clone();
                        q2.extend_from_slice(&qs[..heads * dim]);
                        let two = pool.install(|| attend_rows(&q2, &both, &kv, 0, shape, None, parallel));
                        assert_eq!(two[..q.len()], alone[..], "{dtype:?} position {pos} beside a decode row");
                        let mixed = pool.install(|| attend_rows(&qs, &batch, &kv, 0, shape, None, parallel));
                        assert_eq!(mixed[8 * q.len()..], alone[..], "{dtype:?} position {pos} beside a chunk");
                    }
                }
            }
        }
    }
}
