//! Paged attention on the CPU: queries attend to keys and values read through each sequence's
//! block table, one block slab at a time, with an online softmax (no `[tokens × context]`
//! score matrix is ever built).

use baton_kv::{BlockId, KvArena, KvDtype, KvPart, Slab};
use rayon::prelude::*;

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
pub(crate) fn paged_attention(
    q: &[f32],
    rows: &[RowPos<'_>],
    kv: &KvArena,
    layer: usize,
    shape: AttentionShape,
) -> Vec<f32> {
    let AttentionShape { num_heads, num_kv_heads, head_dim, .. } = shape;
    let group = num_heads / num_kv_heads;
    let mut out = vec![0.0; q.len()];
    // One task per (row, kv head): the group of query heads sharing that kv head is contiguous
    // in both `q` and `out`, so each key and value is loaded once for the whole group.
    out.par_chunks_mut(group * head_dim).enumerate().for_each(|(task, out)| {
        let (row, kv_head) = (task / num_kv_heads, task % num_kv_heads);
        let q_start = (row * num_heads + kv_head * group) * head_dim;
        let q = &q[q_start..q_start + group * head_dim];
        attend_group(q, out, rows[row], kv, layer, kv_head, shape);
    });
    out
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
    for b in first / block_size..=row.pos / block_size {
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
