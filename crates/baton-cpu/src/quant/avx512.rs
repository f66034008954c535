//! AVX-512 kernels of [`super`]: each weight block is decoded into registers and multiplied
//! into the float32 activations right there, never stored; the decode is shared by every
//! activation row of the call (`M` of them, a compile-time count so the accumulators stay in
//! registers).
//!
//! The values are the ones [`super::BlockFormat::decode`] produces (quantized integers made
//! exact in int32 lanes, then scaled in float32); only the order of the sums differs.

use std::arch::x86_64::*;

use super::BlockFormat;

/// Whether this module has a kernel for `format` (the others go through [`super`]'s
/// decode-then-dot, or its int16 kernels).
pub(super) fn supports(format: BlockFormat) -> bool {
    matches!(format, BlockFormat::Q4_0 | BlockFormat::Q5_0 | BlockFormat::Q8_0 | BlockFormat::Q4K | BlockFormat::Q6K)
}

/// `out[i·m + r] = w[first + i] · x[r]` for every weight row `i` that `out` has room for,
/// where weight row `j` is `bytes[j·row_bytes..]` in `format` and `x` is `[m][cols]`.
///
/// # Safety
/// The CPU must support AVX-512F, FMA and F16C.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,fma,f16c")]
pub(super) unsafe fn band(
    format: BlockFormat,
    bytes: &[u8],
    row_bytes: usize,
    cols: usize,
    first: usize,
    x: &[f32],
    m: usize,
    out: &mut [f32],
) {
    let rows = out.len() / m;
    assert!(cols.is_multiple_of(format.block_len()) && row_bytes == cols / format.block_len() * format.block_bytes());
    assert!(bytes.len() >= (first + rows) * row_bytes && x.len() >= m * cols && out.len() == rows * m);
    let w = &bytes[first * row_bytes..(first + rows) * row_bytes];
    // Two independent accumulators per activation row hide the FMA latency, whatever `M`: a
    // block's products go to accumulator `j % A`, so an `A` that changed with `M` would change
    // a row's rounding with its batch.
    macro_rules! by_rows {
        ($kernel:ident) => {
            match m {
                1 => $kernel::<1, 2>(w, row_bytes, x, cols, out),
                2 => $kernel::<2, 2>(w, row_bytes, x, cols, out),
                3 => $kernel::<3, 2>(w, row_bytes, x, cols, out),
                4 => $kernel::<4, 2>(w, row_bytes, x, cols, out),
                _ => {
                    // More rows than registers allow: four at a time.
                    let mut part = vec![0f32; rows * 4];
                    for r0 in (0..m).step_by(4) {
                        let mr = 4.min(m - r0);
                        let xs = &x[r0 * cols..(r0 + mr) * cols];
                        // SAFETY: the same CPU features as this function's.
                        unsafe { band(format, w, row_bytes, cols, 0, xs, mr, &mut part[..rows * mr]) };
                        for (o, p) in out.chunks_exact_mut(m).zip(part.chunks_exact(mr)) {
                            o[r0..r0 + mr].copy_from_slice(p);
                        }
                    }
                }
            }
        };
    }
    match format {
        BlockFormat::Q8_0 => by_rows!(q8_0),
        BlockFormat::Q4_0 => by_rows!(q4_0),
        BlockFormat::Q5_0 => by_rows!(q5_0),
        BlockFormat::Q4K => by_rows!(q4k),
        BlockFormat::Q6K => by_rows!(q6k),
        BlockFormat::Q4_1 | BlockFormat::Q5_1 | BlockFormat::Q2K | BlockFormat::Q3K | BlockFormat::Q5K => {
            unreachable!("no float32 AVX-512 kernel for {format:?}; `supports` routes it elsewhere")
        }
    }
}

/// The float16 at `b[i..i + 2]`.
#[target_feature(enable = "avx512f,f16c")]
#[inline]
fn half_at(b: &[u8], i: usize) -> f32 {
    let bits = u16::from_le_bytes([b[i], b[i + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// 16 bytes from `b[i..]`, zero-extended to 16 int32 lanes.
#[target_feature(enable = "avx512f")]
#[inline]
fn u8x16(b: &[u8], i: usize) -> __m512i {
    let s = &b[i..i + 16];
    // SAFETY: `s` holds the 16 bytes read.
    _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(s.as_ptr().cast()) })
}

/// 16 bytes from `b[i..]`, sign-extended to 16 int32 lanes.
#[target_feature(enable = "avx512f")]
#[inline]
fn i8x16(b: &[u8], i: usize) -> __m512i {
    let s = &b[i..i + 16];
    // SAFETY: `s` holds the 16 bytes read.
    _mm512_cvtepi8_epi32(unsafe { _mm_loadu_si128(s.as_ptr().cast()) })
}

/// 16 floats from `x[i..]`.
#[target_feature(enable = "avx512f")]
#[inline]
fn f32x16(x: &[f32], i: usize) -> __m512 {
    let s = &x[i..i + 16];
    // SAFETY: `s` holds the 16 floats read.
    unsafe { _mm512_loadu_ps(s.as_ptr()) }
}

/// Writes the sum of each activation row's accumulators to one output row.
#[target_feature(enable = "avx512f")]
#[inline]
fn store<const M: usize, const A: usize>(acc: &[[__m512; M]; A], out: &mut [f32]) {
    for (r, o) in out.iter_mut().enumerate() {
        let mut s = acc[0][r];
        for a in &acc[1..] {
            s = _mm512_add_ps(s, a[r]);
        }
        *o = _mm512_reduce_add_ps(s);
    }
}

/// How far ahead of the block being decoded the kernels prefetch: the matrices stream from
/// memory (the Q8_0 output head alone is most of a decode step's bytes), and prefetching this
/// far ahead took a single thread's read of an 89 MB Q8_0 matrix from 9 to 16-17 GB/s.
const PREFETCH_BYTES: usize = 2048;

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

/// A kernel for a format of 32-value blocks: `$decode(b)` gives the block's scale and its 32
/// integers as floats (two registers); the block's products are summed unscaled and scaled
/// once. Consecutive blocks go to different accumulators.
macro_rules! small_blocks {
    ($(#[$doc:meta])* $name:ident, $bytes:literal, $decode:expr) => {
        $(#[$doc])*
        #[target_feature(enable = "avx512f,fma,f16c")]
        fn $name<const M: usize, const A: usize>(w: &[u8], row_bytes: usize, x: &[f32], k: usize, out: &mut [f32]) {
            for (row, out) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(M)) {
                let mut acc = [[_mm512_setzero_ps(); M]; A];
                // One block into accumulator set `a` (a constant once the loops unroll).
                let block = |acc: &mut [__m512; M], i: usize, b: &[u8]| {
                    let (d, lo, hi): (f32, __m512, __m512) = $decode(b);
                    let d = _mm512_set1_ps(d);
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let xb = r * k + 32 * i;
                        let t = _mm512_fmadd_ps(hi, f32x16(x, xb + 16), _mm512_mul_ps(lo, f32x16(x, xb)));
                        *acc = _mm512_fmadd_ps(t, d, *acc);
                    }
                };
                let groups = row.chunks_exact($bytes * A);
                let tail = groups.remainder();
                let mut i = 0;
                for g in groups {
                    // Streams from memory run ahead of the hardware prefetcher (the Q8_0 output
                    // head is most of a decode step's bytes).
                    prefetch_ahead(g);
                    for (a, acc) in acc.iter_mut().enumerate() {
                        block(acc, i + a, &g[$bytes * a..$bytes * (a + 1)]);
                    }
                    i += A;
                }
                for b in tail.chunks_exact($bytes) {
                    block(&mut acc[0], i, b);
                    i += 1;
                }
                store(&acc, out);
            }
        }
    };
}

small_blocks!(
    /// Q8_0: 32 int8 values and a float16 scale.
    q8_0,
    34,
    |b: &[u8]| (half_at(b, 0), _mm512_cvtepi32_ps(i8x16(b, 2)), _mm512_cvtepi32_ps(i8x16(b, 18)))
);

small_blocks!(
    /// Q4_0: 32 4-bit values (low nibbles first, then high) offset by 8, and a float16 scale.
    q4_0,
    18,
    |b: &[u8]| {
        let (nib, eight) = (_mm512_set1_epi32(0x0f), _mm512_set1_epi32(8));
        let q = u8x16(b, 2);
        let lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(q, nib), eight));
        let hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32::<4>(q), eight));
        (half_at(b, 0), lo, hi)
    }
);

small_blocks!(
    /// Q5_0: Q4_0's nibbles with a fifth bit each from a 32-bit mask, offset by 16.
    q5_0,
    22,
    |b: &[u8]| {
        let (nib, sixteen) = (_mm512_set1_epi32(0x0f), _mm512_set1_epi32(16));
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let q = u8x16(b, 6);
        // Value j is its nibble + 16·(bit j of `qh`) − 16: subtract 16 where the bit is clear.
        let lo = _mm512_and_si512(q, nib);
        let lo = _mm512_mask_sub_epi32(lo, !(qh as u16), lo, sixteen);
        let hi = _mm512_srli_epi32::<4>(q);
        let hi = _mm512_mask_sub_epi32(hi, !((qh >> 16) as u16), hi, sixteen);
        (half_at(b, 0), _mm512_cvtepi32_ps(lo), _mm512_cvtepi32_ps(hi))
    }
);

/// Q4_K: 256 4-bit values in 8 sub-blocks of 32, each with a 6-bit scale and min; value =
/// `d·scale·q − dmin·min`, computed per lane as the scalar decoder does (in one fused step).
#[target_feature(enable = "avx512f,fma,f16c")]
fn q4k<const M: usize, const A: usize>(w: &[u8], row_bytes: usize, x: &[f32], k: usize, out: &mut [f32]) {
    let nib = _mm512_set1_epi32(0x0f);
    for (row, out) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(M)) {
        let mut acc = [[_mm512_setzero_ps(); M]; A];
        for (i, b) in row.chunks_exact(144).enumerate() {
            prefetch_ahead(b);
            let (d, dmin) = (half_at(b, 0), half_at(b, 2));
            let scales = &b[4..16];
            for g in 0..4 {
                let (s1, m1) = super::scale_min_k4(2 * g, scales);
                let (s2, m2) = super::scale_min_k4(2 * g + 1, scales);
                let (d1, m1) = (_mm512_set1_ps(d * f32::from(s1)), _mm512_set1_ps(dmin * f32::from(m1)));
                let (d2, m2) = (_mm512_set1_ps(d * f32::from(s2)), _mm512_set1_ps(dmin * f32::from(m2)));
                let (qa, qb) = (u8x16(b, 16 + 32 * g), u8x16(b, 32 + 32 * g));
                let ws = [
                    _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_and_si512(qa, nib)), d1, m1),
                    _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_and_si512(qb, nib)), d1, m1),
                    _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(qa)), d2, m2),
                    _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(qb)), d2, m2),
                ];
                for (j, wv) in ws.iter().enumerate() {
                    for (r, acc) in acc[j % A].iter_mut().enumerate() {
                        *acc = _mm512_fmadd_ps(*wv, f32x16(x, r * k + 256 * i + 64 * g + 16 * j), *acc);
                    }
                }
            }
        }
        store(&acc, out);
    }
}

/// Q6_K: 256 6-bit values (low 4 bits in `ql`, high 2 in `qh`) offset by 32, in 16
/// sub-blocks of 16 with int8 scales, and a float16 scale.
#[target_feature(enable = "avx512f,fma,f16c")]
fn q6k<const M: usize, const A: usize>(w: &[u8], row_bytes: usize, x: &[f32], k: usize, out: &mut [f32]) {
    let (nib, three, off) = (_mm512_set1_epi32(0x0f), _mm512_set1_epi32(3), _mm512_set1_epi32(32));
    for (row, out) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(M)) {
        let mut acc = [[_mm512_setzero_ps(); M]; A];
        for (i, b) in row.chunks_exact(210).enumerate() {
            prefetch_ahead(b);
            let d = half_at(b, 208);
            for n in 0..2 {
                let sc = &b[192 + 8 * n..200 + 8 * n];
                let s = |j: usize| _mm512_set1_ps(d * f32::from(sc[j] as i8));
                for h in 0..2 {
                    let a = u8x16(b, 64 * n + 16 * h);
                    let bq = u8x16(b, 64 * n + 32 + 16 * h);
                    let c = u8x16(b, 128 + 32 * n + 16 * h);
                    // The low four bits, the two high bits from `c >> shift`, less 32.
                    let q = |low: __m512i, high: __m512i| -> __m512 {
                        let v = _mm512_or_si512(low, _mm512_slli_epi32::<4>(_mm512_and_si512(high, three)));
                        _mm512_cvtepi32_ps(_mm512_sub_epi32(v, off))
                    };
                    let ws = [
                        _mm512_mul_ps(q(_mm512_and_si512(a, nib), c), s(h)),
                        _mm512_mul_ps(q(_mm512_and_si512(bq, nib), _mm512_srli_epi32::<2>(c)), s(h + 2)),
                        _mm512_mul_ps(q(_mm512_srli_epi32::<4>(a), _mm512_srli_epi32::<4>(c)), s(h + 4)),
                        _mm512_mul_ps(q(_mm512_srli_epi32::<4>(bq), _mm512_srli_epi32::<6>(c)), s(h + 6)),
                    ];
                    for (j, wv) in ws.iter().enumerate() {
                        for (r, acc) in acc[j % A].iter_mut().enumerate() {
                            let xb = r * k + 256 * i + 128 * n + 16 * h + 32 * j;
                            *acc = _mm512_fmadd_ps(*wv, f32x16(x, xb), *acc);
                        }
                    }
                }
            }
        }
        store(&acc, out);
    }
}

/// Weight rows per packed panel of [`panel_gemm`]: two registers.
pub(super) const PANEL: usize = 32;

/// `y[i·ldy + c] = Σ_t x[i·ldx + t] · p[t·PANEL + c]` for `i < rows`, `c < cols`: activation rows
/// against a panel of `PANEL` weight rows packed `[k][PANEL]` (a column of the panel per `t`),
/// so each step of `t` is two loads of weights and a broadcast of one float per row.
///
/// # Safety
/// The CPU must support AVX-512F and FMA.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,fma")]
pub(super) unsafe fn panel_gemm(
    p: &[f32],
    k: usize,
    x: &[f32],
    ldx: usize,
    rows: usize,
    y: &mut [f32],
    ldy: usize,
    cols: usize,
) {
    if rows == 0 {
        return;
    }
    assert!(p.len() >= k * PANEL && cols <= PANEL && k <= ldx && cols <= ldy);
    assert!(x.len() >= (rows - 1) * ldx + k && y.len() >= (rows - 1) * ldy + cols);
    let masks = [((1u32 << cols.min(16)) - 1) as u16, ((1u32 << cols.saturating_sub(16)) - 1) as u16];
    let s = PanelShape { k, ldx, ldy, cols, masks };
    let mut r = 0;
    while r + 12 <= rows {
        panel_tile::<12>(p, &x[r * ldx..], &mut y[r * ldy..], s);
        r += 12;
    }
    if r == rows {
        return;
    }
    let (xr, yr) = (&x[r * ldx..], &mut y[r * ldy..]);
    match rows - r {
        1 => panel_tile::<1>(p, xr, yr, s),
        2 => panel_tile::<2>(p, xr, yr, s),
        3 => panel_tile::<3>(p, xr, yr, s),
        4 => panel_tile::<4>(p, xr, yr, s),
        5 => panel_tile::<5>(p, xr, yr, s),
        6 => panel_tile::<6>(p, xr, yr, s),
        7 => panel_tile::<7>(p, xr, yr, s),
        8 => panel_tile::<8>(p, xr, yr, s),
        9 => panel_tile::<9>(p, xr, yr, s),
        10 => panel_tile::<10>(p, xr, yr, s),
        _ => panel_tile::<11>(p, xr, yr, s),
    }
}

#[derive(Clone, Copy)]
struct PanelShape {
    k: usize,
    ldx: usize,
    ldy: usize,
    cols: usize,
    /// Store masks of the panel's two registers (all ones for a full panel).
    masks: [u16; 2],
}

/// `MR` activation rows (from `x[0]`, `ldx` apart) against the panel, into `y` (`ldy` apart):
/// `2·MR` accumulators.
#[target_feature(enable = "avx512f,fma")]
#[inline]
fn panel_tile<const MR: usize>(p: &[f32], x: &[f32], y: &mut [f32], s: PanelShape) {
    let PanelShape { k, ldx, ldy, cols, masks } = s;
    assert!(p.len() >= k * PANEL && x.len() >= (MR - 1) * ldx + k && y.len() >= (MR - 1) * ldy + cols);
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    for t in 0..k {
        // SAFETY: `t < k`, and the assert above bounds `p` to `k` panel columns and `x` to `MR`
        // rows of `k` floats `ldx` apart.
        unsafe {
            let w0 = _mm512_loadu_ps(p.as_ptr().add(t * PANEL));
            let w1 = _mm512_loadu_ps(p.as_ptr().add(t * PANEL + 16));
            for (i, acc) in acc.iter_mut().enumerate() {
                let xv = _mm512_set1_ps(*x.get_unchecked(i * ldx + t));
                acc[0] = _mm512_fmadd_ps(xv, w0, acc[0]);
                acc[1] = _mm512_fmadd_ps(xv, w1, acc[1]);
            }
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        let row = &mut y[i * ldy..];
        // SAFETY: the masks select the first `cols` floats, which the assert above shows the
        // row holds; masked-off lanes are not accessed.
        unsafe {
            _mm512_mask_storeu_ps(row.as_mut_ptr(), masks[0], acc[0]);
            _mm512_mask_storeu_ps(row.as_mut_ptr().wrapping_add(16), masks[1], acc[1]);
        }
    }
}
