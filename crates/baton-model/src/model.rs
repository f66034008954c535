//! The decoder forward pass (Llama, Qwen2) over a paged KV cache.
//!
//! One call computes a *batch step*: any mix of sequences, each contributing a run of new tokens
//! at consecutive positions after what it already has in the cache — a whole prompt, a prefill
//! chunk, or one decode token. All new tokens are flattened into one matrix for the dense
//! layers; attention then reads each sequence's keys and values through its block table.

use std::ops::Range;

use baton_kv::{BlockId, KvArena, KvGeometry, KvPart};
use candle_core::{Device, Tensor};

use crate::attention::{AttentionShape, RowPos, paged_attention};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::kernels::{apply_rope, rms_norm, rope_inv_freq, rope_tables, silu_mul};
use crate::linear::Linear;
use crate::weights::WeightSource;

/// Which logits a sequence wants back from a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsWanted {
    /// None (a prefill chunk that does not end the prompt).
    None,
    /// The last new token's (to sample the next token).
    Last,
    /// Every new token's (to check a prompt's logits).
    All,
}

/// One sequence's part of a batch step.
#[derive(Debug, Clone, Copy)]
pub struct SeqStep<'a> {
    /// Tokens of this sequence already in the KV cache; the new tokens take positions
    /// `start_pos..start_pos + tokens.len()`.
    pub start_pos: usize,
    /// The new tokens.
    pub tokens: &'a [u32],
    /// Block table covering at least `start_pos + tokens.len()` positions.
    pub blocks: &'a [BlockId],
    /// Logits to return.
    pub logits: LogitsWanted,
}

/// Logits of a batch step: rows in batch order, and for each sequence the rows that are its.
#[derive(Debug, Clone)]
pub struct StepLogits {
    /// `[rows][vocab]`.
    pub data: Vec<f32>,
    /// Vocabulary size.
    pub vocab: usize,
    /// Row range of each sequence of the batch, in batch order.
    pub rows: Vec<Range<usize>>,
}

impl StepLogits {
    /// The logits rows of sequence `i` of the batch, `[rows][vocab]` flattened.
    pub fn of(&self, i: usize) -> &[f32] {
        let r = &self.rows[i];
        &self.data[r.start * self.vocab..r.end * self.vocab]
    }
}

struct Layer {
    input_norm: Vec<f32>,
    qkv: Linear,
    o: Linear,
    post_norm: Vec<f32>,
    gate_up: Linear,
    down: Linear,
}

/// A loaded decoder model.
pub struct Model {
    config: ModelConfig,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: Linear,
    inv_freq: Vec<f32>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model").field("config", &self.config).finish_non_exhaustive()
    }
}

fn vector(src: &dyn WeightSource, name: &str, len: usize) -> Result<Vec<f32>> {
    Ok(src.tensor(name, &[len])?.to_vec1()?)
}

impl Model {
    /// Builds the model from a weight source with Hugging Face tensor names.
    pub fn load(config: &ModelConfig, src: &dyn WeightSource) -> Result<Self> {
        let c = config;
        let (h, i) = (c.hidden_size, c.intermediate_size);
        let (q_out, kv_out) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let embed = src.tensor("model.embed_tokens.weight", &[c.vocab_size, h])?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let p = format!("model.layers.{l}");
            let attn =
                |name: &str, out: usize| Linear::load(src, &format!("{p}.self_attn.{name}"), out, h, c.attention_bias);
            let qkv = Linear::fuse(&[attn("q_proj", q_out)?, attn("k_proj", kv_out)?, attn("v_proj", kv_out)?])?;
            let mlp = |name: &str, out: usize, inp: usize| {
                Linear::load(src, &format!("{p}.mlp.{name}"), out, inp, c.mlp_bias)
            };
            let gate_up = Linear::fuse(&[mlp("gate_proj", i, h)?, mlp("up_proj", i, h)?])?;
            layers.push(Layer {
                input_norm: vector(src, &format!("{p}.input_layernorm.weight"), h)?,
                qkv,
                o: Linear::load(src, &format!("{p}.self_attn.o_proj"), h, q_out, false)?,
                post_norm: vector(src, &format!("{p}.post_attention_layernorm.weight"), h)?,
                gate_up,
                down: mlp("down_proj", h, i)?,
            });
        }
        let lm_head = if c.tie_word_embeddings || !src.contains("lm_head.weight") {
            Linear::new(embed.clone(), None)?
        } else {
            Linear::load(src, "lm_head", c.vocab_size, h, false)?
        };
        Ok(Self {
            config: c.clone(),
            embed,
            layers,
            norm: vector(src, "model.norm.weight", h)?,
            lm_head,
            inv_freq: rope_inv_freq(&c.rope, c.head_dim),
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// KV geometry this model needs, with `block_size` tokens per block.
    pub fn kv_geometry(&self, block_size: usize) -> KvGeometry {
        KvGeometry::new(self.config.num_layers, self.config.num_kv_heads, self.config.head_dim, block_size)
    }

    /// Bytes of weights one forward pass reads (every matrix once, the embedding row aside).
    pub fn weight_bytes_per_step(&self) -> usize {
        let per_layer: usize = self
            .layers
            .iter()
            .map(|l| l.qkv.weight_bytes() + l.o.weight_bytes() + l.gate_up.weight_bytes() + l.down.weight_bytes())
            .sum();
        per_layer + self.lm_head.weight_bytes()
    }

    /// Runs one batch step: writes the new tokens' keys and values into `kv` and returns the
    /// logits each sequence asked for.
    pub fn forward(&self, batch: &[SeqStep<'_>], kv: &mut KvArena) -> Result<StepLogits> {
        let c = &self.config;
        let (hidden, head_dim) = (c.hidden_size, c.head_dim);
        let block_size = kv.geometry().block_size;
        let mut ids = Vec::new();
        let mut rows: Vec<RowPos<'_>> = Vec::new();
        for s in batch {
            if s.blocks.len() * block_size < s.start_pos + s.tokens.len() {
                return Err(ModelError::InvalidInput(format!(
                    "block table of {} blocks cannot hold {} positions",
                    s.blocks.len(),
                    s.start_pos + s.tokens.len()
                )));
            }
            if let Some(&bad) = s.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                return Err(ModelError::InvalidInput(format!(
                    "token id {bad} is outside the vocabulary of {}",
                    c.vocab_size
                )));
            }
            ids.extend_from_slice(s.tokens);
            rows.extend((0..s.tokens.len()).map(|i| RowPos { blocks: s.blocks, pos: s.start_pos + i }));
        }
        let n = ids.len();
        if n == 0 {
            return Err(ModelError::InvalidInput("empty batch".into()));
        }
        let positions: Vec<usize> = rows.iter().map(|r| r.pos).collect();
        let (cos, sin) = rope_tables(&self.inv_freq, &positions);
        let ids_t = Tensor::from_vec(ids, n, &Device::Cpu)?;
        let mut x: Vec<f32> = self.embed.index_select(&ids_t, 0)?.flatten_all()?.to_vec1()?;

        let (q_width, kv_width) = (c.num_heads * head_dim, c.num_kv_heads * head_dim);
        let shape = AttentionShape {
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            window: None,
        };
        for (l, layer) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &layer.input_norm, c.rms_norm_eps, 0.0);
            let qkv = layer.qkv.forward(&h, n)?;
            let width = layer.qkv.out_features();
            let mut q = Vec::with_capacity(n * q_width);
            let mut k = Vec::with_capacity(n * kv_width);
            for row in qkv.chunks_exact(width) {
                q.extend_from_slice(&row[..q_width]);
                k.extend_from_slice(&row[q_width..q_width + kv_width]);
            }
            apply_rope(&mut q, c.num_heads, head_dim, &cos, &sin);
            apply_rope(&mut k, c.num_kv_heads, head_dim, &cos, &sin);
            for (r, row) in rows.iter().enumerate() {
                let (block, slot) = (row.blocks[row.pos / block_size], row.pos % block_size);
                kv.token_mut(l, KvPart::Key, block, slot).copy_from_slice(&k[r * kv_width..(r + 1) * kv_width]);
                let v = &qkv[r * width + q_width + kv_width..(r + 1) * width];
                kv.token_mut(l, KvPart::Value, block, slot).copy_from_slice(v);
            }
            let attn = paged_attention(&q, &rows, kv, l, shape);
            let o = layer.o.forward(&attn, n)?;
            x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);

            let h = rms_norm(&x, &layer.post_norm, c.rms_norm_eps, 0.0);
            let gate_up = layer.gate_up.forward(&h, n)?;
            let act = silu_mul(&gate_up, c.intermediate_size);
            let down = layer.down.forward(&act, n)?;
            x.iter_mut().zip(&down).for_each(|(x, d)| *x += d);
        }

        // Only the rows someone asked for go through the final norm and the output head.
        let mut picked = Vec::new();
        let mut ranges = Vec::with_capacity(batch.len());
        let mut row0 = 0;
        for s in batch {
            let start = picked.len() / hidden;
            let take = match s.logits {
                LogitsWanted::None => 0..0,
                LogitsWanted::Last => s.tokens.len() - 1..s.tokens.len(),
                LogitsWanted::All => 0..s.tokens.len(),
            };
            for r in take {
                picked.extend_from_slice(&x[(row0 + r) * hidden..(row0 + r + 1) * hidden]);
            }
            ranges.push(start..picked.len() / hidden);
            row0 += s.tokens.len();
        }
        let out_rows = picked.len() / hidden;
        let data = if out_rows == 0 {
            Vec::new()
        } else {
            let h = rms_norm(&picked, &self.norm, c.rms_norm_eps, 0.0);
            self.lm_head.forward(&h, out_rows)?
        };
        Ok(StepLogits { data, vocab: c.vocab_size, rows: ranges })
    }
}
