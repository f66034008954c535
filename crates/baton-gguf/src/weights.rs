//! A GGUF file as a [`WeightSource`]: the model asks for Hugging Face tensor names and gets
//! llama.cpp's (`model.layers.3.self_attn.q_proj.weight` is `blk.3.attn_q.weight`), quantized
//! matrices kept quantized.
//!
//! llama.cpp's converter permutes the rows of `llama` q and k projections so that RoPE rotates
//! adjacent pairs; Baton rotates halves (as transformers does), so those rows are put back.
//! Gemma 3 and Qwen2 files are stored unpermuted.

use baton_model_types::{ModelError, Result, WeightSource};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use crate::file::{GgufFile, qtensor_from_bytes};
use crate::hparams::{GgufArchitecture, GgufHyperparams};

/// The tensors of a GGUF file under Hugging Face names.
#[derive(Debug)]
pub struct GgufWeights<'a> {
    file: &'a GgufFile,
    architecture: GgufArchitecture,
    num_heads: usize,
    num_kv_heads: usize,
}

impl<'a> GgufWeights<'a> {
    /// Weights of `file`, whose hyperparameters are `hp`.
    pub fn new(file: &'a GgufFile, hp: &GgufHyperparams) -> Self {
        Self { file, architecture: hp.architecture, num_heads: hp.num_heads, num_kv_heads: hp.num_kv_heads }
    }

    /// The llama.cpp name of a Hugging Face tensor name, if it has one.
    pub fn gguf_name(&self, hf: &str) -> Option<String> {
        match hf {
            "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
            "model.norm.weight" => return Some("output_norm.weight".into()),
            "lm_head.weight" => return Some("output.weight".into()),
            _ => {}
        }
        let rest = hf.strip_prefix("model.layers.")?;
        let (layer, rest) = rest.split_once('.')?;
        let (module, suffix) = rest.rsplit_once('.')?;
        let gemma = self.architecture == GgufArchitecture::Gemma3;
        let name = match module {
            "input_layernorm" => "attn_norm",
            "self_attn.q_proj" => "attn_q",
            "self_attn.k_proj" => "attn_k",
            "self_attn.v_proj" => "attn_v",
            "self_attn.o_proj" => "attn_output",
            "self_attn.q_norm" => "attn_q_norm",
            "self_attn.k_norm" => "attn_k_norm",
            "mlp.gate_proj" => "ffn_gate",
            "mlp.up_proj" => "ffn_up",
            "mlp.down_proj" => "ffn_down",
            // Llama's pre-MLP norm has Gemma's post-attention name.
            "post_attention_layernorm" if gemma => "post_attention_norm",
            "post_attention_layernorm" | "pre_feedforward_layernorm" => "ffn_norm",
            "post_feedforward_layernorm" => "post_ffw_norm",
            _ => return None,
        };
        Some(format!("blk.{layer}.{name}.{suffix}"))
    }

    /// Heads whose rows llama.cpp permuted for `hf`, if any.
    fn permuted_heads(&self, hf: &str) -> Option<usize> {
        if self.architecture != GgufArchitecture::Llama {
            return None;
        }
        if hf.contains("self_attn.q_proj.") {
            Some(self.num_heads)
        } else if hf.contains("self_attn.k_proj.") {
            Some(self.num_kv_heads)
        } else {
            None
        }
    }

    /// The tensor under its GGUF name, checked against `shape` (row-major, outer first) and
    /// with permuted rows restored.
    fn load(&self, hf: &str, shape: &[usize]) -> Result<QTensor> {
        let location = || self.file.path().display().to_string();
        let name = self.gguf_name(hf).ok_or_else(|| ModelError::MissingTensor {
            name: format!("{hf} (no GGUF name for it)"),
            location: location(),
        })?;
        let (info, dtype, bytes) = self.file.tensor_data(&name)?;
        if info.shape != shape {
            return Err(ModelError::ShapeMismatch {
                name,
                path: self.file.path().to_owned(),
                expected: shape.to_vec(),
                actual: info.shape.clone(),
            });
        }
        let bad = |e: candle_core::Error| ModelError::BadWeights {
            path: self.file.path().to_owned(),
            reason: format!("tensor `{name}`: {e}"),
        };
        match self.permuted_heads(hf) {
            None => qtensor_from_bytes(dtype, bytes, info.shape.clone(), &Device::Cpu).map_err(bad),
            Some(heads) => {
                let rows = shape[0];
                let row_bytes = bytes.len() / rows;
                let restored = unpermute_rows(bytes, rows, row_bytes, heads);
                qtensor_from_bytes(dtype, &restored, info.shape.clone(), &Device::Cpu).map_err(bad)
            }
        }
    }
}

/// Undoes llama.cpp's `permute` of q/k rows: within each head, stored row `2i + j` is
/// transformers' row `j * D/2 + i`.
fn unpermute_rows(bytes: &[u8], rows: usize, row_bytes: usize, heads: usize) -> Vec<u8> {
    let head_dim = rows / heads;
    let half = head_dim / 2;
    let mut out = vec![0u8; bytes.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let stored = h * head_dim + 2 * i + j;
                let hf = h * head_dim + j * half + i;
                out[hf * row_bytes..(hf + 1) * row_bytes]
                    .copy_from_slice(&bytes[stored * row_bytes..(stored + 1) * row_bytes]);
            }
        }
    }
    out
}

impl WeightSource for GgufWeights<'_> {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        Ok(self.load(name, shape)?.dequantize(&Device::Cpu)?)
    }

    fn contains(&self, name: &str) -> bool {
        self.gguf_name(name).is_some_and(|n| self.file.has_tensor(&n))
    }

    fn quantized(&self, name: &str, shape: &[usize]) -> Result<Option<QTensor>> {
        let q = self.load(name, shape)?;
        // Float matrices are faster through the dense path.
        Ok(match q.dtype() {
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => None,
            _ => Some(q),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_restores_rotate_half_order() {
        // One head of 4 rows, one byte each: transformers' rows [a0, a1, b0, b1] are stored
        // pairwise as [a0, b0, a1, b1].
        assert_eq!(unpermute_rows(&[0, 2, 1, 3], 4, 1, 1), vec![0, 1, 2, 3]);
    }
}
