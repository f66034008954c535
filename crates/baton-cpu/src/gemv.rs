//! Matrix products for few rows: `y = x·Wᵀ` with `x` of a handful of rows (decode steps), where
//! reading `W` once per step is the whole cost.
//!
//! General-purpose GEMM libraries pack both operands into tiles, which pays off for prefill
//! (hundreds of rows) but wastes most of a decode step: candle's GEMM reaches about 3 GB/s of
//! weight reads at 4–16 rows on this project's CI machine. Here each task streams a band of
//! weight rows once and multiplies each against every `x` row held in cache, in register tiles
//! of 4 weight rows × up to 4 `x` rows, with AVX2/FMA where the CPU has it (checked at run time)
//! and a portable path elsewhere. The AVX-512 and AVX2 kernels come from one macro so they
//! cannot drift apart.

/// Weight rows per rayon task: enough work to amortise scheduling (at 32 rows, batch-16 decode
/// was 3.8x batch 1 in `baton bench engine`; at 128, 5.4-5.9x), small enough to balance.
const ROWS_PER_TASK: usize = 128;

/// `y[r][j] = Σ_k x[r][k]·w[j][k]` for `x: [m][k]`, `w: [n][k]`; returns `y: [m][n]`.
pub fn matmul_xwt(x: &[f32], m: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
    debug_assert_eq!(x.len(), m * k);
    debug_assert_eq!(w.len(), n * k);
    // Computed transposed (`[n][m]`, one contiguous band per task), then transposed back.
    let mut yt = vec![0f32; n * m];
    let kernel = Kernel::detect();
    crate::pool::for_each_chunk(
        &mut yt,
        ROWS_PER_TASK * m,
        || (),
        |_, task, out| {
            let j0 = task * ROWS_PER_TASK;
            let rows = out.len() / m;
            kernel.band(x, m, &w[j0 * k..(j0 + rows) * k], k, rows, k, out);
        },
    );
    if m == 1 {
        return yt;
    }
    let mut y = vec![0f32; m * n];
    for j in 0..n {
        for r in 0..m {
            y[r * n + j] = yt[j * m + r];
        }
    }
    y
}

/// `out[j][r] = x[r]·w[j]` where weight row `j` is `w[j·ldw .. j·ldw + k]`: `x: [m][k]`,
/// `out: [rows][m]`. Single-threaded, for callers that already run in parallel (attention
/// scores against keys read through a block's slab).
pub fn xwt_strided(x: &[f32], m: usize, w: &[f32], ldw: usize, rows: usize, k: usize, out: &mut [f32]) {
    Kernel::detect().band(x, m, w, ldw, rows, k, out);
}

/// `out[q] += Σ_t p[t][q] · v[t]` for `q < g`, where value row `t` is `v[t·ldv .. t·ldv + d]`:
/// `out: [g][d]`, `p: [rows][g]`. The weighted sum of values in attention.
pub fn weighted_rows_add(out: &mut [f32], g: usize, p: &[f32], v: &[f32], ldv: usize, rows: usize, d: usize) {
    Kernel::detect().pv(out, g, p, v, ldv, rows, d);
}

/// Sum of a slice, as fast as the CPU can read it (used to measure read bandwidth).
pub fn sum(xs: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let chunks = xs.chunks_exact(16);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for i in 0..16 {
            acc[i] += c[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[derive(Clone, Copy)]
enum Kernel {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2Fma,
    Portable,
}

impl Kernel {
    fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            // Not where `BATON_DOT_KERNEL` names a kernel without AVX-512: that measures a CPU
            // without it.
            if std::arch::is_x86_feature_detected!("avx512f") && crate::quant::avx512_chosen() {
                return Kernel::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                return Kernel::Avx2Fma;
            }
        }
        Kernel::Portable
    }

    /// `out[j][r] = x[r]·w[j]` for a band of `rows` weight rows `ldw` apart.
    #[allow(unsafe_code)]
    #[allow(clippy::too_many_arguments)]
    fn band(self, x: &[f32], m: usize, w: &[f32], ldw: usize, rows: usize, k: usize, out: &mut [f32]) {
        assert!(x.len() >= m * k && out.len() >= rows * m);
        assert!(rows == 0 || w.len() >= (rows - 1) * ldw + k);
        match self {
            // SAFETY: `detect` chose this kernel only after checking the CPU has AVX-512F.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => unsafe { avx512::band(x, m, w, ldw, rows, k, out) },
            // SAFETY: `detect` chose this kernel only after checking the CPU has AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2Fma => unsafe { avx2::band(x, m, w, ldw, rows, k, out) },
            Kernel::Portable => portable_band(x, m, w, ldw, rows, k, out),
        }
    }

    /// See [`weighted_rows_add`].
    #[allow(unsafe_code)]
    #[allow(clippy::too_many_arguments)]
    fn pv(self, out: &mut [f32], g: usize, p: &[f32], v: &[f32], ldv: usize, rows: usize, d: usize) {
        assert!(out.len() >= g * d && p.len() >= rows * g);
        assert!(rows == 0 || v.len() >= (rows - 1) * ldv + d);
        match self {
            // SAFETY: as in `band`.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => unsafe { avx512::pv(out, g, p, v, ldv, rows, d) },
            // SAFETY: as in `band`.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2Fma => unsafe { avx2::pv(out, g, p, v, ldv, rows, d) },
            Kernel::Portable => portable_pv(out, g, p, v, ldv, rows, d),
        }
    }
}

fn portable_band(x: &[f32], m: usize, w: &[f32], ldw: usize, rows: usize, k: usize, out: &mut [f32]) {
    for j in 0..rows {
        let wr = &w[j * ldw..j * ldw + k];
        for r in 0..m {
            out[j * m + r] = crate::kernels::dot(&x[r * k..(r + 1) * k], wr);
        }
    }
}

fn portable_pv(out: &mut [f32], g: usize, p: &[f32], v: &[f32], ldv: usize, rows: usize, d: usize) {
    for t in 0..rows {
        for q in 0..g {
            crate::kernels::axpy(&mut out[q * d..(q + 1) * d], p[t * g + q], &v[t * ldv..t * ldv + d]);
        }
    }
}

/// One SIMD implementation of the band kernel: `$feat` is the target feature string, `$lanes`
/// the floats per register, `$mr × $nr` the register tile (x rows × weight rows, sized so the
/// accumulators, the weight vectors and one x vector fit the register file), and the rest are
/// the ISA's intrinsics.
macro_rules! simd_band {
    ($name:ident, $feat:literal, $lanes:literal, $mr:literal, $nr:literal,
     $vec:ty, $zero:ident, $load:ident, $fma:ident, $store:ident, $hsum:path, $set1:ident) => {
        #[cfg(target_arch = "x86_64")]
        #[allow(unsafe_code)]
        mod $name {
            use std::arch::x86_64::*;

            /// SIMD version of [`super::portable_band`].
            ///
            /// # Safety
            /// The CPU must support the target feature this module is compiled for.
            #[target_feature(enable = $feat)]
            pub(super) unsafe fn band(
                x: &[f32],
                m: usize,
                w: &[f32],
                ldw: usize,
                rows: usize,
                k: usize,
                out: &mut [f32],
            ) {
                // The rows left after whole tiles of `MR` go in one tile of as many (the query
                // heads sharing a kv head in decode attention are often 2 or 3 of them): each
                // weight row is then loaded once for all of them.
                let s = Shape { k, ldw, m };
                let mut j = 0;
                while j + $nr <= rows {
                    column::<$nr>(x, w, j, s, out);
                    j += $nr;
                }
                while j < rows {
                    column::<1>(x, w, j, s, out);
                    j += 1;
                }
            }

            /// Every x row × `NR` weight rows from `j0`: tiles of `MR` x rows, the rest in one
            /// tile of as many.
            #[target_feature(enable = $feat)]
            #[inline]
            fn column<const NR: usize>(x: &[f32], w: &[f32], j0: usize, s: Shape, out: &mut [f32]) {
                const _: () = assert!($mr == 4, "the remainder tiles below are for MR = 4");
                let mut r = 0;
                while r + $mr <= s.m {
                    tile::<$mr, NR>(x, r, w, j0, s, out);
                    r += $mr;
                }
                match s.m - r {
                    1 => tile::<1, NR>(x, r, w, j0, s, out),
                    2 => tile::<2, NR>(x, r, w, j0, s, out),
                    3 => tile::<3, NR>(x, r, w, j0, s, out),
                    _ => {}
                }
            }

            /// SIMD version of [`super::portable_pv`].
            ///
            /// # Safety
            /// The CPU must support the target feature this module is compiled for.
            #[target_feature(enable = $feat)]
            pub(super) unsafe fn pv(
                out: &mut [f32],
                g: usize,
                p: &[f32],
                v: &[f32],
                ldv: usize,
                rows: usize,
                d: usize,
            ) {
                // Up to four query heads at a time: each value row is loaded once for all of
                // them (it was once per head).
                let mut q0 = 0;
                while q0 < g {
                    match g - q0 {
                        1 => pv_tile::<1>(out, g, q0, p, v, ldv, rows, d),
                        2 => pv_tile::<2>(out, g, q0, p, v, ldv, rows, d),
                        3 => pv_tile::<3>(out, g, q0, p, v, ldv, rows, d),
                        _ => pv_tile::<4>(out, g, q0, p, v, ldv, rows, d),
                    }
                    q0 += 4;
                }
            }

            /// Query heads `q0..q0 + Q` of [`pv`], in `Q` accumulators a chunk of `d`; each
            /// output sums its rows in order, as the portable loop does.
            #[allow(clippy::too_many_arguments)]
            #[target_feature(enable = $feat)]
            #[inline]
            fn pv_tile<const Q: usize>(
                out: &mut [f32],
                g: usize,
                q0: usize,
                p: &[f32],
                v: &[f32],
                ldv: usize,
                rows: usize,
                d: usize,
            ) {
                assert!((q0 + Q) * d <= out.len() && q0 + Q <= g && rows * g <= p.len());
                assert!(rows == 0 || (rows - 1) * ldv + d <= v.len());
                let dv = d - d % $lanes;
                let mut c = 0;
                while c < dv {
                    // SAFETY: `c + lanes <= dv <= d`; the asserts above bound `out` to heads
                    // `..q0 + Q` of `d` floats, `p` to `rows · g` weights and `v` to `rows`
                    // rows of `d` floats `ldv` apart.
                    unsafe {
                        let mut acc: [$vec; Q] = [$zero(); Q];
                        for (i, a) in acc.iter_mut().enumerate() {
                            *a = $load(out.as_ptr().add((q0 + i) * d + c));
                        }
                        for t in 0..rows {
                            let vt = $load(v.as_ptr().add(t * ldv + c));
                            for (i, a) in acc.iter_mut().enumerate() {
                                *a = $fma($set1(*p.get_unchecked(t * g + q0 + i)), vt, *a);
                            }
                        }
                        for (i, a) in acc.iter().enumerate() {
                            $store(out.as_mut_ptr().add((q0 + i) * d + c), *a);
                        }
                    }
                    c += $lanes;
                }
                for q in q0..q0 + Q {
                    for t in 0..rows {
                        for c in dv..d {
                            out[q * d + c] += p[t * g + q] * v[t * ldv + c];
                        }
                    }
                }
            }

            #[derive(Clone, Copy)]
            struct Shape {
                k: usize,
                ldw: usize,
                m: usize,
            }

            /// `MR` x rows from `r0` × `NR` weight rows from `j0`, in `MR·NR` accumulators.
            #[target_feature(enable = $feat)]
            #[inline]
            fn tile<const MR: usize, const NR: usize>(
                x: &[f32],
                r0: usize,
                w: &[f32],
                j0: usize,
                s: Shape,
                out: &mut [f32],
            ) {
                let Shape { k, ldw, m } = s;
                assert!((r0 + MR) * k <= x.len() && (j0 + NR - 1) * ldw + k <= w.len());
                assert!((j0 + NR - 1) * m + r0 + MR <= out.len());
                let kv = k - k % $lanes;
                let mut acc: [[$vec; NR]; MR] = [[$zero(); NR]; MR];
                let mut kk = 0;
                while kk < kv {
                    // SAFETY: the asserts above bound every row, and `kk + lanes <= kv <= k`.
                    unsafe {
                        let mut wv: [$vec; NR] = [$zero(); NR];
                        for (c, v) in wv.iter_mut().enumerate() {
                            *v = $load(w.as_ptr().add((j0 + c) * ldw + kk));
                        }
                        for (a, accr) in acc.iter_mut().enumerate() {
                            let xv = $load(x.as_ptr().add((r0 + a) * k + kk));
                            for (c, acc) in accr.iter_mut().enumerate() {
                                *acc = $fma(xv, wv[c], *acc);
                            }
                        }
                    }
                    kk += $lanes;
                }
                for (a, accr) in acc.iter().enumerate() {
                    for (c, &v) in accr.iter().enumerate() {
                        let mut s = $hsum(v);
                        let (xr, wr) = (&x[(r0 + a) * k..(r0 + a + 1) * k], &w[(j0 + c) * ldw..(j0 + c) * ldw + k]);
                        for t in kv..k {
                            s += xr[t] * wr[t];
                        }
                        out[(j0 + c) * m + r0 + a] = s;
                    }
                }
            }
        }
    };
}

/// The sum of the 8 lanes of `v`, pairwise (AVX2 has no one-instruction reduction).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn hsum256(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

// AVX2: 16 registers of 8 floats; a 4×3 tile uses 12 accumulators + 3 weights + 1 x.
simd_band!(
    avx2,
    "avx2,fma",
    8,
    4,
    3,
    __m256,
    _mm256_setzero_ps,
    _mm256_loadu_ps,
    _mm256_fmadd_ps,
    _mm256_storeu_ps,
    super::hsum256,
    _mm256_set1_ps
);
// AVX-512: 32 registers of 16 floats; a 4×4 tile uses 16 accumulators + 4 weights + 1 x.
simd_band!(
    avx512,
    "avx512f",
    16,
    4,
    4,
    __m512,
    _mm512_setzero_ps,
    _mm512_loadu_ps,
    _mm512_fmadd_ps,
    _mm512_storeu_ps,
    _mm512_reduce_add_ps,
    _mm512_set1_ps
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agrees_with_the_naive_product_for_every_tile_shape() {
        for (m, n, k) in [(1, 7, 13), (3, 37, 40), (4, 64, 64), (6, 70, 33), (17, 5, 8), (9, 41, 100)] {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
            let w: Vec<f32> = (0..n * k).map(|i| ((i * 5) % 13) as f32 * 0.1 - 0.6).collect();
            let y = matmul_xwt(&x, m, &w, n, k);
            for r in 0..m {
                for j in 0..n {
                    let want: f32 = (0..k).map(|t| x[r * k + t] * w[j * k + t]).sum();
                    assert!((y[r * n + j] - want).abs() < 1e-3, "m{m} n{n} k{k} at ({r},{j})");
                }
            }
            for kernel in kernels() {
                let mut p = vec![0f32; n * m];
                kernel.band(&x, m, &w, k, n, k, &mut p);
                for j in 0..n {
                    for r in 0..m {
                        assert!((p[j * m + r] - y[r * n + j]).abs() < 1e-3);
                    }
                }
            }
        }
    }

    fn kernels() -> Vec<Kernel> {
        let mut kernels = vec![Kernel::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                kernels.push(Kernel::Avx2Fma);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                kernels.push(Kernel::Avx512);
            }
        }
        kernels
    }

    #[test]
    fn strided_rows_and_weighted_sums_agree_with_naive_loops() {
        for m in [1, 2, 3, 4, 5, 8, 9] {
            strided_rows_and_weighted_sums_agree_for(m);
        }
    }

    fn strided_rows_and_weighted_sums_agree_for(m: usize) {
        let (rows, k, ldw) = (13, 40, 71);
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
        let w: Vec<f32> = (0..rows * ldw).map(|i| ((i * 5) % 13) as f32 * 0.1 - 0.6).collect();
        let p: Vec<f32> = (0..rows * m).map(|i| (i % 5) as f32 * 0.25).collect();
        for kernel in kernels() {
            let mut out = vec![0f32; rows * m];
            kernel.band(&x, m, &w, ldw, rows, k, &mut out);
            let mut acc = vec![1f32; m * k];
            kernel.pv(&mut acc, m, &p, &w, ldw, rows, k);
            for j in 0..rows {
                for r in 0..m {
                    let want: f32 = (0..k).map(|t| x[r * k + t] * w[j * ldw + t]).sum();
                    assert!((out[j * m + r] - want).abs() < 1e-3);
                }
            }
            for q in 0..m {
                for c in 0..k {
                    let want: f32 = 1.0 + (0..rows).map(|t| p[t * m + q] * w[t * ldw + c]).sum::<f32>();
                    assert!((acc[q * k + c] - want).abs() < 1e-3);
                }
            }
        }
    }

    #[test]
    fn sum_adds_everything() {
        let xs: Vec<f32> = (0..1001).map(|i| i as f32).collect();
        assert_eq!(sum(&xs), 500_500.0);
    }
}
