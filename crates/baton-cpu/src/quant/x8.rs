//! Q4_1 and Q5_0 rows regrouped for the int16 decode kernels: eight blocks interleaved, so
//! that one register lane follows one block from the first load to its scaled sum.
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
//! (`cargo test --release -p baton-cpu --lib decode_path -- --ignored --nocapture`): 37
//! Gweights/s in cache (was 24), 24–28 from memory (was 22.5).
//!
//! On a CPU with AVX-512 VNNI the same groups meet the activations split into bytes instead
//! ([`byte_planes`], `super::avx512_q16::q4_1_x8_band`): `vpdpbusd` multiplies four nibbles at
//! once, a chunk costing a mask, a shift and a mask and then four multiply-adds a row. It is
//! no faster at one activation row (the kernel waits on memory either way) but SmolLM2 decodes
//! batches of 4, 8 and 16 10–30% faster (`BATON_DOT_VNNI=1|0 baton bench engine --batches
//! 1,4,8,16`, runs alternating; docs/benchmarks/vs-llamacpp.md has the figures).
//!
//! Q5_0 rows are grouped the same way ([`interleave`]): a Q5_0 block is a float16
//! scale `d`, a 32-bit mask of fifth bits and the same 16 nibble bytes as Q4_1's, value
//! `d · (nibble + 16·bit − 16)`. Its 176-byte group keeps Q4_1's chunks at bytes 48..176, the
//! scales at 0..16, and at 16..48 each block's fifth bits *cleared* (`1 − bit`), rearranged so
//! that the bit of the value in register `r` of chunk `c`, lane `2j + t`, is bit `4c + r` of
//! block `j`'s 16-bit word `t`: one shift and one mask a register put `16·(1 − bit)` beside
//! the nibble, and a subtraction gives the value less 16, exactly what the GGUF-order kernel
//! forms. The activations are permuted as for Q4_1 ([`permute_activations`]).
//!
//! The blocks past the last whole group of a row (fewer than eight) stay in GGUF's order, as do
//! the activations over them. A row keeps its length, so rows still start `row_bytes` apart and
//! matrices still stack row-wise. Everything that decodes rows one by one reads them back in
//! GGUF's order through [`gguf_order`].

use super::BlockFormat;

/// Blocks a group.
pub(super) const BLOCKS: usize = 8;
/// Bytes of a Q4_1 block.
const BLOCK_BYTES: usize = 20;
/// Bytes of a Q4_1 group.
pub(super) const GROUP_BYTES: usize = BLOCKS * BLOCK_BYTES;
/// Values a group.
pub(super) const GROUP_VALUES: usize = BLOCKS * 32;

/// Bytes of a Q5_0 block.
const Q5_0_BLOCK_BYTES: usize = 22;
/// Bytes of a Q5_0 group: its middles (the fifth bits) four bytes a block.
pub(super) const Q5_0_GROUP_BYTES: usize = BLOCKS * Q5_0_BLOCK_BYTES;
/// The most bytes a group of any grouped format has.
pub(super) const MAX_GROUP_BYTES: usize = Q5_0_GROUP_BYTES;

/// A Q5_0 block's fifth bits (`bits`, bit `v` value `v`'s) as its group stores them: cleared,
/// the bit of the value in register `r` of chunk `c`, lane `2j + t` — value `4c + 2t + [0, 16,
/// 1, 17][r]`, the low and high nibble of the lane's low byte, then of its high byte — at bit
/// `16t + 4c + r`. Whole words at a time: the bits of register `r` of every chunk sit 4 apart
/// in both places, so each `r` is one mask and one shift a word (the value less `4c + r` is
/// `2t`, `15 + 2t`, `2t − 1` or `14 + 2t`).
fn cleared_of(bits: u32) -> u32 {
    let (n, mut out) = (!bits, 0);
    for t in 0..2 {
        let third = if t == 0 { n << 1 } else { n >> 1 };
        let word =
            (n >> (2 * t) & 0x1111) | (n >> (15 + 2 * t) & 0x2222) | (third & 0x4444) | (n >> (14 + 2 * t) & 0x8888);
        out |= word << (16 * t);
    }
    out
}

/// [`cleared_of`] undone: the block's fifth bits from its group's word.
fn bits_of(cleared: u32) -> u32 {
    let mut out = 0;
    for t in 0..2 {
        let word = !cleared >> (16 * t) & 0xffff;
        let third = if t == 0 { (word & 0x4444) >> 1 } else { (word & 0x4444) << 1 };
        out |= (word & 0x1111) << (2 * t) | (word & 0x2222) << (15 + 2 * t) | third | (word & 0x8888) << (14 + 2 * t);
    }
    out
}

/// Whether `format`'s rows can be grouped here.
pub(super) fn can_group(format: BlockFormat) -> bool {
    matches!(format, BlockFormat::Q4_1 | BlockFormat::Q5_0)
}

/// Bytes of a grouped format's block between its float16 scale and its 16 quant bytes: Q4_1's
/// float16 minimum, or Q5_0's 32 fifth bits. A group keeps the eight scales at bytes 0..16,
/// the eight middles after them, then the four chunks.
fn middle_bytes(format: BlockFormat) -> usize {
    match format {
        BlockFormat::Q5_0 => 4,
        _ => 2,
    }
}

/// A block's middle as its group stores it, or (`back`) as GGUF does: Q4_1's as it is, Q5_0's
/// through [`cleared_of`] (or [`bits_of`]).
fn convert_middle(format: BlockFormat, middle: &mut [u8], back: bool) {
    if format == BlockFormat::Q5_0 {
        let word = u32::from_le_bytes(middle.try_into().expect("four bytes"));
        middle.copy_from_slice(&if back { bits_of(word) } else { cleared_of(word) }.to_le_bytes());
    }
}

/// Bytes of a group of `format` ([`can_group`] must hold).
pub(super) fn group_bytes(format: BlockFormat) -> usize {
    BLOCKS * (18 + middle_bytes(format))
}

/// Rewrites a row of `format`'s blocks (GGUF order) into groups, in place ([`can_group`] must
/// hold).
pub(super) fn interleave(format: BlockFormat, row: &mut [u8]) {
    let (mid, block) = (middle_bytes(format), 18 + middle_bytes(format));
    let chunks = 16 + BLOCKS * mid;
    assert!(row.len().is_multiple_of(block));
    let mut buf = [0u8; MAX_GROUP_BYTES];
    for group in row.chunks_exact_mut(BLOCKS * block) {
        let gguf = &mut buf[..group.len()];
        gguf.copy_from_slice(group);
        for (j, b) in gguf.chunks_exact(block).enumerate() {
            group[2 * j..2 * j + 2].copy_from_slice(&b[0..2]);
            let middle = &mut group[16 + mid * j..16 + mid * (j + 1)];
            middle.copy_from_slice(&b[2..2 + mid]);
            convert_middle(format, middle, false);
            for c in 0..4 {
                let at = chunks + 32 * c + 4 * j;
                group[at..at + 4].copy_from_slice(&b[2 + mid + 4 * c..6 + mid + 4 * c]);
            }
        }
    }
}

/// A row of `format` (or one group of it) grouped by [`interleave`] back in GGUF's order,
/// into `out` (as long).
pub(super) fn gguf_order(format: BlockFormat, row: &[u8], out: &mut [u8]) {
    let (mid, block) = (middle_bytes(format), 18 + middle_bytes(format));
    let chunks = 16 + BLOCKS * mid;
    assert!(row.len() == out.len() && row.len().is_multiple_of(block));
    let whole = row.len() / (BLOCKS * block) * (BLOCKS * block);
    for (group, gguf) in row.chunks_exact(BLOCKS * block).zip(out.chunks_exact_mut(BLOCKS * block)) {
        for (j, b) in gguf.chunks_exact_mut(block).enumerate() {
            b[0..2].copy_from_slice(&group[2 * j..2 * j + 2]);
            b[2..2 + mid].copy_from_slice(&group[16 + mid * j..16 + mid * (j + 1)]);
            convert_middle(format, &mut b[2..2 + mid], true);
            for c in 0..4 {
                let at = chunks + 32 * c + 4 * j;
                b[2 + mid + 4 * c..6 + mid + 4 * c].copy_from_slice(&group[at..at + 4]);
            }
        }
    }
    out[whole..].copy_from_slice(&row[whole..]);
}

/// Permutes each row of `k` int16 activations (`q`: `[m][k]`) to match rows grouped by
/// [`interleave`]: within each whole group of 256 values, chunk `c`'s 64 values are four
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
/// nibbles sit in byte `b` of the chunk's word `j` ([`interleave`]).
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
        use super::BlockFormat;
        for (format, block_bytes) in [(BlockFormat::Q4_1, BLOCK_BYTES), (BlockFormat::Q5_0, Q5_0_BLOCK_BYTES)] {
            // The kernels' constants and the layout code's sizes agree.
            assert_eq!(group_bytes(format), BLOCKS * block_bytes);
            assert!(group_bytes(format) <= MAX_GROUP_BYTES);
            // One group, a group and a tail, a tail only, two groups, and more.
            for blocks in [8, 11, 3, 16, 20] {
                let gguf: Vec<u8> = (0..blocks * block_bytes).map(|i| (i * 7 + i / 5) as u8).collect();
                let mut row = gguf.clone();
                interleave(format, &mut row);
                if blocks >= 8 {
                    assert_ne!(row, gguf, "{format:?}, {blocks} blocks: nothing moved");
                }
                let mut back = vec![0; row.len()];
                gguf_order(format, &row, &mut back);
                assert_eq!(back, gguf, "{format:?}, {blocks} blocks");
            }
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
        interleave(BlockFormat::Q4_1, &mut row);
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

    /// Which of a block's 32 values sits in register `r` of chunk `c`, 16-bit lane `2j + t`.
    fn value_at(c: usize, r: usize, t: usize) -> usize {
        4 * c + 2 * t + [0, 16, 1, 17][r]
    }

    /// The word-wide bit moves against their definition, bit by bit.
    #[test]
    fn fifth_bits_move_where_value_at_says() {
        for bits in [0u32, u32::MAX, 0x5555_5555, 0x8000_0001, 0x1234_5678, 0xdead_beef, 0x0f0f_f0f0] {
            let mut want = 0u32;
            for (t, c, r) in (0..2).flat_map(|t| (0..4).flat_map(move |c| (0..4).map(move |r| (t, c, r)))) {
                if bits >> value_at(c, r, t) & 1 == 0 {
                    want |= 1 << (16 * t + 4 * c + r);
                }
            }
            assert_eq!(cleared_of(bits), want, "{bits:#010x}");
            assert_eq!(bits_of(want), bits, "{bits:#010x}");
        }
        for v in 0..32 {
            assert_eq!(bits_of(cleared_of(1 << v)), 1 << v, "value {v}");
        }
    }

    /// What the Q5_0 kernel forms from a grouped row: register `r` of chunk `c`, lane
    /// `2j + t`, is the nibble less `16·(cleared bit 4c + r of word t)`; it must be the value
    /// less 16 that GGUF's block gives for the activation the permutation puts in that place.
    #[test]
    fn every_q5_0_value_meets_its_own_activation() {
        let blocks = 11;
        let gguf: Vec<u8> = (0..blocks * Q5_0_BLOCK_BYTES).map(|i| (i * 131 + i / 3 + 7) as u8).collect();
        // GGUF's values, less 16: nibble i (low) or i − 16 (high) plus the mask's bit i.
        let value = |block: usize, i: usize| -> i32 {
            let b = &gguf[block * Q5_0_BLOCK_BYTES..(block + 1) * Q5_0_BLOCK_BYTES];
            let bits = u32::from_le_bytes(b[2..6].try_into().expect("four bytes"));
            let q = b[6 + i % 16];
            let nibble = if i < 16 { q & 15 } else { q >> 4 };
            i32::from(nibble) + 16 * (bits >> i & 1) as i32 - 16
        };
        let mut row = gguf.clone();
        interleave(BlockFormat::Q5_0, &mut row);
        let mut x: Vec<i16> = (0..blocks as i16 * 32).collect();
        permute_activations(&mut x, blocks * 32);
        let mut seen = vec![false; blocks * 32];
        for g in 0..blocks / BLOCKS {
            let group = &row[g * Q5_0_GROUP_BYTES..(g + 1) * Q5_0_GROUP_BYTES];
            for c in 0..4 {
                for lane in 0..16 {
                    let (j, t) = (lane / 2, lane % 2);
                    let at = 48 + 32 * c + 2 * lane;
                    let word = u16::from_le_bytes([group[at], group[at + 1]]);
                    let cleared = u16::from_le_bytes([group[16 + 4 * j + 2 * t], group[16 + 4 * j + 2 * t + 1]]);
                    for r in 0..4 {
                        let nibble = i32::from((word >> (4 * r)) & 15);
                        let got = nibble - 16 * i32::from((cleared >> (4 * c + r)) & 1);
                        let index = x[g * GROUP_VALUES + 64 * c + 16 * r + lane] as usize;
                        assert_eq!(index / 32, g * BLOCKS + j, "block of lane {lane}, chunk {c}");
                        assert_eq!(got, value(index / 32, index % 32), "value {index}");
                        assert!(!seen[index], "value {index} twice");
                        seen[index] = true;
                    }
                }
            }
        }
        assert!(seen[..blocks / BLOCKS * GROUP_VALUES].iter().all(|&s| s));
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
