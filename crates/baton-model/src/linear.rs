//! A dense layer `y = x·Wᵀ + b` over float32 rows, with the matrix work in candle.

use candle_core::{Device, Tensor};

use crate::error::Result;
use crate::weights::WeightSource;

/// Up to this many rows go through [`crate::gemv`] (weights streamed once); more go through
/// candle's GEMM, which wins once the product is compute-bound (prefill).
const SMALL_BATCH_ROWS: usize = 64;

/// Weight `[out, in]` (contiguous) and optional bias `[out]`.
#[derive(Debug, Clone)]
pub(crate) struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
    in_features: usize,
    out_features: usize,
}

impl Linear {
    pub(crate) fn new(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        let weight = weight.contiguous()?;
        let (out_features, in_features) = weight.dims2()?;
        Ok(Self { weight, bias, in_features, out_features })
    }

    /// Loads `{prefix}.weight` and, when `with_bias`, `{prefix}.bias`.
    pub(crate) fn load(src: &dyn WeightSource, prefix: &str, out: usize, inp: usize, with_bias: bool) -> Result<Self> {
        let weight = src.tensor(&format!("{prefix}.weight"), &[out, inp])?;
        let bias = if with_bias { Some(src.tensor(&format!("{prefix}.bias"), &[out])?) } else { None };
        Self::new(weight, bias)
    }

    /// Stacks layers with the same input along the output dimension (q, k and v into one
    /// product; gate and up into one), so one matrix product replaces several.
    pub(crate) fn fuse(parts: &[Linear]) -> Result<Self> {
        let weights: Vec<&Tensor> = parts.iter().map(|p| &p.weight).collect();
        let weight = Tensor::cat(&weights, 0)?;
        let bias = if parts.iter().all(|p| p.bias.is_some()) {
            let biases: Vec<&Tensor> = parts.iter().filter_map(|p| p.bias.as_ref()).collect();
            Some(Tensor::cat(&biases, 0)?)
        } else if parts.iter().any(|p| p.bias.is_some()) {
            let filled: Vec<Tensor> = parts
                .iter()
                .map(|p| match &p.bias {
                    Some(b) => Ok(b.clone()),
                    None => Tensor::zeros(p.out_features, candle_core::DType::F32, &Device::Cpu),
                })
                .collect::<candle_core::Result<_>>()?;
            Some(Tensor::cat(&filled, 0)?)
        } else {
            None
        };
        Self::new(weight, bias)
    }

    pub(crate) fn out_features(&self) -> usize {
        self.out_features
    }

    /// Bytes of weights this layer reads per forward pass.
    pub(crate) fn weight_bytes(&self) -> usize {
        self.in_features * self.out_features * 4 + self.bias.as_ref().map_or(0, |_| self.out_features * 4)
    }

    /// Applies the layer to `rows` rows of `x` (`[rows][in]`), returning `[rows][out]`.
    pub(crate) fn forward(&self, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        if rows <= SMALL_BATCH_ROWS {
            let (storage, layout) = self.weight.storage_and_layout();
            let candle_core::Storage::Cpu(cpu) = &*storage else {
                return Err(candle_core::Error::Msg("weights must live in CPU memory".into()).into());
            };
            let w = &cpu.as_slice::<f32>()?[layout.start_offset()..][..self.in_features * self.out_features];
            let mut y = crate::gemv::matmul_xwt(x, rows, w, self.out_features, self.in_features);
            if let Some(b) = &self.bias {
                let b = b.to_vec1::<f32>()?;
                for row in y.chunks_exact_mut(self.out_features) {
                    row.iter_mut().zip(&b).for_each(|(y, b)| *y += b);
                }
            }
            return Ok(y);
        }
        let xt = Tensor::from_slice(x, (rows, self.in_features), &Device::Cpu)?;
        let mut y = xt.matmul(&self.weight.t()?)?;
        if let Some(b) = &self.bias {
            y = y.broadcast_add(b)?;
        }
        Ok(y.flatten_all()?.to_vec1()?)
    }
}
