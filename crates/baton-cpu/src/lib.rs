//! Baton's CPU kernels: the arithmetic of a forward pass on float32 slices, and the pool it
//! runs in. Nothing here knows a model, a KV cache or a file: slices and shapes in, slices out.
//!
//! ```
//! use baton_cpu::{gemv, pool};
//!
//! // `[2][8]` activations times the transpose of `[4][8]` weights, inside a step.
//! let (x, w) = (vec![0.5f32; 2 * 8], vec![1.0f32; 4 * 8]);
//! let y = pool::step_in_pool(|| gemv::matmul_xwt(&x, 2, &w, 4, 8));
//! assert_eq!(y, vec![4.0; 2 * 4]);
//! ```
//!
//! Layout: [`quant`] multiplies float32 activations with GGUF-quantized weights, decoded block
//! by block (AVX-512 and AVX2 kernels in `quant/`, with int16 activations; float32 and portable
//! fallbacks; one kernel chosen per process); [`gemv`] multiplies them with float32 weights for
//! few rows, and holds the strided products attention uses; [`kernels`] are the row-wise ones
//! (RMSNorm, RoPE, gated activations, soft-capping); [`pool`] runs a model step on rayon's pool
//! with the other threads kept awake as its team. `baton-model` builds its linear layers and
//! attention from these.
//!
//! Invariants: every kernel agrees with decoding then a float32 dot product (unit tests, on
//! random blocks of every format and on SmolLM2's real Q4_1 blocks); a row's result is the same
//! bits whatever it is batched with (`BATON_BATCH_INVARIANT=0` trades that for the faster
//! prefill paths: [`quant::batch_invariant`]); a SIMD kernel runs only where a run-time check
//! found the CPU features it was compiled for. `unsafe` is those kernels and the step team's
//! sharing of one product's disjoint pieces between threads (`pool.rs`).

pub mod gemv;
pub mod kernels;
pub mod pool;
pub mod quant;
