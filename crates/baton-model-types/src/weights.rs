//! Where a model's weights come from, as the forward pass asks for them: by Hugging Face
//! tensor name, as float32 or in the quantized form stored. Implemented by the safetensors and
//! random sources of `baton-model` and by `baton-gguf`'s `GgufWeights`.

use candle_core::Tensor;
use candle_core::quantized::QTensor;

use crate::error::Result;

/// A source of named float32 tensors.
pub trait WeightSource {
    /// The tensor `name`, checked to have `shape`.
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor>;

    /// Whether the source has a tensor `name`.
    fn contains(&self, name: &str) -> bool;

    /// The matrix `name` in the quantized form the source stores it in, checked to have
    /// `shape`; `None` when the source holds it as floats (then ask [`WeightSource::tensor`]).
    fn quantized(&self, name: &str, shape: &[usize]) -> Result<Option<QTensor>> {
        let _ = (name, shape);
        Ok(None)
    }

    /// `Some((seed, std))` when the matrices are random and a device backend may make them on
    /// the device instead of asking for them (other values than the host's for the same
    /// seed: for benchmarks of shape only). Norms and biases are still asked for.
    fn device_random(&self) -> Option<(u64, f32)> {
        None
    }
}
