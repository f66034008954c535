//! Least-squares fitting of cost-model coefficients from measured samples.
//!
//! A profiling command runs prefills of several lengths and cached ratios and decode steps of
//! several batch shapes, then calls [`fit_prefill`] and [`fit_decode`] and writes the resulting
//! [`CostProfile`](crate::CostProfile) as JSON. The fit solves the normal equations of the
//! operator-level features (MemServe §5.3.2) with column scaling and partial pivoting.

use serde::{Deserialize, Serialize};

use crate::Micros;
use crate::cost::{DecodeCoeffs, PrefillCoeffs};

/// One measured prefill.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PrefillSample {
    /// Prompt length, tokens.
    pub tokens: u64,
    /// Fraction of the prompt that was cached (0..=1).
    pub cached_ratio: f64,
    /// Measured time.
    pub micros: Micros,
}

/// One measured decode step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DecodeSample {
    /// Sequences in the batch.
    pub batch: u64,
    /// Tokens of context over the batch.
    pub total_context: u64,
    /// Measured time.
    pub micros: Micros,
}

/// Why a fit failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FitError {
    /// Fewer samples than coefficients.
    #[error("need at least {needed} samples, got {got}")]
    TooFewSamples {
        /// Coefficients to fit.
        needed: usize,
        /// Samples given.
        got: usize,
    },
    /// The samples do not pin the coefficients down (e.g. every sample has the same length).
    #[error("samples are degenerate: vary prompt length and cached ratio (or batch and context)")]
    Degenerate,
}

/// Least squares `min ‖A·c − b‖` over rows of 3 features, restricted to the columns in `mask`
/// (the others are 0). `None` when those columns are degenerate.
fn least_squares_on(rows: &[([f64; 3], f64)], mask: [bool; 3]) -> Option<[f64; 3]> {
    let cols: Vec<usize> = (0..3).filter(|&j| mask[j]).collect();
    let k = cols.len();
    // Scale columns to unit max so that x² features do not swamp the constant.
    let mut scale = [0.0f64; 3];
    for (f, _) in rows {
        for &j in &cols {
            scale[j] = scale[j].max(f[j].abs());
        }
    }
    if cols.iter().any(|&j| scale[j] == 0.0) {
        return None;
    }
    let mut m = [[0.0f64; 4]; 3];
    for (f, b) in rows {
        for (a, &i) in cols.iter().enumerate() {
            let gi = f[i] / scale[i];
            for (c, &j) in cols.iter().enumerate() {
                m[a][c] += gi * f[j] / scale[j];
            }
            m[a][3] += gi * b;
        }
    }
    for col in 0..k {
        let pivot = (col..k).max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs())).unwrap_or(col);
        m.swap(col, pivot);
        if m[col][col].abs() < 1e-12 {
            return None;
        }
        for r in 0..k {
            if r != col {
                let f = m[r][col] / m[col][col];
                let pivot_row = m[col];
                for c in col..k {
                    m[r][c] -= f * pivot_row[c];
                }
                m[r][3] -= f * pivot_row[3];
            }
        }
    }
    let mut out = [0.0f64; 3];
    for (a, &j) in cols.iter().enumerate() {
        out[j] = m[a][3] / m[a][a] / scale[j];
    }
    Some(out)
}

/// Non-negative least squares over rows of 3 features: the best fit among those whose
/// coefficients are all ≥ 0 (every subset of columns is tried; with 3 columns that is exact).
/// A time never shrinks with more work, and measured timings are noisy enough on a small model
/// that an unconstrained fit can give a negative term.
fn least_squares3(rows: &[([f64; 3], f64)]) -> Result<[f64; 3], FitError> {
    if rows.len() < 3 {
        return Err(FitError::TooFewSamples { needed: 3, got: rows.len() });
    }
    let full = least_squares_on(rows, [true; 3]).ok_or(FitError::Degenerate)?;
    if full.iter().all(|&c| c >= 0.0) {
        return Ok(full);
    }
    let residual =
        |c: &[f64; 3]| -> f64 { rows.iter().map(|(f, b)| (f[0] * c[0] + f[1] * c[1] + f[2] * c[2] - b).powi(2)).sum() };
    (1u8..7)
        .map(|m| [m & 1 != 0, m & 2 != 0, m & 4 != 0])
        .filter_map(|mask| least_squares_on(rows, mask))
        .filter(|c| c.iter().all(|&v| v >= 0.0))
        .min_by(|a, b| residual(a).total_cmp(&residual(b)))
        .ok_or(FitError::Degenerate)
}

/// Mean relative error `|predicted − measured| / measured` of a profile over samples (how well a
/// fit explains its own measurements).
pub fn fit_error(profile: &crate::CostProfile, prefill: &[PrefillSample], decode: &[DecodeSample]) -> f64 {
    let rel = |pred: Micros, meas: Micros| (pred as f64 - meas as f64).abs() / (meas.max(1) as f64);
    let errs: Vec<f64> = prefill
        .iter()
        .map(|s| rel(profile.prefill_time(s.tokens, s.cached_ratio), s.micros))
        .chain(decode.iter().map(|s| rel(profile.decode_step(s.batch, s.total_context), s.micros)))
        .collect();
    if errs.is_empty() { 0.0 } else { errs.iter().sum::<f64>() / errs.len() as f64 }
}

/// Fits `prefill_time(x, y) = fixed + per_token·(x − c) + attention·(x² − c²)` to samples.
pub fn fit_prefill(samples: &[PrefillSample]) -> Result<PrefillCoeffs, FitError> {
    let rows: Vec<([f64; 3], f64)> = samples
        .iter()
        .map(|s| {
            let x = s.tokens as f64;
            let c = (x * s.cached_ratio.clamp(0.0, 1.0)).floor();
            ([1.0, x - c, x * x - c * c], s.micros as f64)
        })
        .collect();
    let [fixed_us, per_token_us, attention_us] = least_squares3(&rows)?;
    Ok(PrefillCoeffs { fixed_us, per_token_us, attention_us })
}

/// Fits `decode_step(b, C) = fixed + per_seq·b + per_context_token·C` to samples.
pub fn fit_decode(samples: &[DecodeSample]) -> Result<DecodeCoeffs, FitError> {
    let rows: Vec<([f64; 3], f64)> =
        samples.iter().map(|s| ([1.0, s.batch as f64, s.total_context as f64], s.micros as f64)).collect();
    let [fixed_us, per_seq_us, per_context_token_us] = least_squares3(&rows)?;
    Ok(DecodeCoeffs { fixed_us, per_seq_us, per_context_token_us })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CostProfile;

    #[test]
    fn fit_recovers_the_coefficients_that_generated_the_samples() {
        let truth = CostProfile::llama2_70b_8xa800();
        let mut samples = Vec::new();
        for x in [256u64, 1024, 4096, 8192, 16384, 32768] {
            for y in [0.0, 0.25, 0.5, 0.9] {
                samples.push(PrefillSample { tokens: x, cached_ratio: y, micros: truth.prefill_time(x, y) });
            }
        }
        let fit = fit_prefill(&samples).expect("fit");
        let rel = |a: f64, b: f64| ((a - b) / b).abs();
        assert!(rel(fit.per_token_us, truth.prefill.per_token_us) < 1e-3, "{fit:?}");
        assert!(rel(fit.attention_us, truth.prefill.attention_us) < 1e-2, "{fit:?}");
        assert!(rel(fit.fixed_us, truth.prefill.fixed_us) < 1e-2, "{fit:?}");

        let mut ds = Vec::new();
        for b in [1u64, 4, 16, 64] {
            for ctx in [1000u64, 10_000, 100_000] {
                ds.push(DecodeSample { batch: b, total_context: ctx * b, micros: truth.decode_step(b, ctx * b) });
            }
        }
        let d = fit_decode(&ds).expect("fit");
        assert!(rel(d.per_context_token_us, truth.decode.per_context_token_us) < 1e-2, "{d:?}");
        assert!(rel(d.fixed_us, truth.decode.fixed_us) < 1e-2, "{d:?}");
    }

    #[test]
    fn noisy_samples_fit_within_the_noise_and_never_negative() {
        // A CPU-like profile: attention is tiny next to the GEMMs, so noise could push its
        // coefficient below zero in an unconstrained fit.
        let truth = PrefillCoeffs { fixed_us: 300.0, per_token_us: 40.0, attention_us: 0.0 };
        let mut x = 0x1234_5678_u64;
        let mut noise = || {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            1.0 + ((x >> 33) as f64 / (1u64 << 31) as f64 - 0.5) * 0.1 // ±5%
        };
        let mut samples = Vec::new();
        for t in [16u64, 64, 128, 256, 512] {
            for y in [0.0, 0.5] {
                let c = (t as f64 * y).floor();
                let us = truth.fixed_us + truth.per_token_us * (t as f64 - c);
                samples.push(PrefillSample { tokens: t, cached_ratio: y, micros: (us * noise()).round() as Micros });
            }
        }
        let fit = fit_prefill(&samples).expect("fit");
        assert!(fit.fixed_us >= 0.0 && fit.per_token_us >= 0.0 && fit.attention_us >= 0.0, "{fit:?}");
        assert!((fit.per_token_us - 40.0).abs() < 4.0, "{fit:?}");
        let profile = CostProfile { prefill: fit, ..CostProfile::llama2_70b_8xa800() };
        assert!(fit_error(&profile, &samples, &[]) < 0.06);
    }

    #[test]
    fn degenerate_samples_are_an_error() {
        let s = PrefillSample { tokens: 100, cached_ratio: 0.0, micros: 10 };
        assert_eq!(fit_prefill(&[s, s]), Err(FitError::TooFewSamples { needed: 3, got: 2 }));
        assert_eq!(fit_prefill(&[s, s, s, s]), Err(FitError::Degenerate));
    }
}
