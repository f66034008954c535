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

/// Least squares `min ‖A·c − b‖` over rows of 3 features.
fn least_squares3(rows: &[([f64; 3], f64)]) -> Result<[f64; 3], FitError> {
    if rows.len() < 3 {
        return Err(FitError::TooFewSamples { needed: 3, got: rows.len() });
    }
    // Scale columns to unit max so that x² features do not swamp the constant.
    let mut scale = [0.0f64; 3];
    for (f, _) in rows {
        for j in 0..3 {
            scale[j] = scale[j].max(f[j].abs());
        }
    }
    if scale.contains(&0.0) {
        return Err(FitError::Degenerate);
    }
    let mut m = [[0.0f64; 4]; 3];
    for (f, b) in rows {
        let g = [f[0] / scale[0], f[1] / scale[1], f[2] / scale[2]];
        for i in 0..3 {
            for j in 0..3 {
                m[i][j] += g[i] * g[j];
            }
            m[i][3] += g[i] * b;
        }
    }
    for col in 0..3 {
        let pivot = (col..3).max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs())).unwrap_or(col);
        m.swap(col, pivot);
        if m[col][col].abs() < 1e-12 {
            return Err(FitError::Degenerate);
        }
        for r in 0..3 {
            if r != col {
                let k = m[r][col] / m[col][col];
                let pivot_row = m[col];
                for (v, p) in m[r].iter_mut().zip(pivot_row).skip(col) {
                    *v -= k * p;
                }
            }
        }
    }
    Ok([m[0][3] / m[0][0] / scale[0], m[1][3] / m[1][1] / scale[1], m[2][3] / m[2][2] / scale[2]])
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
    fn degenerate_samples_are_an_error() {
        let s = PrefillSample { tokens: 100, cached_ratio: 0.0, micros: 10 };
        assert_eq!(fit_prefill(&[s, s]), Err(FitError::TooFewSamples { needed: 3, got: 2 }));
        assert_eq!(fit_prefill(&[s, s, s, s]), Err(FitError::Degenerate));
    }
}
