//! AVX2 kernels of [`super`] against int16 activations ([`super::q16`]), for every block
//! format [`super`] decodes: the same arithmetic as [`super::avx512_q16`] in 256-bit
//! registers, for CPUs without AVX-512 (most laptops and desktops, many cloud CPUs).
//!
//! Each weight block is decoded into int16 lanes in registers (the K formats' integer
//! sub-block scales multiplied in with `vpmullw`), and `vpmaddwd` multiplies it with every
//! activation row, exact in int32; only a block's sum (32 values; a K super-block's 256, or
//! Q6_K's half super-block of 128) is converted and scaled in float32. Minimums (Q4_1, Q5_1,
//! Q2_K, Q4_K, Q5_K) multiply the activations' float sums. No row is ever decoded to float32.
//!
//! One register holds 16 values: one sub-block of Q2_K, Q3_K and Q6_K, half a sub-block of the
//! others. An int32 lane sums twice as many products as in the AVX-512 kernels, so each
//! kernel's comment bounds its sums below 2³¹.

use std::arch::x86_64::*;

use super::BlockFormat;
use super::panel16::Panel16;
use super::q16::{Q16View, q16_block};

/// `out[i·m + r] = w[first + i] · x[r]` for every weight row `i` that `out` has room for,
/// where weight row `j` is `bytes[j·row_bytes..]` in `format`; `x.block` must be
/// [`q16_block`]`(format)`. With `interleaved`, the rows are Q4_1's or Q5_0's in
/// [`super::x8`]'s groups and `x` is permuted to match ([`super::x8::permute_activations`]).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn band(
    format: BlockFormat,
    interleaved: bool,
    bytes: &[u8],
    row_bytes: usize,
    cols: usize,
    first: usize,
    x: Q16View<'_>,
    out: &mut [f32],
) {
    let m = x.m();
    let rows = out.len() / m;
    assert!(cols == x.k && row_bytes == cols / format.block_len() * format.block_bytes());
    assert!(x.block == q16_block(format) && x.scale.len() * x.block == m * cols);
    assert!(x.sum32.len() * 32 == m * cols && x.sum16.len() * 16 == m * cols);
    assert!(bytes.len() >= (first + rows) * row_bytes && out.len() == rows * m);
    let w = &bytes[first * row_bytes..(first + rows) * row_bytes];
    // Two accumulators per activation row hide the FMA latency, whatever `M` (the K formats'
    // float sums go to accumulator `i % A` by super-block: an `A` that changed with `M` would
    // change a row's rounding with its batch). The 32-value formats' kernels ignore `A`: they
    // sum eight blocks into one register before scaling.
    macro_rules! by_rows {
        ($kernel:ident) => {
            match m {
                1 => $kernel::<1, 2>(w, row_bytes, x, out),
                2 => $kernel::<2, 2>(w, row_bytes, x, out),
                3 => $kernel::<3, 2>(w, row_bytes, x, out),
                4 => $kernel::<4, 2>(w, row_bytes, x, out),
                _ => {
                    // More rows than registers allow: four at a time.
                    // SAFETY (inside): the same CPU features as this function's.
                    super::q16::by_row_chunks(x, 4, out, |xs, part| unsafe {
                        band(format, interleaved, w, row_bytes, cols, 0, xs, part)
                    });
                }
            }
        };
    }
    assert!(!interleaved || super::x8::can_group(format));
    match format {
        BlockFormat::Q4_1 if interleaved => by_rows!(q4_1_x8),
        BlockFormat::Q5_0 if interleaved => by_rows!(q5_0_x8),
        BlockFormat::Q8_0 => by_rows!(q8_0),
        BlockFormat::Q4_0 => by_rows!(q4_0),
        BlockFormat::Q4_1 => by_rows!(q4_1),
        BlockFormat::Q5_0 => by_rows!(q5_0),
        BlockFormat::Q5_1 => by_rows!(q5_1),
        BlockFormat::Q2K => by_rows!(q2k),
        BlockFormat::Q3K => by_rows!(q3k),
        BlockFormat::Q4K => by_rows!(q4k),
        BlockFormat::Q5K => by_rows!(q5k),
        BlockFormat::Q6K => by_rows!(q6k),
    }
}

/// The float16 at `b[i..i + 2]`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn half_at(b: &[u8], i: usize) -> f32 {
    let bits = u16::from_le_bytes([b[i], b[i + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// 16 bytes from `b[i..]`, zero-extended to 16 int16 lanes.
#[target_feature(enable = "avx2")]
#[inline]
fn u8x16(b: &[u8], i: usize) -> __m256i {
    let s = &b[i..i + 16];
    // SAFETY: `s` holds the 16 bytes read.
    _mm256_cvtepu8_epi16(unsafe { _mm_loadu_si128(s.as_ptr().cast()) })
}

/// 16 bytes from `b[i..]`, sign-extended to 16 int16 lanes.
#[target_feature(enable = "avx2")]
#[inline]
fn i8x16(b: &[u8], i: usize) -> __m256i {
    let s = &b[i..i + 16];
    // SAFETY: `s` holds the 16 bytes read.
    _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(s.as_ptr().cast()) })
}

/// 16 int16 activations from `q`, multiplied pairwise with `w` and summed in pairs: 8 int32
/// lanes. (Pointers, not slices, in the kernels' inner loops: the bounds checks of slices
/// there cost more than the arithmetic; the kernels check the sizes once.)
///
/// # Safety
/// `q` must point to 16 readable values.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn madd(w: __m256i, q: *const i16) -> __m256i {
    // SAFETY: the caller's.
    _mm256_madd_epi16(w, unsafe { _mm256_loadu_si256(q.cast()) })
}

/// The 16 bits of `bits` as 16 int16 lanes, each `value` where its bit is set and 0 where not
/// (bit `j` to lane `j`).
#[target_feature(enable = "avx2")]
#[inline]
fn bit_lanes(bits: u16, value: i16) -> __m256i {
    let each = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, i16::MIN);
    let set = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(bits as i16), each), each);
    _mm256_and_si256(set, _mm256_set1_epi16(value))
}

/// The sum of the 8 lanes of `v`.
#[target_feature(enable = "avx2")]
#[inline]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// The last blocks of a row of a 32-value format (`tail`: fewer than eight, `bytes` each, in
/// GGUF's order, `decode` giving a block's 32 integers) into `acc` (and with `with_min`, the
/// minimums `m · Σx` into `mins`): block `first + j`'s whole int32 sum goes to lane `j` and
/// is scaled as a group of eight is, the lanes past the tail adding zero. So every block `b`
/// of a row lands in lane `b % 8`, each lane summing its blocks in order, which is the order
/// the int16 panels keep too ([`panel_gemm`]): a row's product rounds alike in both.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn tail_blocks<const M: usize>(
    tail: &[u8],
    bytes: usize,
    with_min: bool,
    x: Q16View<'_>,
    decode: impl Fn(&[u8]) -> (__m256i, __m256i),
    acc: &mut [__m256; M],
    mins: &mut [__m256; M],
) {
    let (k, nb, n) = (x.k, x.k / 32, tail.len() / bytes);
    if n == 0 {
        return;
    }
    assert!(n < 8 && tail.len() == n * bytes && x.q.len() == M * k && x.scale.len() == M * nb);
    assert!(x.sum32.len() == M * nb);
    let first = nb - n;
    let (mut d, mut m) = ([0f32; 8], [0f32; 8]);
    // Block `j`'s int32 lanes against each activation row; zeros past the tail.
    let mut p = [[_mm256_setzero_si256(); M]; 8];
    for (j, b) in tail.chunks_exact(bytes).enumerate() {
        let (lo, hi) = decode(b);
        d[j] = half_at(b, 0);
        if with_min {
            m[j] = half_at(b, 2);
        }
        for (r, p) in p[j].iter_mut().enumerate() {
            let q = &x.q[r * k + 32 * (first + j)..][..32];
            // SAFETY: `q` holds the 32 values read.
            *p = unsafe { _mm256_add_epi32(madd(lo, q.as_ptr()), madd(hi, q.as_ptr().add(16))) };
        }
    }
    // Lane `j` the whole sum of block `j`, as a group's (integer adds: exact).
    let sums = block_sums(p);
    // The tail's lanes of each row's scales and sums; nothing past the row is read.
    let lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    // SAFETY (each load): eight floats of a local array.
    let (d, m) = unsafe { (_mm256_loadu_ps(d.as_ptr()), _mm256_loadu_ps(m.as_ptr())) };
    for (r, (acc, mins)) in acc.iter_mut().zip(mins.iter_mut()).enumerate() {
        let at = r * nb + first;
        // SAFETY: the masked loads read lanes `j < n` only: blocks `first + j < nb` of row
        // `r < M`, inside the sizes asserted above.
        unsafe {
            let sx = _mm256_maskload_ps(x.scale.as_ptr().add(at), lanes);
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(d, sx), *acc);
            if with_min {
                *mins = _mm256_fmadd_ps(m, _mm256_maskload_ps(x.sum32.as_ptr().add(at), lanes), *mins);
            }
        }
    }
}

/// Writes the sum of each activation row's accumulators to one output row, less `minus[r]`.
#[target_feature(enable = "avx2")]
#[inline]
fn store<const M: usize, const A: usize>(acc: &[[__m256; M]; A], minus: &[f32; M], out: &mut [f32]) {
    for (r, o) in out.iter_mut().enumerate() {
        let mut s = acc[0][r];
        for a in &acc[1..] {
            s = _mm256_add_ps(s, a[r]);
        }
        *o = hsum(s) - minus[r];
    }
}

/// How far ahead of the block being decoded the kernels prefetch: a page, about what one core
/// reads in a memory latency (~120 ns at ~25 GB/s). From 2,048 bytes: one thread streaming a
/// SmolLM2-shaped Q4_1 matrix larger than the caches went from 20.2–20.8 to 22.9–23.2 GB/s
/// (`decode_path_throughput`, 8,192 bytes: 20.3–20.7), and SmolLM2's batch-1 decode on two
/// threads whose cores are on two complexes from 213.5 to 220.4 tokens/s (mean of 11
/// alternating `bench engine` batches).
const PREFETCH_BYTES: usize = 4096;

/// Prefetches the cache lines `PREFETCH_BYTES` past those `b` spans.
#[target_feature(enable = "avx2")]
#[inline]
fn prefetch_ahead(b: &[u8]) {
    let mut off = 0;
    while off < b.len() {
        // A prefetch never faults, whatever the address; `wrapping_add` keeps the pointer
        // arithmetic defined past the slice.
        _mm_prefetch::<_MM_HINT_T0>(b.as_ptr().wrapping_add(PREFETCH_BYTES + off).cast());
        off += 64;
    }
}

/// Eight blocks' registers of int32 lanes (for each activation row) summed into one register
/// whose lane `j` is block `j`'s whole sum: lane pairs, then pairs of pairs (`vphaddd`, which
/// keeps the blocks in order within each half), then the halves. Integer adds: exact.
#[target_feature(enable = "avx2")]
#[inline]
fn block_sums<const M: usize>(p: [[__m256i; M]; 8]) -> [__m256i; M] {
    let mut out = [_mm256_setzero_si256(); M];
    for (r, o) in out.iter_mut().enumerate() {
        let h = |a: usize| _mm256_hadd_epi32(p[a][r], p[a + 1][r]);
        let (lo, hi) = (_mm256_hadd_epi32(h(0), h(2)), _mm256_hadd_epi32(h(4), h(6)));
        *o = _mm256_add_epi32(_mm256_blend_epi32::<0b1111_0000>(lo, hi), _mm256_permute2x128_si256::<0x21>(lo, hi));
    }
    out
}

/// The float16 scale `d` (the block's first two bytes) and the next two bytes (Q4_1's and
/// Q5_1's float16 minimum `m`) of the eight blocks of `bytes ≥ 4` bytes in `g`, as float32
/// lanes.
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn halves(g: &[u8], bytes: usize) -> (__m256, __m256) {
    assert!(g.len() >= 7 * bytes + 4);
    // SAFETY: the first four bytes of block `j < 8`, inside `g` as asserted.
    let at = |j: usize| unsafe { g.as_ptr().add(j * bytes).cast::<i32>().read_unaligned() };
    // Scalar loads inserted into lanes: a gather is slower on AMD's cores.
    let g = _mm256_setr_epi32(at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7));
    // Each half's low words (scales), then its high words (minimums); then the scales of both
    // halves in the low half.
    let split = _mm256_setr_epi8(
        0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
    );
    let t = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi8(g, split));
    (_mm256_cvtph_ps(_mm256_castsi256_si128(t)), _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(t)))
}

/// A kernel for a format of 32-value blocks with a float16 scale `d` first and, `$min` true,
/// a float16 minimum `m` after it (value = `d·q + m`; `m` multiplies the activations' float
/// sum of the block): `$decode(b)` gives the block's 32 integers in two registers of int16
/// lanes.
///
/// Blocks go eight at a time: each block's products are summed in int32 ([`block_sums`]) into
/// one lane of a register of the eight blocks' sums, which is converted once and multiplied by
/// the eight blocks' scales ([`halves`]) times the activations' in one register; the minimums'
/// part is one multiply-add a register too. Converting each block's float16 scale, multiplying
/// and broadcasting it on its own cost as much as the block's products: this way a single
/// thread on Zen 4 multiplied Q4_1 at 24 Gweights/s (was 19.4; [`q4_1_x8`] takes it to 37)
/// and Q8_0 at 29 (was 21.7),
/// faster than the AVX-512 kernels those formats had (17 and 19; `cargo test --release -p
/// baton-cpu --lib decode_path -- --ignored --nocapture`). The last blocks of a row (fewer
/// than eight) take the lanes of their place in a group ([`tail_blocks`]). A block's sum is at most 32 products of 128 · 32767
/// < 2³¹; its conversion to float32 rounds only past 2²⁴ (by at most 2⁻²⁴ of it).
macro_rules! small_blocks {
    ($(#[$doc:meta])* $name:ident, $bytes:literal, $min:literal, $decode:expr) => {
        $(#[$doc])*
        #[target_feature(enable = "avx2,fma,f16c")]
        fn $name<const M: usize, const A: usize>(w: &[u8], row_bytes: usize, x: Q16View<'_>, out: &mut [f32]) {
            let (k, nb) = (x.k, x.k / 32);
            assert!(
                row_bytes == nb * $bytes && x.q.len() == M * k && x.scale.len() == M * nb && x.sum32.len() == M * nb
            );
            let (xq, xs, x32) = (x.q.as_ptr(), x.scale.as_ptr(), x.sum32.as_ptr());
            for (row, out) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(M)) {
                let mut acc = [_mm256_setzero_ps(); M];
                // The minimums' part, which `store` subtracts.
                let mut mins = [_mm256_setzero_ps(); M];
                let groups = row.chunks_exact($bytes * 8);
                let tail = groups.remainder();
                for (group, first) in groups.zip((0..nb).step_by(8)) {
                    prefetch_ahead(group);
                    // Block `j`'s int32 lanes against each activation row.
                    let block = |j: usize| {
                        let (lo, hi): (__m256i, __m256i) = $decode(&group[$bytes * j..$bytes * (j + 1)]);
                        let mut p = [_mm256_setzero_si256(); M];
                        for (r, p) in p.iter_mut().enumerate() {
                            // SAFETY: block `first + j < nb` of row `r < M`, inside the bounds
                            // the assert above checks.
                            *p = unsafe {
                                let q = xq.add(r * k + 32 * (first + j));
                                _mm256_add_epi32(madd(lo, q), madd(hi, q.add(16)))
                            };
                        }
                        p
                    };
                    let sums =
                        block_sums([block(0), block(1), block(2), block(3), block(4), block(5), block(6), block(7)]);
                    let (d, m) = halves(group, $bytes);
                    for (r, (acc, mins)) in acc.iter_mut().zip(&mut mins).enumerate() {
                        // SAFETY: blocks `first..first + 8` of row `r`, inside the bounds the
                        // assert above checks.
                        let sx = unsafe { _mm256_loadu_ps(xs.add(r * nb + first)) };
                        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(d, sx), *acc);
                        if $min {
                            // SAFETY: as above.
                            *mins = _mm256_fmadd_ps(m, unsafe { _mm256_loadu_ps(x32.add(r * nb + first)) }, *mins);
                        }
                    }
                }
                // The last blocks (fewer than eight), each in its lane.
                let mut minus = [0f32; M];
                tail_blocks(tail, $bytes, $min, x, |b: &[u8]| $decode(b), &mut acc, &mut mins);
                for (minus, mins) in minus.iter_mut().zip(&mins) {
                    *minus -= hsum(*mins);
                }
                store(&[acc], &minus, out);
            }
        }
    };
}

/// The 16 bytes at `b[i..]` as two registers of 16 int16 lanes: their low nibbles (values
/// 0-15 of a block), then their high nibbles (values 16-31).
#[target_feature(enable = "avx2")]
#[inline]
fn nibbles(b: &[u8], i: usize) -> (__m256i, __m256i) {
    let q = u8x16(b, i);
    (_mm256_and_si256(q, _mm256_set1_epi16(0x0f)), _mm256_srli_epi16::<4>(q))
}

small_blocks!(
    /// Q8_0: 32 int8 values and a float16 scale.
    q8_0,
    34,
    false,
    |b: &[u8]| (i8x16(b, 2), i8x16(b, 18))
);

small_blocks!(
    /// Q4_0: 32 4-bit values (low nibbles first, then high) offset by 8, and a float16 scale.
    q4_0,
    18,
    false,
    |b: &[u8]| {
        let (lo, hi) = nibbles(b, 2);
        let eight = _mm256_set1_epi16(8);
        (_mm256_sub_epi16(lo, eight), _mm256_sub_epi16(hi, eight))
    }
);

/// A Q5_0 block's 32 values less 16 (GGUF's order) in two registers of int16 lanes.
#[target_feature(enable = "avx2")]
#[inline]
fn q5_0_block(b: &[u8]) -> (__m256i, __m256i) {
    let (lo, hi) = nibbles(b, 6);
    let sixteen = _mm256_set1_epi16(16);
    // Value j is its nibble + 16·(bit j of the mask) − 16.
    let fifth = |lanes: __m256i, bits: u16| _mm256_sub_epi16(_mm256_or_si256(lanes, bit_lanes(bits, 16)), sixteen);
    (fifth(lo, u16::from_le_bytes([b[2], b[3]])), fifth(hi, u16::from_le_bytes([b[4], b[5]])))
}

small_blocks!(
    /// Q5_0: Q4_0's nibbles with a fifth bit each from a 32-bit mask, offset by 16.
    q5_0,
    22,
    false,
    |b: &[u8]| q5_0_block(b)
);

small_blocks!(
    /// Q4_1: 32 4-bit values (low nibbles first, then high), a float16 scale and minimum.
    q4_1,
    20,
    true,
    |b: &[u8]| nibbles(b, 4)
);

small_blocks!(
    /// Q5_1: Q4_1's nibbles with a fifth bit each from a 32-bit mask.
    q5_1,
    24,
    true,
    |b: &[u8]| {
        let (lo, hi) = nibbles(b, 8);
        let fifth = |lanes: __m256i, bits: u16| _mm256_or_si256(lanes, bit_lanes(bits, 16));
        (fifth(lo, u16::from_le_bytes([b[4], b[5]])), fifth(hi, u16::from_le_bytes([b[6], b[7]])))
    }
);

/// One chunk of a grouped row ([`super::x8`]): its four registers of int16 weights times the
/// 64 permuted activations at `q` (and `k` values on, for each further row), into each row's
/// two sums (`sums[0]` the first and third registers', `sums[1]` the others', so that one
/// chunk's adds need not wait on each other).
///
/// # Safety
/// `q + r·k .. + 64` must be readable for every `r < M`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn add_chunk<const M: usize>(sums: &mut [[__m256i; M]; 2], w: [__m256i; 4], q: *const i16, k: usize) {
    let [lo, hi] = sums;
    for (r, (lo, hi)) in lo.iter_mut().zip(hi.iter_mut()).enumerate() {
        // SAFETY: the caller's.
        unsafe {
            let q = q.add(r * k);
            *lo = _mm256_add_epi32(*lo, madd(w[0], q));
            *hi = _mm256_add_epi32(*hi, madd(w[1], q.add(16)));
            *lo = _mm256_add_epi32(*lo, madd(w[2], q.add(32)));
            *hi = _mm256_add_epi32(*hi, madd(w[3], q.add(48)));
        }
    }
}

/// Q4_1 rows in [`super::x8`]'s groups against `M` permuted activation rows: per group, four
/// 32-byte loads give sixteen registers of int16 nibbles (a mask, or a shift and a mask), each
/// multiplied into int32 lanes that are already the eight blocks' own; the eight sums are then
/// converted and scaled together as in [`small_blocks!`]. The blocks past the last group, in
/// GGUF's order, go to the lanes of their place in a group ([`tail_blocks`]). A lane sums
/// block `j`'s 32 products of at most 15 · 32767: far below 2³¹. (`A` is [`band`]'s; two sums a row here whatever it is.)
#[target_feature(enable = "avx2,fma,f16c")]
fn q4_1_x8<const M: usize, const A: usize>(w: &[u8], row_bytes: usize, x: Q16View<'_>, out: &mut [f32]) {
    use super::x8::{GROUP_BYTES, GROUP_VALUES};
    let (k, nb) = (x.k, x.k / 32);
    assert!(row_bytes == nb * 20 && x.q.len() == M * k && x.scale.len() == M * nb && x.sum32.len() == M * nb);
    let xq = x.q.as_ptr();
    let mask = _mm256_set1_epi16(0x0f);
    for (row, out) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(M)) {
        let mut acc = [_mm256_setzero_ps(); M];
        let mut mins = [_mm256_setzero_ps(); M];
        let groups = row.chunks_exact(GROUP_BYTES);
        let tail = groups.remainder();
        for (g, group) in groups.enumerate() {
            prefetch_ahead(group);
            let mut sums = [[_mm256_setzero_si256(); M]; 2];
            for c in 0..4 {
                // SAFETY: bytes `32 + 32c..64 + 32c < 160` of the group.
                let q = unsafe { _mm256_loadu_si256(group.as_ptr().add(32 + 32 * c).cast()) };
                let nibbles = [
                    _mm256_and_si256(q, mask),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(q), mask),
                    _mm256_and_si256(_mm256_srli_epi16::<8>(q), mask),
                    _mm256_srli_epi16::<12>(q),
                ];
                // SAFETY: values `GROUP_VALUES·g + 64c .. + 64` of each row `r < M`, inside the
                // bounds the assert above checks (`g` counts whole groups of the row).
                unsafe { add_chunk(&mut sums, nibbles, xq.add(GROUP_VALUES * g + 64 * c), k) };
            }
            let sums: [__m256i; M] = std::array::from_fn(|r| _mm256_add_epi32(sums[0][r], sums[1][r]));
            q4_1_x8_scale(group, g, x, sums, &mut acc, &mut mins);
        }
        q4_1_x8_finish(tail, x, acc, mins, out);
    }
}

/// Q5_0 rows in [`super::x8`]'s groups against `M` permuted activation rows: as [`q4_1_x8`],
/// but each register of nibbles less `16·(1 − fifth bit)` — the group's cleared bits shifted
/// to the lanes' bit 4 and masked — before it multiplies: three operations a register where
/// the GGUF-order kernel spends seven a half block on widening and its bit mask. The sums are
/// that kernel's, bit for bit, and are scaled alike; the blocks past the last group go to the
/// lanes of their place in a group ([`tail_blocks`]). One thread, Gemma 3's Q5_0 shape
/// (`decode_path`): 24.2–24.4 Gweights/s, against 14.8–16.4 in GGUF's order.
#[target_feature(enable = "avx2,fma,f16c")]
fn q5_0_x8<const M: usize, const A: usize>(w: &[u8], row_bytes: usize, x: Q16View<'_>, out: &mut [f32]) {
    use super::x8::{GROUP_VALUES, Q5_0_GROUP_BYTES};
    let (k, nb) = (x.k, x.k / 32);
    assert!(row_bytes == nb * 22 && x.q.len() == M * k && x.scale.len() == M * nb);
    let (xq, xs) = (x.q.as_ptr(), x.scale.as_ptr());
    let (mask, sixteen) = (_mm256_set1_epi16(0x0f), _mm256_set1_epi16(16));
    for (row, out) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(M)) {
        let mut acc = [_mm256_setzero_ps(); M];
        let groups = row.chunks_exact(Q5_0_GROUP_BYTES);
        let tail = groups.remainder();
        for (g, group) in groups.enumerate() {
            prefetch_ahead(group);
            let mut sums = [[_mm256_setzero_si256(); M]; 2];
            // SAFETY: bytes `16..48` of the group: the eight blocks' cleared fifth bits.
            let mut cleared = unsafe { _mm256_loadu_si256(group.as_ptr().add(16).cast()) };
            for c in 0..4 {
                // SAFETY: bytes `48 + 32c..80 + 32c ≤ 176` of the group.
                let q = unsafe { _mm256_loadu_si256(group.as_ptr().add(48 + 32 * c).cast()) };
                // Chunk `c`'s bits are now `r = 0..4` of each word; bit `r` to bit 4.
                let less =
                    |nibbles: __m256i, at_four: __m256i| _mm256_sub_epi16(nibbles, _mm256_and_si256(at_four, sixteen));
                let values = [
                    less(_mm256_and_si256(q, mask), _mm256_slli_epi16::<4>(cleared)),
                    less(_mm256_and_si256(_mm256_srli_epi16::<4>(q), mask), _mm256_slli_epi16::<3>(cleared)),
                    less(_mm256_and_si256(_mm256_srli_epi16::<8>(q), mask), _mm256_slli_epi16::<2>(cleared)),
                    less(_mm256_srli_epi16::<12>(q), _mm256_slli_epi16::<1>(cleared)),
                ];
                cleared = _mm256_srli_epi16::<4>(cleared);
                // SAFETY: as in `q4_1_x8`: values `GROUP_VALUES·g + 64c .. + 64` of each row.
                unsafe { add_chunk(&mut sums, values, xq.add(GROUP_VALUES * g + 64 * c), k) };
            }
            // SAFETY: the group's first 16 bytes: eight float16 scales.
            let d = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(group.as_ptr().cast())) };
            let first = super::x8::BLOCKS * g;
            for (r, acc) in acc.iter_mut().enumerate() {
                let sum = _mm256_add_epi32(sums[0][r], sums[1][r]);
                // SAFETY: blocks `first..first + 8 ≤ nb` of row `r < M`, as above.
                let sx = unsafe { _mm256_loadu_ps(xs.add(r * nb + first)) };
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, sx), *acc);
            }
        }
        let mut no_mins = [_mm256_setzero_ps(); M];
        tail_blocks(tail, 22, false, x, |b: &[u8]| q5_0_block(b), &mut acc, &mut no_mins);
        store(&[acc], &[0.0; M], out);
    }
}

/// Group `g` of a grouped Q4_1 row ([`super::x8`]) done: each activation row's eight block
/// sums (`sums`, int32, block `j` in lane `j`) scaled by the blocks' `d` and the activations'
/// scales into `acc`, the blocks' minimums times the activations' float sums into `mins`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn q4_1_x8_scale<const M: usize>(
    group: &[u8],
    g: usize,
    x: Q16View<'_>,
    sums: [__m256i; M],
    acc: &mut [__m256; M],
    mins: &mut [__m256; M],
) {
    let (nb, first) = (x.k / 32, super::x8::BLOCKS * g);
    assert!(group.len() >= 32 && x.scale.len() == M * nb && x.sum32.len() == M * nb && first + 8 <= nb);
    // SAFETY: the group's first 32 bytes (checked above): eight float16 scales, eight minimums.
    let (d, m) = unsafe {
        (
            _mm256_cvtph_ps(_mm_loadu_si128(group.as_ptr().cast())),
            _mm256_cvtph_ps(_mm_loadu_si128(group.as_ptr().add(16).cast())),
        )
    };
    for (r, ((acc, mins), sum)) in acc.iter_mut().zip(mins.iter_mut()).zip(sums).enumerate() {
        // SAFETY: blocks `first..first + 8` of row `r < M`, inside the bounds checked above.
        let (sx, s32) = unsafe {
            (
                _mm256_loadu_ps(x.scale.as_ptr().add(r * nb + first)),
                _mm256_loadu_ps(x.sum32.as_ptr().add(r * nb + first)),
            )
        };
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, sx), *acc);
        *mins = _mm256_fmadd_ps(m, s32, *mins);
    }
}

/// The end of a grouped Q4_1 row ([`super::x8`]): its last blocks (`tail`, fewer than eight,
/// in GGUF's order) into the lanes of their place in a group ([`tail_blocks`]), then each
/// activation row's sum, less the
/// minimums (`mins`: `m · Σx` in a lane a block), into `out`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn q4_1_x8_finish<const M: usize>(
    tail: &[u8],
    x: Q16View<'_>,
    mut acc: [__m256; M],
    mut mins: [__m256; M],
    out: &mut [f32],
) {
    let mut minus = [0f32; M];
    tail_blocks(tail, 20, true, x, |b: &[u8]| nibbles(b, 4), &mut acc, &mut mins);
    for (minus, mins) in minus.iter_mut().zip(&mins) {
        *minus -= hsum(*mins);
    }
    store(&[acc], &minus, out);
}

/// Adds `isum` (each row's int32 sums), scaled by `d` and the row's activation scale for
/// super-block `i`, into accumulator set `acc`.
///
/// # Safety
/// `xs` must point to at least `M · nb` scales, `i < nb`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn scale_into<const M: usize>(
    acc: &mut [__m256; M],
    isum: &[__m256i; M],
    d: f32,
    xs: *const f32,
    nb: usize,
    i: usize,
) {
    for (r, (a, isum)) in acc.iter_mut().zip(isum).enumerate() {
        // SAFETY: the caller's.
        let sx = unsafe { *xs.add(r * nb + i) };
        *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(*isum), _mm256_set1_ps(d * sx), *a);
    }
}

/// Q2_K: 256 2-bit values in 16 sub-blocks of 16, each with a 4-bit scale and a 4-bit min;
/// value = `d·scale·q − dmin·min`. `scale·q` (≤ 45) is formed in int16 and the super-block
/// summed in int32 (32 products a lane); the minimums multiply the activations' float sums of
/// 16 values, in float32 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
fn q2k<const M: usize, const A: usize>(w: &[u8], row_bytes: usize, x: Q16View<'_>, out: &mut [f32]) {
    let (k, nb) = (x.k, x.k / 256);
    assert!(row_bytes == nb * 84 && x.q.len() == M * k && x.scale.len() == M * nb && x.sum16.len() == M * 16 * nb);
    let (xq, xs, x16) = (x.q.as_ptr(), x.scale.as_ptr(), x.sum16.as_ptr());
    let three = _mm256_set1_epi16(3);
    for (row, out) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(M)) {
        let mut acc = [[_mm256_setzero_ps(); M]; A];
        for (i, b) in row.chunks_exact(84).enumerate() {
            prefetch_ahead(b);
            let (d, dmin) = (half_at(b, 80), half_at(b, 82));
            let scales = &b[0..16];
            let mut isum = [_mm256_setzero_si256(); M];
            for n in 0..2 {
                let q = [u8x16(b, 16 + 32 * n), u8x16(b, 32 + 32 * n)];
                for j in 0..4 {
                    for (h, q) in q.iter().enumerate() {
                        let sc = i16::from(scales[8 * n + 2 * j + h] & 0x0f);
                        // `srl` by a count in a register: `j` is a loop variable.
                        let shift = _mm_cvtsi32_si128(2 * j as i32);
                        let v = _mm256_and_si256(_mm256_srl_epi16(*q, shift), three);
                        let v = _mm256_mullo_epi16(v, _mm256_set1_epi16(sc));
                        for (r, isum) in isum.iter_mut().enumerate() {
                            // SAFETY: 16 values of row `r < M` in super-block `i < nb`, which
                            // the assert above bounds.
                            let p = unsafe { madd(v, xq.add(r * k + 256 * i + 128 * n + 32 * j + 16 * h)) };
                            *isum = _mm256_add_epi32(*isum, p);
                        }
                    }
                }
            }
            // SAFETY: as above.
            unsafe { scale_into(&mut acc[i % A], &isum, d, xs, nb, i) };
            // The minimums: sub-block `s`'s is the high nibble of `scales[s]`, and its
            // activations' sum is `sum16[16·i + s]`.
            // SAFETY: `scales` holds the 16 bytes read.
            let mins = _mm_and_si128(
                _mm_srli_epi16::<4>(unsafe { _mm_loadu_si128(scales.as_ptr().cast()) }),
                _mm_set1_epi8(0x0f),
            );
            let dm = _mm256_set1_ps(-dmin);
            let m0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mins)), dm);
            let m1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(mins))), dm);
            for (r, a) in acc[i % A].iter_mut().enumerate() {
                // SAFETY: sums `16·i..16·i + 16` of row `r < M`, which the assert above bounds.
                let (s0, s1) = unsafe {
                    let s = x16.add(r * 16 * nb + 16 * i);
                    (_mm256_loadu_ps(s), _mm256_loadu_ps(s.add(8)))
                };
                *a = _mm256_fmadd_ps(m1, s1, _mm256_fmadd_ps(m0, s0, *a));
            }
        }
        store(&acc, &[0.0; M], out);
    }
}

/// Q3_K: 256 3-bit values (low 2 bits in `qs`, the third in `hmask`, set: no offset of −4)
/// in 16 sub-blocks of 16 with signed 6-bit scales, and a float16 scale. `scale·q` (|·| ≤ 128)
/// is formed in int16 and the super-block summed in int32 (32 products a lane).
#[target_feature(enable = "avx2,fma,f16c")]
fn q3k<const M: usize, const A: usize>(w: &[u8], row_bytes: usize, x: Q16View<'_>, out: &mut [f32]) {
    let (k, nb) = (x.k, x.k / 256);
    assert!(row_bytes == nb * 110 && x.q.len() == M * k && x.scale.len() == M * nb);
    let (xq, xs) = (x.q.as_ptr(), x.scale.as_ptr());
    let (three, four, one) = (_mm256_set1_epi16(3), _mm256_set1_epi16(4), _mm256_set1_epi16(1));
    for (row, out) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(M)) {
        let mut acc = [[_mm256_setzero_ps(); M]; A];
        for (i, b) in row.chunks_exact(110).enumerate() {
            prefetch_ahead(b);
            let d = half_at(b, 108);
            let scales = super::scales_k3(&b[96..108]);
            let hmask = [u8x16(b, 0), u8x16(b, 16)];
            let mut isum = [_mm256_setzero_si256(); M];
            for n in 0..2 {
                let q = [u8x16(b, 32 + 32 * n), u8x16(b, 48 + 32 * n)];
                for j in 0..4 {
                    let shift = _mm_cvtsi32_si128(2 * j as i32);
                    let bit = _mm_cvtsi32_si128((4 * n + j) as i32);
                    for h in 0..2 {
                        let low = _mm256_and_si256(_mm256_srl_epi16(q[h], shift), three);
                        // Less 4 where the mask's bit is clear.
                        let set = _mm256_and_si256(_mm256_srl_epi16(hmask[h], bit), one);
                        let v = _mm256_sub_epi16(_mm256_or_si256(low, _mm256_slli_epi16::<2>(set)), four);
                        let v = _mm256_mullo_epi16(v, _mm256_set1_epi16(i16::from(scales[8 * n + 2 * j + h])));
                        for (r, isum) in isum.iter_mut().enumerate() {
                            // SAFETY: 16 values of row `r < M` in super-block `i < nb`, which
                            // the assert above bounds.
                            let p = unsafe { madd(v, xq.add(r * k + 256 * i + 128 * n + 32 * j + 16 * h)) };
                            *isum = _mm256_add_epi32(*isum, p);
                        }
                    }
                }
            }
            // SAFETY: as above.
            unsafe { scale_into(&mut acc[i % A], &isum, d, xs, nb, i) };
        }
        store(&acc, &[0.0; M], out);
    }
}

/// Q4_K and Q5_K: 256 4-bit values (Q5_K: with a fifth bit each from `qh`) in 8 sub-blocks
/// of 32, each with a 6-bit scale and min; value = `d·scale·q − dmin·min`. `scale·q` is
/// formed in int16 and the super-block summed in int32 (32 products a lane, at most
/// 32 · 31 · 63 · 32767 < 2³¹); the minimums multiply the activations' float sums of 32.
macro_rules! k_with_mins {
    ($(#[$doc:meta])* $name:ident, $bytes:literal, $qs:literal, $fifth:literal) => {
        $(#[$doc])*
        #[target_feature(enable = "avx2,fma,f16c")]
        fn $name<const M: usize, const A: usize>(w: &[u8], row_bytes: usize, x: Q16View<'_>, out: &mut [f32]) {
            let (k, nb) = (x.k, x.k / 256);
            assert!(
                row_bytes == nb * $bytes && x.q.len() == M * k && x.scale.len() == M * nb && x.sum32.len() == M * 8 * nb
            );
            let (xq, xs, x32) = (x.q.as_ptr(), x.scale.as_ptr(), x.sum32.as_ptr());
            let (nib, sixteen) = (_mm256_set1_epi16(0x0f), _mm256_set1_epi16(16));
            for (row, out) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(M)) {
                let mut acc = [[_mm256_setzero_ps(); M]; A];
                let mut minus = [0f32; M];
                for (i, b) in row.chunks_exact($bytes).enumerate() {
                    prefetch_ahead(b);
                    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
                    // Q5_K's fifth bits: bit `2g` of `qh[l]` for value `l` of sub-block `2g`,
                    // bit `2g + 1` for sub-block `2g + 1`; shifted down a pair each group.
                    let mut qh = if $fifth { [u8x16(b, 16), u8x16(b, 32)] } else { [_mm256_setzero_si256(); 2] };
                    let mut isum = [_mm256_setzero_si256(); M];
                    for g in 0..4 {
                        let (s1, m1) = super::scale_min_k4(2 * g, &b[4..16]);
                        let (s2, m2) = super::scale_min_k4(2 * g + 1, &b[4..16]);
                        let (s1, s2) = (_mm256_set1_epi16(i16::from(s1)), _mm256_set1_epi16(i16::from(s2)));
                        for h in 0..2 {
                            let q = u8x16(b, $qs + 32 * g + 16 * h);
                            let (mut lo, mut hi) = (_mm256_and_si256(q, nib), _mm256_srli_epi16::<4>(q));
                            if $fifth {
                                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16::<4>(qh[h]), sixteen));
                                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16::<3>(qh[h]), sixteen));
                                qh[h] = _mm256_srli_epi16::<2>(qh[h]);
                            }
                            let (lo, hi) = (_mm256_mullo_epi16(lo, s1), _mm256_mullo_epi16(hi, s2));
                            for (r, isum) in isum.iter_mut().enumerate() {
                                // SAFETY: values of row `r < M` in super-block `i < nb`, which
                                // the assert above bounds.
                                let (a, c) = unsafe {
                                    let base = xq.add(r * k + 256 * i + 64 * g + 16 * h);
                                    (madd(lo, base), madd(hi, base.add(32)))
                                };
                                *isum = _mm256_add_epi32(*isum, _mm256_add_epi32(a, c));
                            }
                        }
                        for (r, minus) in minus.iter_mut().enumerate() {
                            // SAFETY: sums `8·i + 2g`, `+ 1` of row `r < M`, bounded as above.
                            let (t0, t1) = unsafe {
                                let s = x32.add(r * 8 * nb + 8 * i + 2 * g);
                                (*s, *s.add(1))
                            };
                            *minus += dmin * (f32::from(m1) * t0 + f32::from(m2) * t1);
                        }
                    }
                    // SAFETY: as above.
                    unsafe { scale_into(&mut acc[i % A], &isum, d, xs, nb, i) };
                }
                store(&acc, &minus, out);
            }
        }
    };
}

k_with_mins!(
    /// Q4_K: d, dmin, 12 bytes of packed 6-bit scales and mins, 128 bytes of nibbles.
    q4k,
    144,
    16,
    false
);

k_with_mins!(
    /// Q5_K: Q4_K's layout with 32 bytes of fifth bits before the nibbles.
    q5k,
    176,
    48,
    true
);

/// Q6_K: 256 6-bit values (low 4 bits in `ql`, high 2 in `qh`) offset by 32, in 16
/// sub-blocks of 16 with int8 scales, and a float16 scale. `(q − 32)·scale` is formed in int16
/// (|·| ≤ 4096); a half super-block is summed in int32 (16 products a lane, at most
/// 16 · 4096 · 32767 < 2³¹) and converted, the whole one would overflow.
#[target_feature(enable = "avx2,fma,f16c")]
fn q6k<const M: usize, const A: usize>(w: &[u8], row_bytes: usize, x: Q16View<'_>, out: &mut [f32]) {
    let (k, nb) = (x.k, x.k / 256);
    assert!(row_bytes == nb * 210 && x.q.len() == M * k && x.scale.len() == M * nb);
    let (xq, xs) = (x.q.as_ptr(), x.scale.as_ptr());
    let (nib, three, high, off) =
        (_mm256_set1_epi16(0x0f), _mm256_set1_epi16(3), _mm256_set1_epi16(0x30), _mm256_set1_epi16(32));
    for (row, out) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(M)) {
        let mut acc = [[_mm256_setzero_ps(); M]; A];
        for (i, b) in row.chunks_exact(210).enumerate() {
            prefetch_ahead(b);
            let d = half_at(b, 208);
            for n in 0..2 {
                let mut isum = [_mm256_setzero_si256(); M];
                for h in 0..2 {
                    // Values `l = 16h..16h + 16` of the four runs of 32 of this half.
                    let qa = u8x16(b, 64 * n + 16 * h);
                    let qb = u8x16(b, 64 * n + 32 + 16 * h);
                    let c = u8x16(b, 128 + 32 * n + 16 * h);
                    let or = |low: __m256i, hi2: __m256i| _mm256_sub_epi16(_mm256_or_si256(low, hi2), off);
                    let ws = [
                        or(_mm256_and_si256(qa, nib), _mm256_slli_epi16::<4>(_mm256_and_si256(c, three))),
                        or(_mm256_and_si256(qb, nib), _mm256_and_si256(_mm256_slli_epi16::<2>(c), high)),
                        or(_mm256_srli_epi16::<4>(qa), _mm256_and_si256(c, high)),
                        or(_mm256_srli_epi16::<4>(qb), _mm256_and_si256(_mm256_srli_epi16::<2>(c), high)),
                    ];
                    for (j, wv) in ws.iter().enumerate() {
                        // Run `j`'s values `16h..` have sub-block scale `2j + h` of this half.
                        let sc = i16::from(b[192 + 8 * n + 2 * j + h] as i8);
                        let wv = _mm256_mullo_epi16(*wv, _mm256_set1_epi16(sc));
                        for (r, isum) in isum.iter_mut().enumerate() {
                            // SAFETY: 16 values of row `r < M` in super-block `i < nb`, which
                            // the assert above bounds.
                            let p = unsafe { madd(wv, xq.add(r * k + 256 * i + 128 * n + 32 * j + 16 * h)) };
                            *isum = _mm256_add_epi32(*isum, p);
                        }
                    }
                }
                // SAFETY: as above.
                unsafe { scale_into(&mut acc[(2 * i + n) % A], &isum, d, xs, nb, i) };
            }
        }
        store(&acc, &[0.0; M], out);
    }
}

/// Weight rows per packed panel of [`panel_gemm`]: two registers of int32 lanes.
pub(super) const PANEL16: usize = 16;

/// Activation rows per register tile of [`panel_gemm`] (the 16 registers hold `2·MR` int32
/// accumulators and the weights; the float32 ones live in memory between groups).
const PANEL16_MR: usize = 4;

/// `y[i·ldy + c] = Σ_t x[i][t] · w[c][t]` for every activation row `i` of `x` and weight row
/// `c < cols` of the panel `p` (packed by [`super::panel16::pack`] with [`PANEL16`] rows, a
/// 32-value format): each pair of activations is broadcast against the panel's two registers
/// of value pairs (`vpmaddwd`), a block summed in int32 (at most 16 pairs of 8-bit by 16-bit
/// products a lane) and scaled once in float32.
///
/// A row's outputs are the decode kernels' ([`band`]) bit for bit: block `b`'s scaled sum
/// goes to the `b % 8`-th of eight float accumulators an output, its minimum's to another
/// eight, and the eight are summed at the end as [`hsum`] sums a register's lanes.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn panel_gemm(p: Panel16<'_>, x: Q16View<'_>, y: &mut [f32], ldy: usize, cols: usize) {
    p.check(PANEL16, &x, y, ldy, cols);
    assert!(p.group == 32 && x.block == 32, "the int16 panels take the 32-value formats");
    let rows = x.m();
    if rows == 0 {
        return;
    }
    macro_rules! tiles {
        ($mins:literal) => {{
            let mut r = 0;
            while r + PANEL16_MR <= rows {
                tile16::<PANEL16_MR, $mins>(p, x, r, &mut y[r * ldy..], ldy, cols);
                r += PANEL16_MR;
            }
            if r == rows {
                return;
            }
            let yr = &mut y[r * ldy..];
            match rows - r {
                1 => tile16::<1, $mins>(p, x, r, yr, ldy, cols),
                2 => tile16::<2, $mins>(p, x, r, yr, ldy, cols),
                _ => tile16::<3, $mins>(p, x, r, yr, ldy, cols),
            }
        }};
    }
    if p.mn.is_empty() { tiles!(false) } else { tiles!(true) }
}

/// [`hsum`]'s order over eight registers: lane by lane, the sum [`hsum`] makes of one
/// register's eight lanes.
#[target_feature(enable = "avx2")]
#[inline]
fn lanes_sum(v: &[__m256; 8]) -> __m256 {
    let (a, b) = (_mm256_add_ps(v[0], v[4]), _mm256_add_ps(v[2], v[6]));
    let (c, d) = (_mm256_add_ps(v[1], v[5]), _mm256_add_ps(v[3], v[7]));
    _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d))
}

/// Activation rows `r0..r0 + MR` of `x` against the panel, into the first `cols` floats of
/// `MR` rows of `y` (`ldy` apart), block by block; `MINS` when the panel has minimums.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn tile16<const MR: usize, const MINS: bool>(
    p: Panel16<'_>,
    x: Q16View<'_>,
    r0: usize,
    y: &mut [f32],
    ldy: usize,
    cols: usize,
) {
    let (k, blocks) = (p.k, p.k / 32);
    // `panel_gemm` checked the panel's sizes and the scales' and sums' against `x`'s rows.
    assert!(x.q.len() >= (r0 + MR) * k && y.len() >= (MR - 1) * ldy + cols);
    let (pq, pf, pm, xq) = (p.q.as_ptr(), p.f.as_ptr(), p.mn.as_ptr(), x.q.as_ptr());
    // Per lane `b % 8` of the decode kernels' registers: the blocks' scaled sums, the
    // minimums' parts. A lane's blocks in turn (`b`, `b + 8`, ...), its sums in registers.
    let mut lane_f = [[[_mm256_setzero_ps(); 2]; MR]; 8];
    let mut lane_m = [[[_mm256_setzero_ps(); 2]; MR]; 8];
    for lane in 0..8.min(blocks) {
        let mut facc = [[_mm256_setzero_ps(); 2]; MR];
        let mut macc = [[_mm256_setzero_ps(); 2]; MR];
        for b in (lane..blocks).step_by(8) {
            let mut iacc = [[_mm256_setzero_si256(); 2]; MR];
            for t in 0..16 {
                let pair = b * 16 + t;
                // SAFETY: pair `pair < k / 2` of the panel (`k·PANEL16` values) and of rows
                // `r0..r0 + MR` of `x`, which the asserts bound.
                unsafe {
                    let w0 = _mm256_loadu_si256(pq.add(pair * 2 * PANEL16).cast());
                    let w1 = _mm256_loadu_si256(pq.add(pair * 2 * PANEL16 + 16).cast());
                    for (i, acc) in iacc.iter_mut().enumerate() {
                        let xv = _mm256_set1_epi32(xq.add((r0 + i) * k + 2 * pair).cast::<i32>().read_unaligned());
                        acc[0] = _mm256_add_epi32(acc[0], _mm256_madd_epi16(xv, w0));
                        acc[1] = _mm256_add_epi32(acc[1], _mm256_madd_epi16(xv, w1));
                    }
                }
            }
            // SAFETY: block `b < k / 32` of the panel's factors and minimums and of each row's
            // scales and sums, which the asserts bound.
            unsafe {
                let f = [_mm256_loadu_ps(pf.add(b * PANEL16)), _mm256_loadu_ps(pf.add(b * PANEL16 + 8))];
                for (i, ((facc, macc), iacc)) in facc.iter_mut().zip(macc.iter_mut()).zip(&iacc).enumerate() {
                    let sx = _mm256_set1_ps(*x.scale.get_unchecked((r0 + i) * blocks + b));
                    for ((facc, &iacc), &f) in facc.iter_mut().zip(iacc).zip(&f) {
                        *facc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc), _mm256_mul_ps(f, sx), *facc);
                    }
                    if MINS {
                        let s = _mm256_set1_ps(*x.sum32.get_unchecked((r0 + i) * blocks + b));
                        for (h, macc) in macc.iter_mut().enumerate() {
                            *macc = _mm256_fmadd_ps(_mm256_loadu_ps(pm.add(b * PANEL16 + 8 * h)), s, *macc);
                        }
                    }
                }
            }
        }
        (lane_f[lane], lane_m[lane]) = (facc, macc);
    }
    let mut row = [0f32; PANEL16];
    for i in 0..MR {
        for h in 0..2 {
            let mut v = lanes_sum(&std::array::from_fn(|l| lane_f[l][i][h]));
            if MINS {
                // `store`'s `sum − (0 − minimums)`.
                let m = lanes_sum(&std::array::from_fn(|l| lane_m[l][i][h]));
                v = _mm256_sub_ps(v, _mm256_sub_ps(_mm256_setzero_ps(), m));
            }
            // SAFETY: `row` holds the 16 floats stored.
            unsafe { _mm256_storeu_ps(row.as_mut_ptr().add(8 * h), v) };
        }
        y[i * ldy..i * ldy + cols].copy_from_slice(&row[..cols]);
    }
}
