//! Small CPU kernels on float32 slices: RMSNorm, RoPE, gated activations (SwiGLU, GeGLU),
//! soft-capping and a vectorisable dot product.
//! Matrix products go through [`crate::gemv`], [`crate::quant`] or candle (`baton-model`'s
//! `linear.rs` chooses); everything here is row-wise.

use baton_model_types::{Activation, RopeConfig, RopeScaling};
use rayon::prelude::*;

/// Dot product with eight independent accumulators, so the compiler vectorises it without
/// reassociating a single sum.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut sum = 0.0;
    for (x, y) in ra.iter().zip(rb) {
        sum += x * y;
    }
    acc.iter().sum::<f32>() + sum
}

/// `out[i] += w * x[i]`.
#[inline]
pub(crate) fn axpy(out: &mut [f32], w: f32, x: &[f32]) {
    for (o, v) in out.iter_mut().zip(x) {
        *o += w * v;
    }
}

/// RMSNorm of each `width`-wide row of `x`, scaled by `weight` (plus `weight_offset`, which is
/// 1 for Gemma's `(1 + w)` convention and 0 otherwise).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, weight_offset: f32) -> Vec<f32> {
    let width = weight.len();
    let mut out = vec![0.0; x.len()];
    for (row, o) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        let mean_sq = dot(row, row) / width as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        for ((o, &v), &w) in o.iter_mut().zip(row).zip(weight) {
            *o = (v * inv) * (w + weight_offset);
        }
    }
    out
}

/// `act(gate) * up` for rows laid out as `[gate | up]`, each half `width` wide; rows in
/// parallel when there are many (prefill).
pub fn gated_activation(gate_up: &[f32], width: usize, act: Activation) -> Vec<f32> {
    let rows = gate_up.len() / (2 * width);
    let mut out = vec![0f32; rows * width];
    let row = |(out, row): (&mut [f32], &[f32])| gated_row(out, row, act);
    if rows >= PARALLEL_ROWS {
        out.par_chunks_mut(width).zip(gate_up.par_chunks(2 * width)).for_each(row);
    } else {
        out.chunks_mut(width).zip(gate_up.chunks(2 * width)).for_each(row);
    }
    out
}

/// One row of [`gated_activation`], compiled for AVX2 where the CPU has it (its loop then runs
/// eight lanes at a time, [`exp`] included).
fn gated_row(out: &mut [f32], row: &[f32], act: Activation) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        #[target_feature(enable = "avx2")]
        fn avx2(out: &mut [f32], row: &[f32], act: Activation) {
            gated_row_body(out, row, act);
        }
        #[allow(unsafe_code)]
        // SAFETY: the CPU has AVX2, checked just above.
        unsafe {
            avx2(out, row, act)
        };
        return;
    }
    gated_row_body(out, row, act);
}

#[inline(always)]
fn gated_row_body(out: &mut [f32], row: &[f32], act: Activation) {
    let (gate, up) = row.split_at(out.len());
    match act {
        Activation::Silu => {
            out.iter_mut().zip(gate.iter().zip(up)).for_each(|(o, (&g, &u))| *o = g / (1.0 + exp(-g)) * u)
        }
        Activation::GeluTanh => out.iter_mut().zip(gate.iter().zip(up)).for_each(|(o, (&g, &u))| *o = gelu_tanh(g) * u),
    }
}

/// Rows from which row-wise kernels split the rows among threads.
const PARALLEL_ROWS: usize = 16;

/// `e^x` in float32 within 2 ulp of libm's for normal results (infinity above ~88.72, zero
/// below ~−87.34, where libm's would be subnormal), written with no call, no branch and no
/// saturating conversion, so a loop of it vectorizes: Cody and Waite's reduction
/// `x = n·ln 2 + r` with `ln 2` in two parts, then Cephes' degree-6 polynomial for `e^r`.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const HIGH: f32 = 88.722_83;
    const LOW: f32 = -87.336_55;
    // `max` first: a NaN becomes LOW here (and is given back below), so `n` is an integer in
    // −126..=128 and the conversion is in range.
    #[allow(clippy::manual_clamp)] // `clamp` keeps a NaN
    let xc = x.max(LOW).min(HIGH);
    let n = (xc * LOG2E).round();
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.987_569_1e-4;
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
        p = p * r + c;
    }
    let y = p * r * r + r + 1.0;
    #[allow(unsafe_code)]
    // SAFETY: `n` is an integer in −126..=128, as the clamp above makes it.
    let n = unsafe { n.to_int_unchecked::<i32>() };
    // 2ⁿ as two normal powers (2¹²⁸ alone is not a float).
    let half = n / 2;
    let pow = |e: i32| f32::from_bits(((e + 127) as u32) << 23);
    let v = y * pow(half) * pow(n - half);
    if x.is_nan() {
        x
    } else if x > HIGH {
        f32::INFINITY
    } else if x < LOW {
        0.0
    } else {
        v
    }
}

/// GELU with the tanh approximation (PyTorch's `gelu(approximate="tanh")`), through the
/// identity `0.5·(1 + tanh(y)) = 1 / (1 + e^(−2y))`: one `exp`, several times cheaper than
/// libm's `tanh`, and the sum with 1 hides the difference in rounding.
#[inline(always)]
pub(crate) fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let y = SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x);
    x / (1.0 + exp(-2.0 * y))
}

/// `cap * tanh(x / cap)` in place.
pub fn soft_cap(x: &mut [f32], cap: f32) {
    x.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
}

/// Inverse frequencies of RoPE for a head of `head_dim` elements, with the configured scaling.
pub fn rope_inv_freq(rope: &RopeConfig, head_dim: usize) -> Vec<f32> {
    let base: Vec<f32> = (0..head_dim / 2).map(|i| 1.0 / rope.theta.powf((2 * i) as f32 / head_dim as f32)).collect();
    match rope.scaling {
        RopeScaling::None => base,
        RopeScaling::Linear { factor } => base.into_iter().map(|f| f / factor).collect(),
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
            let old = original_max_position_embeddings as f32;
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            base.into_iter()
                .map(|f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

/// Cos and sin tables for the given positions: `[positions.len()][head_dim / 2]` each.
pub fn rope_tables(inv_freq: &[f32], positions: &[usize]) -> (Vec<f32>, Vec<f32>) {
    let mut cos = Vec::with_capacity(positions.len() * inv_freq.len());
    let mut sin = Vec::with_capacity(positions.len() * inv_freq.len());
    for &p in positions {
        for &f in inv_freq {
            let angle = p as f32 * f;
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    (cos, sin)
}

/// Rotates each head of each row in place (the "rotate half" convention of transformers:
/// element `i` pairs with `i + D/2`). `x` is `[rows][heads][D]`; the tables are per row.
pub fn apply_rope(x: &mut [f32], heads: usize, head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    for (r, row) in x.chunks_exact_mut(heads * head_dim).enumerate() {
        let (c, s) = (&cos[r * half..(r + 1) * half], &sin[r * half..(r + 1) * half]);
        for head in row.chunks_exact_mut(head_dim) {
            let (a, b) = head.split_at_mut(half);
            for i in 0..half {
                let (x1, x2) = (a[i], b[i]);
                a[i] = x1 * c[i] - x2 * s[i];
                b[i] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_naive_sum() {
        let a: Vec<f32> = (0..37).map(|i| i as f32 * 0.5).collect();
        let b: Vec<f32> = (0..37).map(|i| 1.0 - i as f32 * 0.1).collect();
        let naive: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - naive).abs() < 1e-3);
    }

    #[test]
    fn rope_at_position_zero_is_identity_and_preserves_norm() {
        let rope = RopeConfig { theta: 10_000.0, scaling: RopeScaling::None };
        let inv = rope_inv_freq(&rope, 8);
        let (cos, sin) = rope_tables(&inv, &[0, 5]);
        let mut x: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let orig = x.clone();
        apply_rope(&mut x, 1, 8, &cos, &sin);
        assert_eq!(&x[..8], &orig[..8]);
        let n0: f32 = orig[8..].iter().map(|v| v * v).sum();
        let n1: f32 = x[8..].iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-3);
    }

    #[test]
    fn exp_is_within_two_ulp_of_libm() {
        let ulps = |a: f32, b: f32| (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs();
        let mut x = -87.3f32;
        while x < 88.7 {
            assert!(ulps(exp(x), x.exp()) <= 2, "exp({x}) = {} vs {}", exp(x), x.exp());
            x += 0.0137;
        }
        for x in [0.0, -0.0, 1.0, -1.0, 1e-7, -1e-7, 88.72, -87.33] {
            assert!(ulps(exp(x), x.exp()) <= 2, "exp({x}) = {} vs {}", exp(x), x.exp());
        }
        assert_eq!(exp(89.0), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(-88.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn gelu_tanh_matches_known_values() {
        assert!(gelu_tanh(0.0).abs() < 1e-7);
        assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-5);
        assert!((gelu_tanh(-2.0) - -0.045_402_3).abs() < 1e-5);
        assert_eq!(gelu_tanh(-100.0), 0.0);
        assert_eq!(gelu_tanh(100.0), 100.0);
        for i in -400..400 {
            let x = i as f32 / 50.0;
            let tanh_form = 0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044_715 * x * x * x)).tanh());
            assert!((gelu_tanh(x) - tanh_form).abs() <= 1e-6 * (1.0 + x.abs()), "gelu({x})");
        }
        let out = gated_activation(&[1.0, 2.0], 1, Activation::GeluTanh);
        assert!((out[0] - 2.0 * 0.841_192).abs() < 1e-5);
    }

    #[test]
    fn rms_norm_normalises_rows() {
        let out = rms_norm(&[3.0, 4.0], &[1.0, 1.0], 0.0, 0.0);
        let rms = (12.5f32).sqrt();
        assert!((out[0] - 3.0 / rms).abs() < 1e-6);
    }
}
