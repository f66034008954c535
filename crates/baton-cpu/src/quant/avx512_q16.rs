//! AVX-512BW kernels of [`super`] against int16 activations ([`super::q16`]) for Q4_K and
//! Q6_K; the 32-value formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) go to [`super::avx2_q16`]'s
//! kernels, which are faster than 512-bit ones were (see [`band`]), except Q4_1's grouped rows
//! on a CPU with AVX-512 VNNI, which meet the activations' bytes here ([`q4_1_x8_band`],
//! `vpdpbusd` in 256-bit registers); Q2_K, Q3_K and Q5_K take
//! float32 activations through [`super`]'s other kernels (see [`supports`]). Each weight block
//! is decoded into int16 lanes (the K formats' integer sub-block scales multiplied in), and
//! `vpmaddwd` multiplies it with every activation row, exact in int32. Only a block's sum (32
//! values; a K super-block's 256) is converted and scaled in float32, where the float32 kernels
//! of [`super::avx512`] convert and scale every value: on cores that split 512-bit float work
//! in two (AMD Zen 4) that work, not memory, bounded a decode step's smaller matrices.

use std::arch::x86_64::*;

use super::BlockFormat;
use super::panel16::Panel16;
use super::q16::{Q16View, q16_block};

/// `out[i·m + r] = w[first + i] · x[r]` for every weight row `i` that `out` has room for,
/// where weight row `j` is `bytes[j·row_bytes..]` in `format`; `x.block` must be 256 for the
/// K formats and 32 for the others.
///
/// # Safety
/// The CPU must support AVX-512F, AVX-512BW, AVX-512VL, AVX2, FMA and F16C.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn band(
    format: BlockFormat,
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
    assert!(x.block == q16_block(format) && x.scale.len() * x.block == m * cols && x.sum32.len() * 32 == m * cols);
    assert!(bytes.len() >= (first + rows) * row_bytes && out.len() == rows * m);
    let w = &bytes[first * row_bytes..(first + rows) * row_bytes];
    // Two accumulators per activation row hide the FMA latency, whatever `M`: a super-block's
    // float sum goes to accumulator `i % A`, so an `A` that changed with `M` would change a
    // row's rounding with its batch.
    macro_rules! by_rows {
        ($kernel:ident) => {
            match m {
                1 => $kernel::<1, 2>(w, row_bytes, x, out),
                2 => $kernel::<2, 2>(w, row_bytes, x, out),
                3 => $kernel::<3, 2>(w, row_bytes, x, out),
                4 => $kernel::<4, 2>(w, row_bytes, x, out),
                5 => $kernel::<5, 2>(w, row_bytes, x, out),
                6 => $kernel::<6, 2>(w, row_bytes, x, out),
                7 => $kernel::<7, 2>(w, row_bytes, x, out),
                8 => $kernel::<8, 2>(w, row_bytes, x, out),
                _ => {
                    // More rows than registers allow: eight at a time.
                    // SAFETY (inside): the same CPU features as this function's.
                    super::q16::by_row_chunks(x, 8, out, |xs, part| unsafe {
                        band(format, w, row_bytes, cols, 0, xs, part)
                    });
                }
            }
        };
    }
    match format {
        BlockFormat::Q8_0 | BlockFormat::Q4_0 | BlockFormat::Q4_1 | BlockFormat::Q5_0 | BlockFormat::Q5_1 => {
            // The 32-value formats take AVX2's kernels, which sum eight blocks in int32 before
            // scaling them together: faster than 512-bit kernels that scale every block (on
            // Zen 4, 24 against 17 Gweights/s for Q4_1; see `avx2_q16`).
            // SAFETY: this function's CPU features include AVX2, FMA and F16C.
            unsafe { super::avx2_q16::band(format, false, bytes, row_bytes, cols, first, x, out) }
        }
        BlockFormat::Q4K => by_rows!(q4k),
        BlockFormat::Q6K => by_rows!(q6k),
        BlockFormat::Q2K | BlockFormat::Q3K | BlockFormat::Q5K => {
            unreachable!("no int16 kernel for {format:?}; `supports` routes it elsewhere")
        }
    }
}

/// Whether [`band`] multiplies `format` (its own kernel, or for the 32-value formats AVX2's); the
/// others take float32 activations.
pub(crate) fn supports(format: BlockFormat) -> bool {
    !matches!(format, BlockFormat::Q2K | BlockFormat::Q3K | BlockFormat::Q5K)
}

/// The float16 at `b[i..i + 2]`.
#[target_feature(enable = "avx512f,f16c")]
#[inline]
fn half_at(b: &[u8], i: usize) -> f32 {
    let bits = u16::from_le_bytes([b[i], b[i + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// 32 bytes from `b[i..]`, zero-extended to 32 int16 lanes.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn u8x32(b: &[u8], i: usize) -> __m512i {
    let s = &b[i..i + 32];
    // SAFETY: `s` holds the 32 bytes read.
    _mm512_cvtepu8_epi16(unsafe { _mm256_loadu_si256(s.as_ptr().cast()) })
}

/// 32 int16 activations from `q`, multiplied pairwise with `w` and summed in pairs: 16 int32
/// lanes. (Pointers, not slices, in the kernels' inner loops: the bounds checks of slices
/// there cost more than the arithmetic; `band` checks the sizes once.)
///
/// # Safety
/// `q` must point to 32 readable values.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn madd(w: __m512i, q: *const i16) -> __m512i {
    // SAFETY: the caller's.
    _mm512_madd_epi16(w, unsafe { _mm512_loadu_si512(q.cast()) })
}

/// Writes the sum of each activation row's accumulators to one output row, less `minus[r]`.
#[target_feature(enable = "avx512f")]
#[inline]
fn store<const M: usize, const A: usize>(acc: &[[__m512; M]; A], minus: &[f32; M], out: &mut [f32]) {
    for (r, o) in out.iter_mut().enumerate() {
        let mut s = acc[0][r];
        for a in &acc[1..] {
            s = _mm512_add_ps(s, a[r]);
        }
        *o = _mm512_reduce_add_ps(s) - minus[r];
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
#[target_feature(enable = "avx512f")]
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

/// Q4_K: 256 4-bit values in 8 sub-blocks of 32, each with a 6-bit scale and min; value =
/// `d·scale·q − dmin·min`. `scale·q` is formed in int16 and the super-block summed in int32
/// (at most 8 · 2 · 15 · 63 · 32767 < 2³¹ per lane); the minimums multiply the activations'
/// float sums.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
fn q4k<const M: usize, const A: usize>(w: &[u8], row_bytes: usize, x: Q16View<'_>, out: &mut [f32]) {
    let (k, nb) = (x.k, x.k / 256);
    assert!(row_bytes == nb * 144 && x.q.len() == M * k && x.scale.len() == M * nb && x.sum32.len() == M * 8 * nb);
    let (xq, xs, x32) = (x.q.as_ptr(), x.scale.as_ptr(), x.sum32.as_ptr());
    let nib = _mm512_set1_epi16(0x0f);
    for (row, out) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(M)) {
        let mut acc = [[_mm512_setzero_ps(); M]; A];
        let mut minus = [0f32; M];
        for (i, b) in row.chunks_exact(144).enumerate() {
            prefetch_ahead(b);
            let (d, dmin) = (half_at(b, 0), half_at(b, 2));
            let mut isum = [_mm512_setzero_si512(); M];
            for g in 0..4 {
                let (s1, m1) = super::scale_min_k4(2 * g, &b[4..16]);
                let (s2, m2) = super::scale_min_k4(2 * g + 1, &b[4..16]);
                let q = u8x32(b, 16 + 32 * g);
                let lo = _mm512_mullo_epi16(_mm512_and_si512(q, nib), _mm512_set1_epi16(i16::from(s1)));
                let hi = _mm512_mullo_epi16(_mm512_srli_epi16::<4>(q), _mm512_set1_epi16(i16::from(s2)));
                for (r, isum) in isum.iter_mut().enumerate() {
                    let base = r * k + 256 * i + 64 * g;
                    // SAFETY: values `base..base + 64` and sums `base / 32..+ 2` of row `r < M`,
                    // super-block `i < nb`, which the assert above bounds.
                    let (a, b, s0, s1) = unsafe {
                        let s = x32.add(base / 32);
                        (madd(lo, xq.add(base)), madd(hi, xq.add(base + 32)), *s, *s.add(1))
                    };
                    *isum = _mm512_add_epi32(*isum, _mm512_add_epi32(a, b));
                    minus[r] += dmin * (f32::from(m1) * s0 + f32::from(m2) * s1);
                }
            }
            for (r, isum) in isum.iter().enumerate() {
                // SAFETY: as above.
                let sx = unsafe { *xs.add(r * nb + i) };
                let a = &mut acc[i % A][r];
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(*isum), _mm512_set1_ps(d * sx), *a);
            }
        }
        store(&acc, &minus, out);
    }
}

/// Q6_K: 256 6-bit values (low 4 bits in `ql`, high 2 in `qh`) offset by 32, in 16
/// sub-blocks of 16 with int8 scales, and a float16 scale. `(q − 32)·scale` is formed in int16
/// (|·| ≤ 4096) and the super-block summed in int32 (at most 8 · 2 · 4096 · 32767 < 2³¹).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
fn q6k<const M: usize, const A: usize>(w: &[u8], row_bytes: usize, x: Q16View<'_>, out: &mut [f32]) {
    let (k, nb) = (x.k, x.k / 256);
    assert!(row_bytes == nb * 210 && x.q.len() == M * k && x.scale.len() == M * nb);
    let (xq, xs) = (x.q.as_ptr(), x.scale.as_ptr());
    let (nib, three, high, off) =
        (_mm512_set1_epi16(0x0f), _mm512_set1_epi16(3), _mm512_set1_epi16(0x30), _mm512_set1_epi16(32));
    for (row, out) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(M)) {
        let mut acc = [[_mm512_setzero_ps(); M]; A];
        for (i, b) in row.chunks_exact(210).enumerate() {
            prefetch_ahead(b);
            let d = half_at(b, 208);
            // The scale of sub-blocks `j` (lanes 0-15) and `j + 1` (lanes 16-31).
            let scale = |j: usize| {
                let (lo, hi) = (i16::from(b[192 + j] as i8), i16::from(b[193 + j] as i8));
                _mm512_mask_blend_epi16(0xffff_0000, _mm512_set1_epi16(lo), _mm512_set1_epi16(hi))
            };
            let mut isum = [_mm512_setzero_si512(); M];
            for n in 0..2 {
                let qa = u8x32(b, 64 * n);
                let qb = u8x32(b, 64 * n + 32);
                let c = u8x32(b, 128 + 32 * n);
                let or = |low: __m512i, hi2: __m512i| _mm512_sub_epi16(_mm512_or_si512(low, hi2), off);
                let ws = [
                    or(_mm512_and_si512(qa, nib), _mm512_slli_epi16::<4>(_mm512_and_si512(c, three))),
                    or(_mm512_and_si512(qb, nib), _mm512_and_si512(_mm512_slli_epi16::<2>(c), high)),
                    or(_mm512_srli_epi16::<4>(qa), _mm512_and_si512(c, high)),
                    or(_mm512_srli_epi16::<4>(qb), _mm512_and_si512(_mm512_srli_epi16::<2>(c), high)),
                ];
                for (j, wv) in ws.iter().enumerate() {
                    let wv = _mm512_mullo_epi16(*wv, scale(8 * n + 2 * j));
                    for (r, isum) in isum.iter_mut().enumerate() {
                        // SAFETY: 32 values of row `r < M` in super-block `i < nb`, which the
                        // assert above bounds.
                        let p = unsafe { madd(wv, xq.add(r * k + 256 * i + 128 * n + 32 * j)) };
                        *isum = _mm512_add_epi32(*isum, p);
                    }
                }
            }
            for (r, isum) in isum.iter().enumerate() {
                // SAFETY: as above.
                let sx = unsafe { *xs.add(r * nb + i) };
                let a = &mut acc[i % A][r];
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(*isum), _mm512_set1_ps(d * sx), *a);
            }
        }
        store(&acc, &[0.0; M], out);
    }
}

/// `out[i·m + r] = w[first + i] · x[r]` for grouped Q4_1 rows ([`super::x8`]) against
/// activations that carry their [`super::x8::byte_planes`]: `vpdpbusd` multiplies four bytes
/// into an int32 lane at once, so a chunk of 64 nibbles costs a mask, a shift and a mask, and
/// four of them a row (high bytes against both nibble registers, low bytes likewise), where
/// [`super::avx2_q16`]'s `vpmaddwd` kernel widens the nibbles to int16 first (three more) and
/// adds every product pair's sum (four more). A lane's sums are exact (the high bytes' at most
/// 32 · 15 · 128, the low bytes' 32 · 15 · 255) and `256·h + l` is the int16 kernel's sum, so
/// every output is that kernel's, bit for bit.
///
/// # Safety
/// The CPU must support AVX-512F, AVX-512BW, AVX-512VL, AVX-512 VNNI, AVX2, FMA and F16C.
pub(super) unsafe fn q4_1_x8_band(
    bytes: &[u8],
    row_bytes: usize,
    cols: usize,
    first: usize,
    x: Q16View<'_>,
    out: &mut [f32],
) {
    let m = x.m();
    let rows = out.len() / m;
    assert!(cols == x.k && row_bytes == cols / 32 * 20 && x.block == 32);
    assert!(bytes.len() >= (first + rows) * row_bytes && out.len() == rows * m);
    let w = &bytes[first * row_bytes..(first + rows) * row_bytes];
    // SAFETY (each call): the caller's CPU features are the kernels'.
    match m {
        1 => unsafe { q4_1_x8_vnni::<1, 2>(w, row_bytes, x, out) },
        2 => unsafe { q4_1_x8_vnni::<2, 2>(w, row_bytes, x, out) },
        3 => unsafe { q4_1_x8_vnni::<3, 1>(w, row_bytes, x, out) },
        4 => unsafe { q4_1_x8_vnni::<4, 1>(w, row_bytes, x, out) },
        _ => {
            // More rows than registers allow: four at a time.
            // SAFETY (inside): the caller's.
            super::q16::by_row_chunks(x, 4, out, |xs, part| unsafe { q4_1_x8_band(w, row_bytes, cols, 0, xs, part) });
        }
    }
}

/// [`q4_1_x8_band`] for `M` activation rows, each with `2·A` int32 sums a group.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q4_1_x8_vnni<const M: usize, const A: usize>(w: &[u8], row_bytes: usize, x: Q16View<'_>, out: &mut [f32]) {
    use super::x8::{GROUP_BYTES, GROUP_VALUES, PLANE_GROUP_BYTES};
    let (k, nb) = (x.k, x.k / 32);
    let plane_row = k / GROUP_VALUES * PLANE_GROUP_BYTES;
    assert!(row_bytes == nb * 20 && x.q.len() == M * k && x.scale.len() == M * nb && x.sum32.len() == M * nb);
    assert!(x.bytes.len() == M * plane_row);
    let xb = x.bytes.as_ptr();
    let mask = _mm256_set1_epi8(0x0f);
    for (row, out) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(M)) {
        let mut acc = [_mm256_setzero_ps(); M];
        let mut mins = [_mm256_setzero_ps(); M];
        let groups = row.chunks_exact(GROUP_BYTES);
        let tail = groups.remainder();
        for (g, group) in groups.enumerate() {
            prefetch_ahead(group);
            // The high bytes' sums and the low bytes', `A` of each a row so that the chunks'
            // products need not wait on each other.
            let mut high = [[_mm256_setzero_si256(); M]; A];
            let mut low = [[_mm256_setzero_si256(); M]; A];
            for c in 0..4 {
                // SAFETY: bytes `32 + 32c..64 + 32c < 160` of the group.
                let q = unsafe { _mm256_loadu_si256(group.as_ptr().add(32 + 32 * c).cast()) };
                let (lo, hi) = (_mm256_and_si256(q, mask), _mm256_and_si256(_mm256_srli_epi16::<4>(q), mask));
                for r in 0..M {
                    // SAFETY: the runs of chunk `c` of group `g` of row `r < M`, inside the
                    // planes the assert above sizes (`g` counts whole groups of the row).
                    unsafe {
                        let p = xb.add(r * plane_row + g * PLANE_GROUP_BYTES + 128 * c).cast::<__m256i>();
                        let (h, l) = (&mut high[c % A][r], &mut low[c % A][r]);
                        *h = _mm256_dpbusd_epi32(*h, lo, _mm256_loadu_si256(p));
                        *h = _mm256_dpbusd_epi32(*h, hi, _mm256_loadu_si256(p.add(1)));
                        *l = _mm256_dpbusd_epi32(*l, _mm256_loadu_si256(p.add(2)), lo);
                        *l = _mm256_dpbusd_epi32(*l, _mm256_loadu_si256(p.add(3)), hi);
                    }
                }
            }
            let mut sums = [_mm256_setzero_si256(); M];
            for (r, sum) in sums.iter_mut().enumerate() {
                let (mut h, mut l) = (high[0][r], low[0][r]);
                for a in 1..A {
                    (h, l) = (_mm256_add_epi32(h, high[a][r]), _mm256_add_epi32(l, low[a][r]));
                }
                *sum = _mm256_add_epi32(_mm256_slli_epi32::<8>(h), l);
            }
            super::avx2_q16::q4_1_x8_scale(group, g, x, sums, &mut acc, &mut mins);
        }
        super::avx2_q16::q4_1_x8_finish(tail, x, acc, mins, out);
    }
}

/// Weight rows per packed panel of [`panel_gemm`]: two registers of int32 lanes.
pub(super) const PANEL16: usize = 32;

/// Activation rows per register tile of [`panel_gemm`]: `2·MR` int32 accumulators in
/// registers, the float32 ones in memory between blocks.
const PANEL16_MR: usize = 6;

/// `y[i·ldy + c] = Σ_t x[i][t] · w[c][t]` for every activation row `i` of `x` and weight row
/// `c < cols` of the panel `p` (packed by [`super::panel16::pack`] with [`PANEL16`] rows, a
/// 32-value format): each pair of activations is broadcast against the panel's two registers
/// of value pairs (`vpdpwssd`), a block summed in int32 and scaled once in float32.
///
/// A row's outputs are the decode kernels' ([`super::avx2_q16::band`], [`q4_1_x8_band`]) bit
/// for bit: block `b`'s scaled sum goes to the `b % 8`-th of eight float accumulators an
/// output, its minimum's to another eight, and the eight are summed at the end as those
/// kernels sum a register's eight lanes.
///
/// # Safety
/// The CPU must support AVX-512F, AVX-512BW, AVX-512VL, AVX-512 VNNI and FMA.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
pub(super) unsafe fn panel_gemm(p: Panel16<'_>, x: Q16View<'_>, y: &mut [f32], ldy: usize, cols: usize) {
    p.check(PANEL16, &x, y, ldy, cols);
    assert!(p.group == 32 && x.block == 32, "the int16 panels take the 32-value formats");
    let rows = x.m();
    if rows == 0 {
        return;
    }
    let masks = [((1u32 << cols.min(16)) - 1) as u16, ((1u32 << cols.saturating_sub(16)) - 1) as u16];
    macro_rules! tiles {
        ($mins:literal) => {{
            let mut r = 0;
            while r + PANEL16_MR <= rows {
                tile16::<PANEL16_MR, $mins>(p, x, r, &mut y[r * ldy..], ldy, masks);
                r += PANEL16_MR;
            }
            if r == rows {
                return;
            }
            let yr = &mut y[r * ldy..];
            match rows - r {
                1 => tile16::<1, $mins>(p, x, r, yr, ldy, masks),
                2 => tile16::<2, $mins>(p, x, r, yr, ldy, masks),
                3 => tile16::<3, $mins>(p, x, r, yr, ldy, masks),
                4 => tile16::<4, $mins>(p, x, r, yr, ldy, masks),
                _ => tile16::<5, $mins>(p, x, r, yr, ldy, masks),
            }
        }};
    }
    if p.mn.is_empty() { tiles!(false) } else { tiles!(true) }
}

/// The decode kernels' sum of a register's eight lanes (`avx2_q16::hsum`), lane by lane over
/// eight registers.
#[target_feature(enable = "avx512f")]
#[inline]
fn lanes_sum(v: &[__m512; 8]) -> __m512 {
    let (a, b) = (_mm512_add_ps(v[0], v[4]), _mm512_add_ps(v[2], v[6]));
    let (c, d) = (_mm512_add_ps(v[1], v[5]), _mm512_add_ps(v[3], v[7]));
    _mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, d))
}

/// Activation rows `r0..r0 + MR` of `x` against the panel, into `y` (rows `ldy` apart), block
/// by block; `MINS` when the panel has minimums.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
#[inline]
fn tile16<const MR: usize, const MINS: bool>(
    p: Panel16<'_>,
    x: Q16View<'_>,
    r0: usize,
    y: &mut [f32],
    ldy: usize,
    masks: [u16; 2],
) {
    let (k, blocks) = (p.k, p.k / 32);
    // `panel_gemm` checked the panel's sizes and the scales' and sums' against `x`'s rows.
    assert!(
        x.q.len() >= (r0 + MR) * k
            && y.len() >= (MR - 1) * ldy + (masks[0].count_ones() + masks[1].count_ones()) as usize
    );
    let (pf, pm) = (p.f.as_ptr(), p.mn.as_ptr());
    // Each row's activations as pairs (one 32-bit broadcast each), and the panel's pairs.
    let xr: [*const i32; MR] = std::array::from_fn(|i| x.q[(r0 + i) * k..].as_ptr().cast());
    let pq = p.q.as_ptr().cast::<__m512i>();
    // Per lane `b % 8` of the decode kernels' registers: the blocks' scaled sums, the
    // minimums' parts. A lane's blocks in turn (`b`, `b + 8`, ...), its sums in registers.
    let mut lane_f = [[[_mm512_setzero_ps(); 2]; MR]; 8];
    let mut lane_m = [[[_mm512_setzero_ps(); 2]; MR]; 8];
    for lane in 0..8.min(blocks) {
        let mut facc = [[_mm512_setzero_ps(); 2]; MR];
        let mut macc = [[_mm512_setzero_ps(); 2]; MR];
        for b in (lane..blocks).step_by(8) {
            let mut iacc = [[_mm512_setzero_si512(); 2]; MR];
            for t in 0..16 {
                let pair = b * 16 + t;
                // SAFETY: pair `pair < k / 2` of the panel (`k·PANEL16` values, two registers
                // a pair) and of rows `r0..r0 + MR` of `x`, which the asserts bound.
                unsafe {
                    let (w0, w1) = (_mm512_loadu_si512(pq.add(2 * pair)), _mm512_loadu_si512(pq.add(2 * pair + 1)));
                    for (acc, xr) in iacc.iter_mut().zip(&xr) {
                        let xv = _mm512_set1_epi32(xr.add(pair).read_unaligned());
                        acc[0] = _mm512_dpwssd_epi32(acc[0], xv, w0);
                        acc[1] = _mm512_dpwssd_epi32(acc[1], xv, w1);
                    }
                }
            }
            // SAFETY: block `b < k / 32` of the panel's factors and minimums and of each row's
            // scales and sums, which the asserts bound.
            unsafe {
                let f = [_mm512_loadu_ps(pf.add(b * PANEL16)), _mm512_loadu_ps(pf.add(b * PANEL16 + 16))];
                for (i, ((facc, macc), iacc)) in facc.iter_mut().zip(macc.iter_mut()).zip(&iacc).enumerate() {
                    let sx = _mm512_set1_ps(*x.scale.get_unchecked((r0 + i) * blocks + b));
                    for ((facc, &iacc), &f) in facc.iter_mut().zip(iacc).zip(&f) {
                        *facc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc), _mm512_mul_ps(f, sx), *facc);
                    }
                    if MINS {
                        let s = _mm512_set1_ps(*x.sum32.get_unchecked((r0 + i) * blocks + b));
                        for (h, macc) in macc.iter_mut().enumerate() {
                            *macc = _mm512_fmadd_ps(_mm512_loadu_ps(pm.add(b * PANEL16 + 16 * h)), s, *macc);
                        }
                    }
                }
            }
        }
        (lane_f[lane], lane_m[lane]) = (facc, macc);
    }
    for i in 0..MR {
        let row = &mut y[i * ldy..];
        for h in 0..2 {
            let mut v = lanes_sum(&std::array::from_fn(|l| lane_f[l][i][h]));
            if MINS {
                // The decode kernels' `sum − (0 − minimums)`.
                let m = lanes_sum(&std::array::from_fn(|l| lane_m[l][i][h]));
                v = _mm512_sub_ps(v, _mm512_sub_ps(_mm512_setzero_ps(), m));
            }
            // SAFETY: the masks select the first `cols` floats, which the assert above shows
            // the row holds; masked-off lanes are not accessed.
            unsafe { _mm512_mask_storeu_ps(row.as_mut_ptr().wrapping_add(16 * h), masks[h], v) };
        }
    }
}
