//! A linear layer `y = x·Wᵀ + b` over float32 rows. The matrix is either float32 (few rows
//! through [`crate::gemv`], more through candle's GEMM) or quantized in a GGUF block format
//! ([`crate::quant`]'s kernels with float32 activations; candle's for formats those do not
//! decode).

use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};

use crate::error::Result;
use crate::quant::QuantMatrix;
use crate::weights::WeightSource;

/// Up to this many rows go through [`crate::gemv`] (weights streamed once); more go through
/// candle's GEMM, which wins once the product is compute-bound (prefill), where batch
/// invariance is given up (`BATON_BATCH_INVARIANT=0`): every size goes through `gemv` else.
const SMALL_BATCH_ROWS: usize = 64;

/// One matrix `[out, in]`.
#[derive(Debug, Clone)]
enum Matrix {
    /// Float32, contiguous.
    Dense(Tensor),
    /// GGUF blocks along `in`, decoded by [`crate::quant`] (float32 activations).
    Blocks(Arc<QuantMatrix>),
    /// GGUF blocks of a format [`crate::quant`] does not decode: candle's kernels.
    Candle(Arc<QTensor>),
}

/// A quantized matrix as the model keeps it (an embedding shares it with a tied head).
#[derive(Debug, Clone)]
pub(crate) enum QWeight {
    /// Decoded by [`crate::quant`].
    Blocks(Arc<QuantMatrix>),
    /// Through candle's quantized kernels.
    Candle(Arc<QTensor>),
}

impl QWeight {
    pub(crate) fn new(q: QTensor) -> Result<Self> {
        let (rows, cols) = q.shape().dims2()?;
        Ok(match QuantMatrix::new(q.dtype(), &q.data()?, rows, cols) {
            Some(m) => Self::Blocks(Arc::new(m)),
            None => Self::Candle(Arc::new(q)),
        })
    }

    /// Rows `ids`, decoded to float32.
    pub(crate) fn gather(&self, ids: &[u32]) -> Result<Vec<f32>> {
        match self {
            Self::Blocks(m) => Ok(m.gather(ids)),
            Self::Candle(q) => {
                let ids = Tensor::from_slice(ids, ids.len(), &Device::Cpu)?;
                Ok(q.embedding(&ids)?.flatten_all()?.to_vec1()?)
            }
        }
    }
}

impl Matrix {
    fn out_features(&self) -> Result<usize> {
        Ok(match self {
            Self::Dense(w) => w.dims2()?.0,
            Self::Blocks(m) => m.rows(),
            Self::Candle(q) => q.shape().dims2()?.0,
        })
    }

    fn bytes(&self) -> usize {
        match self {
            Self::Dense(w) => w.elem_count() * 4,
            Self::Blocks(m) => m.byte_len(),
            Self::Candle(q) => q.storage_size_in_bytes(),
        }
    }

    /// Stacks `a` over `b` along the output dimension, when both are stored alike.
    fn stack(a: &Self, b: &Self) -> Result<Option<Self>> {
        match (a, b) {
            (Self::Dense(a), Self::Dense(b)) => Ok(Some(Self::Dense(Tensor::cat(&[a, b], 0)?.contiguous()?))),
            (Self::Blocks(a), Self::Blocks(b)) => Ok(a.stack(b).map(|m| Self::Blocks(Arc::new(m)))),
            (Self::Candle(a), Self::Candle(b)) if a.dtype() == b.dtype() => {
                let ((ra, k), (rb, kb)) = (a.shape().dims2()?, b.shape().dims2()?);
                if k != kb {
                    return Ok(None);
                }
                // Rows are whole blocks, so stacking rows is concatenating bytes.
                let mut bytes = a.data()?.into_owned();
                bytes.extend_from_slice(&b.data()?);
                let q = crate::gguf::qtensor_from_bytes(a.dtype(), &bytes, vec![ra + rb, k], &Device::Cpu)?;
                Ok(Some(Self::Candle(Arc::new(q))))
            }
            _ => Ok(None),
        }
    }

    /// `[rows][in]` times the transpose, into `[rows][out]`.
    fn forward(&self, x: &[f32], rows: usize, in_features: usize) -> Result<Vec<f32>> {
        match self {
            Self::Dense(w) => {
                let out_features = w.dims2()?.0;
                // The gemv kernels sum each row alone, as one row alone does; candle's GEMM would
                // sum it another way (`crate::quant::batch_invariant`).
                if rows <= SMALL_BATCH_ROWS || crate::quant::batch_invariant() {
                    let (storage, layout) = w.storage_and_layout();
                    let candle_core::Storage::Cpu(cpu) = &*storage else {
                        return Err(candle_core::Error::Msg("weights must live in CPU memory".into()).into());
                    };
                    let w = &cpu.as_slice::<f32>()?[layout.start_offset()..][..in_features * out_features];
                    return Ok(crate::gemv::matmul_xwt(x, rows, w, out_features, in_features));
                }
                let xt = Tensor::from_slice(x, (rows, in_features), &Device::Cpu)?;
                Ok(xt.matmul(&w.t()?)?.flatten_all()?.to_vec1()?)
            }
            Self::Blocks(m) => Ok(m.matmul_xwt(x, rows)?),
            Self::Candle(q) => {
                let xt = Tensor::from_slice(x, (rows, in_features), &Device::Cpu)?;
                Ok(xt.apply_op1_no_bwd(q.as_ref())?.flatten_all()?.to_vec1()?)
            }
        }
    }
}

/// Weight `[out, in]`, possibly held as several stacked parts of different storage, and an
/// optional bias `[out]`.
#[derive(Debug, Clone)]
pub(crate) struct Linear {
    /// Stacked along the output dimension, each with its width.
    parts: Vec<(Matrix, usize)>,
    bias: Option<Vec<f32>>,
    in_features: usize,
    out_features: usize,
}

impl Linear {
    /// A float32 layer.
    pub(crate) fn new(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        let weight = weight.contiguous()?;
        let (out_features, in_features) = weight.dims2()?;
        let bias = bias.map(|b| b.to_vec1::<f32>()).transpose()?;
        Ok(Self { parts: vec![(Matrix::Dense(weight), out_features)], bias, in_features, out_features })
    }

    /// A quantized layer, sharing `weight` (a tied output head shares the embedding's blocks).
    pub(crate) fn quantized(weight: &QWeight, bias: Option<Vec<f32>>) -> Result<Self> {
        let m = match weight {
            QWeight::Blocks(m) => Matrix::Blocks(m.clone()),
            QWeight::Candle(q) => Matrix::Candle(q.clone()),
        };
        let out_features = m.out_features()?;
        let in_features = match weight {
            QWeight::Blocks(m) => m.cols(),
            QWeight::Candle(q) => q.shape().dims2()?.1,
        };
        Ok(Self { parts: vec![(m, out_features)], bias, in_features, out_features })
    }

    /// Loads `{prefix}.weight` (kept quantized when the source stores it so) and, when
    /// `with_bias`, `{prefix}.bias`.
    pub(crate) fn load(src: &dyn WeightSource, prefix: &str, out: usize, inp: usize, with_bias: bool) -> Result<Self> {
        let name = format!("{prefix}.weight");
        let bias = if with_bias { Some(src.tensor(&format!("{prefix}.bias"), &[out])?) } else { None };
        match src.quantized(&name, &[out, inp])? {
            Some(q) => Self::quantized(&QWeight::new(q)?, bias.map(|b| b.to_vec1()).transpose()?),
            None => Self::new(src.tensor(&name, &[out, inp])?, bias),
        }
    }

    /// Stacks layers with the same input along the output dimension (q, k and v into one
    /// layer; gate and up into one), so one matrix product replaces several where the parts
    /// are stored alike.
    pub(crate) fn fuse(layers: &[Linear]) -> Result<Self> {
        let in_features = layers.first().map_or(0, |l| l.in_features);
        let mut parts: Vec<(Matrix, usize)> = Vec::new();
        for (m, width) in layers.iter().flat_map(|l| l.parts.iter().cloned()) {
            if let Some((last, last_width)) = parts.last_mut()
                && let Some(stacked) = Matrix::stack(last, &m)?
            {
                *last = stacked;
                *last_width += width;
                continue;
            }
            parts.push((m, width));
        }
        let out_features = layers.iter().map(|l| l.out_features).sum();
        let bias = if layers.iter().any(|l| l.bias.is_some()) {
            let mut b = Vec::with_capacity(out_features);
            for l in layers {
                match &l.bias {
                    Some(lb) => b.extend_from_slice(lb),
                    None => b.resize(b.len() + l.out_features, 0.0),
                }
            }
            Some(b)
        } else {
            None
        };
        debug_assert!(parts.iter().all(|(m, w)| m.out_features().ok() == Some(*w)));
        Ok(Self { parts, bias, in_features, out_features })
    }

    /// The layer's one quantized matrix this module decodes, where it is that and no bias.
    pub(crate) fn blocks(&self) -> Option<&QuantMatrix> {
        match self.parts.as_slice() {
            [(Matrix::Blocks(m), _)] if self.bias.is_none() => Some(m),
            _ => None,
        }
    }

    pub(crate) fn in_features(&self) -> usize {
        self.in_features
    }

    pub(crate) fn out_features(&self) -> usize {
        self.out_features
    }

    /// Bytes of weights this layer reads per forward pass.
    pub(crate) fn weight_bytes(&self) -> usize {
        self.parts.iter().map(|(m, _)| m.bytes()).sum::<usize>() + self.bias.as_ref().map_or(0, |b| b.len() * 4)
    }

    /// Applies the layer to `rows` rows of `x` (`[rows][in]`), returning `[rows][out]`.
    pub(crate) fn forward(&self, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        let mut y = if let [(m, _)] = self.parts.as_slice() {
            m.forward(x, rows, self.in_features)?
        } else {
            let mut y = vec![0f32; rows * self.out_features];
            let mut col = 0;
            for (m, width) in &self.parts {
                let part = m.forward(x, rows, self.in_features)?;
                for (dst, src) in y.chunks_exact_mut(self.out_features).zip(part.chunks_exact(*width)) {
                    dst[col..col + width].copy_from_slice(src);
                }
                col += width;
            }
            y
        };
        if let Some(b) = &self.bias {
            for row in y.chunks_exact_mut(self.out_features) {
                row.iter_mut().zip(b).for_each(|(y, b)| *y += b);
            }
        }
        Ok(y)
    }
}
