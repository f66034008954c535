//! Q4_1 rows regrouped for the int16 decode kernels: eight blocks interleaved, so that one
//! register lane follows one block from the first load to its scaled sum.
//!
//! In GGUF a Q4_1 block is 20 bytes: a float16 scale `d`, a float16 minimum `m`, and 16 bytes
//! whose low nibbles are values 0–15 and high nibbles values 16–31. The kernels of
//! [`super::avx2_q16`] sum eight blocks at once in int32, one block to a lane of a 256-bit
//! register, and scale the eight together. From GGUF's order that costs, per block, a
//! zero-extension (a cross-lane shuffle) per 16 values, and per eight blocks a tree of
//! horizontal adds and eight scalar loads of the scales: Q4_1 ran at about 24 Gweights/s on one
//! Zen 4 thread, compute-bound, against Q8_0's 29.
//!
//! Here each run of eight whole blocks of a row is one 160-byte group:
//!
//! | bytes | what |
//! |---|---|
//! | 0..16 | the eight scales `d`, block `j` at `2j` |
//! | 16..32 | the eight minimums `m` |
//! | 32..160 | four chunks of 32 bytes: chunk `c`'s 32-bit word `j` is block `j`'s quant bytes `4c..4c + 4` |
//!
//! A 16-bit lane `2j + t` of chunk `c` then holds four nibbles of block `j`: values
//! `4c + 2t`, `4c + 2t + 16`, `4c + 2t + 1` and `4c + 2t + 17` (low and high nibble of its low
//! byte, then of its high byte). One 32-byte load, three shifts and three masks give four
//! registers of int16 values, block `j` in lanes `2j` and `2j + 1` of each; `vpmaddwd` against
//! the activations permuted to match ([`permute_activations`]) leaves block `j`'s products in
//! int32 lane `j`, and plain adds finish the eight blocks' sums. The scales and minimums load
//! as one register each. No shuffle, no horizontal add. One thread, SmolLM2's MLP shape
//! (`cargo test --release -p baton-model --lib decode_path -- --ignored --nocapture`): 37
//! Gweights/s in cache (was 24), 24–28 from memory (was 22.5).
//!
//! On a CPU with AVX-512 VNNI the same groups meet the activations split into bytes instead
//! ([`byte_planes`], `super::avx512_q16::q4_1_x8_band`): `vpdpbusd` multiplies four nibbles at
//! once, a chunk costing a mask, a shift and a mask and then four multiply-adds a row. It is
//! no faster at one activation row (the kernel waits on memory either way) but SmolLM2 decodes
//! batches of 4, 8 and 16 10–30% faster (`BATON_DOT_VNNI=1|0 baton bench engine --batches
//! 1,4,8,16`, runs alternating; the README has the figures).
//!
//! The blocks past the last whole group of a row (fewer than eight) stay in GGUF's order, as do
//! the activations over them. A row keeps its length, so rows still start `row_bytes` apart and
//! matrices still stack row-wise. Everything that decodes rows one by one reads them back in
//! GGUF's order through [`gguf_row`].

/// Blocks a group.
pub(super) const BLOCKS: usize = 8;
/// Bytes of a Q4_1 block.
const BLOCK_BYTES: usize = 20;
/// Bytes of a group.
pub(super) const GROUP_BYTES: usize = BLOCKS * BLOCK_BYTES;
/// Values a group.
pub(super) const GROUP_VALUES: usize = BLOCKS * 32;

/// Rewrites a row of Q4_1 blocks (GGUF order) into groups, in place.
pub(super) fn interleave_row(row: &mut [u8]) {
    assert!(row.len().is_multiple_of(BLOCK_BYTES));
    for group in row.chunks_exact_mut(GROUP_BYTES) {
        let gguf: [u8; GROUP_BYTES] = group.try_into().expect("a group");
        for (j, b) in gguf.chunks_exact(BLOCK_BYTES).enumerate() {
            group[2 * j..2 * j + 2].copy_from_slice(&b[0..2]);
            group[16 + 2 * j..16 + 2 * j + 2].copy_from_slice(&b[2..4]);
            for c in 0..4 {
                let at = 32 + 32 * c + 4 * j;
                group[at..at + 4].copy_from_slice(&b[4 + 4 * c..8 + 4 * c]);
            }
        }
    }
}

/// Row `row` (grouped by [`interleave_row`]) in GGUF's order, into `out` (its length).
pub(super) fn gguf_row(row: &[u8], out: &mut [u8]) {
    assert!(row.len() == out.len() && row.len().is_multiple_of(BLOCK_BYTES));
    let whole = row.len() / GROUP_BYTES * GROUP_BYTES;
    for (group, gguf) in row.chunks_exact(GROUP_BYTES).zip(out.chunks_exact_mut(GROUP_BYTES)) {
        for (j, b) in gguf.chunks_exact_mut(BLOCK_BYTES).enumerate() {
            b[0..2].copy_from_slice(&group[2 * j..2 * j + 2]);
            b[2..4].copy_from_slice(&group[16 + 2 * j..16 + 2 * j + 2]);
            for c in 0..4 {
                let at = 32 + 32 * c + 4 * j;
                b[4 + 4 * c..8 + 4 * c].copy_from_slice(&group[at..at + 4]);
            }
        }
    }
    out[whole..].copy_from_slice(&row[whole..]);
}

/// Permutes each row of `k` int16 activations (`q`: `[m][k]`) to match rows grouped by
/// [`interleave_row`]: within each whole group of 256 values, chunk `c`'s 64 values are four
/// registers of 16, lane `2j + t` of each holding block `j`'s value `4c + 2t`, `+ 16`, `+ 1`
/// and `+ 17` in turn. The values past the last whole group stay where they are.
pub(super) fn permute_activations(q: &mut [i16], k: usize) {
    assert!(k.is_multiple_of(32) && q.len().is_multiple_of(k));
    for row in q.chunks_exact_mut(k) {
        for group in row.chunks_exact_mut(GROUP_VALUES) {
            let x: [i16; GROUP_VALUES] = group.try_into().expect("a group");
            for c in 0..4 {
                for j in 0..BLOCKS {
                    for t in 0..2 {
                        let (from, to) = (32 * j + 4 * c + 2 * t, 64 * c + 2 * j + t);
                        group[to] = x[from];
                        group[to + 16] = x[from + 16];
                        group[to + 32] = x[from + 1];
                        group[to + 48] = x[from + 17];
                    }
                }
            }
        }
    }
}

/// Bytes of [`byte_planes`] a whole group.
pub(super) const PLANE_GROUP_BYTES: usize = 2 * GROUP_VALUES;

/// Rows of `k` int16 activations (`q`: `[m][k]`, in GGUF's order, not permuted) split into the
/// bytes a VNNI kernel multiplies with grouped rows: each value as `256·h + l`, `h` its high
/// byte (signed), `l` its low byte (unsigned) — exact, so the kernel's int32 sums are those of
/// the int16 kernel's. `vpdpbusd` multiplies unsigned bytes with signed ones, four to an int32
/// lane: a nibble (0–15) fits either side, so `h` meets the nibbles as the signed side and `l`
/// as the unsigned one.
///
/// Per row, [`PLANE_GROUP_BYTES`] a whole group (values past the last whole group have none);
/// per chunk `c` of the group, four runs of 32 bytes: `h` of the values chunk `c`'s low
/// nibbles hold, `h` of those its high nibbles hold, then `l` of each. Byte `4j + b` of a low
/// run is block `j`'s value `4c + b`, of a high run its value `4c + b + 16`: the values whose
/// nibbles sit in byte `b` of the chunk's word `j` ([`interleave_row`]).
pub(super) fn byte_planes(q: &[i16], k: usize) -> Vec<u8> {
    assert!(k.is_multiple_of(32) && q.len().is_multiple_of(k));
    let groups = k / GROUP_VALUES;
    let mut out = vec![0u8; q.len() / k * groups * PLANE_GROUP_BYTES];
    if groups == 0 {
        return out;
    }
    for (row, planes) in q.chunks_exact(k).zip(out.chunks_exact_mut(groups * PLANE_GROUP_BYTES)) {
        for (x, planes) in row.chunks_exact(GROUP_VALUES).zip(planes.chunks_exact_mut(PLANE_GROUP_BYTES)) {
            for (c, runs) in planes.chunks_exact_mut(128).enumerate() {
                for j in 0..BLOCKS {
                    for b in 0..4 {
                        let (low, high) = (x[32 * j + 4 * c + b], x[32 * j + 4 * c + b + 16]);
                        let at = 4 * j + b;
                        runs[at] = (low >> 8) as u8;
                        runs[32 + at] = (high >> 8) as u8;
                        runs[64 + at] = low as u8;
                        runs[96 + at] = high as u8;
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_come_back_in_gguf_order() {
        // 8, 11 and 3 blocks: one group, a group and a tail, a tail only.
        for blocks in [8, 11, 3, 16] {
            let gguf: Vec<u8> = (0..blocks * BLOCK_BYTES).map(|i| (i * 7 + i / 5) as u8).collect();
            let mut row = gguf.clone();
            interleave_row(&mut row);
            if blocks >= 8 {
                assert_ne!(row, gguf, "{blocks} blocks: nothing moved");
            }
            let mut back = vec![0; row.len()];
            gguf_row(&row, &mut back);
            assert_eq!(back, gguf, "{blocks} blocks");
        }
    }

    /// The layout the kernels rely on: lane `2j + t` of chunk `c`'s four registers holds the
    /// nibble of block `j`'s value that the activation in the same place of the permuted row
    /// multiplies, for every value of every block exactly once.
    #[test]
    fn every_weight_meets_its_own_activation() {
        let blocks = 11;
        // Block j's quant byte i: low nibble is value i, high nibble value i + 16; make each
        // value's nibble name the value: the test then reads positions, not numbers.
        let mut gguf = vec![0u8; blocks * BLOCK_BYTES];
        let mut names = vec![0u16; blocks * 32];
        for (j, b) in gguf.chunks_exact_mut(BLOCK_BYTES).enumerate() {
            for i in 0..16 {
                b[4 + i] = ((i % 16) as u8) | (((i + j) % 16) as u8) << 4;
                names[32 * j + i] = (i % 16) as u16;
                names[32 * j + i + 16] = ((i + j) % 16) as u16;
            }
        }
        let mut row = gguf.clone();
        interleave_row(&mut row);
        // Each activation is its own index: after the permutation, the index says which
        // value of which block sits in that place.
        let mut x: Vec<i16> = (0..blocks as i16 * 32).collect();
        permute_activations(&mut x, blocks * 32);
        let mut seen = vec![false; blocks * 32];
        for g in 0..blocks / BLOCKS {
            for c in 0..4 {
                let at = g * GROUP_BYTES + 32 + 32 * c;
                for lane in 0..16 {
                    let word = u16::from_le_bytes([row[at + 2 * lane], row[at + 2 * lane + 1]]);
                    let nibbles = [word & 15, (word >> 4) & 15, (word >> 8) & 15, word >> 12];
                    for (r, nibble) in nibbles.into_iter().enumerate() {
                        let index = x[g * GROUP_VALUES + 64 * c + 16 * r + lane] as usize;
                        assert_eq!(index / 32, g * BLOCKS + lane / 2, "block of lane {lane}, chunk {c}");
                        assert_eq!(nibble, names[index], "value {index}");
                        assert!(!seen[index], "value {index} twice");
                        seen[index] = true;
                    }
                }
            }
        }
        // The tail keeps its order.
        let tail = blocks / BLOCKS * GROUP_VALUES;
        assert!(x[tail..].iter().enumerate().all(|(i, &v)| v as usize == tail + i));
        assert!(seen[..tail].iter().all(|&s| s));
    }

    /// The planes rebuild every value of every whole group exactly once, from the nibble
    /// positions the kernel pairs them with.
    #[test]
    fn byte_planes_split_each_value_exactly() {
        let (blocks, m) = (19, 2);
        let k = blocks * 32;
        let q: Vec<i16> = (0..m * k).map(|i| (i as i32 * 7919 % 65536 - 32768) as i16).collect();
        let planes = byte_planes(&q, k);
        let groups = k / GROUP_VALUES;
        assert_eq!(planes.len(), m * groups * PLANE_GROUP_BYTES);
        for r in 0..m {
            for g in 0..groups {
                for c in 0..4 {
                    let runs = &planes[(r * groups + g) * PLANE_GROUP_BYTES + 128 * c..][..128];
                    for j in 0..BLOCKS {
                        for b in 0..4 {
                            let at = 4 * j + b;
                            let low = i32::from(runs[at] as i8) * 256 + i32::from(runs[64 + at]);
                            let high = i32::from(runs[32 + at] as i8) * 256 + i32::from(runs[96 + at]);
                            let base = r * k + g * GROUP_VALUES + 32 * j + 4 * c + b;
                            assert_eq!(low, i32::from(q[base]), "row {r} group {g} chunk {c} block {j} byte {b}");
                            assert_eq!(high, i32::from(q[base + 16]));
                        }
                    }
                }
            }
        }
    }
}
