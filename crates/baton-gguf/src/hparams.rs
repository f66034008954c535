//! From an architecture's metadata keys (`gemma3.block_count`, ...) to the facts a forward pass
//! needs, including the ones llama.cpp hard-codes per architecture rather than storing.

use baton_model_types::{RopeConfig, RopeScaling};

use crate::error::GgufError;
use crate::file::GgufFile;
use crate::metadata::GgufMetadata;
use crate::value::{GgufArray, GgufValue};

/// A model architecture a GGUF file can hold and Baton maps (`general.architecture`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufArchitecture {
    /// `gemma3`: RMSNorm on q and k, norms after attention and after the MLP, GELU-tanh gated
    /// MLP, embeddings scaled by sqrt(hidden), tied output head, local/global attention layers.
    Gemma3,
    /// `llama` (also Mistral's GGUFs, which say `llama`).
    Llama,
    /// `qwen2`: Llama with q/k/v biases.
    Qwen2,
}

impl GgufArchitecture {
    /// What [`GgufArchitecture::from_name`] accepts.
    pub const SUPPORTED: &'static str = "gemma3, llama, qwen2";

    /// The architecture for a `general.architecture` value.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "gemma3" => Some(Self::Gemma3),
            "llama" => Some(Self::Llama),
            "qwen2" => Some(Self::Qwen2),
            _ => None,
        }
    }

    /// The prefix of the architecture's metadata keys.
    pub fn key_prefix(self) -> &'static str {
        match self {
            Self::Gemma3 => "gemma3",
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
        }
    }
}

/// The MLP's gate activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlpActivation {
    /// SiLU (SwiGLU): Llama, Qwen2.
    Silu,
    /// GELU, tanh approximation (GeGLU): Gemma.
    GeluTanh,
}

/// Which attention a layer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKind {
    /// Attends to every earlier position; uses [`GgufHyperparams::rope`].
    Global,
    /// Attends to the last `window` positions (the query's included); uses
    /// [`GgufHyperparams::rope_local`].
    Sliding {
        /// Positions visible to each query.
        window: usize,
    },
}

/// A model's hyperparameters as a GGUF file states them (or, where llama.cpp hard-codes them
/// for an architecture, as llama.cpp and transformers assume them).
#[derive(Debug, Clone, PartialEq)]
pub struct GgufHyperparams {
    /// The architecture.
    pub architecture: GgufArchitecture,
    /// Decoder layers (`{arch}.block_count`).
    pub num_layers: usize,
    /// Width of the residual stream (`{arch}.embedding_length`).
    pub hidden_size: usize,
    /// Width of the MLP (`{arch}.feed_forward_length`).
    pub intermediate_size: usize,
    /// Query heads (`{arch}.attention.head_count`).
    pub num_heads: usize,
    /// Key/value heads (`{arch}.attention.head_count_kv`; defaults to `num_heads`).
    pub num_kv_heads: usize,
    /// Elements per query/key head (`{arch}.attention.key_length`; defaults to hidden / heads).
    pub head_dim: usize,
    /// Elements per value head (`{arch}.attention.value_length`; defaults to `head_dim`).
    pub value_head_dim: usize,
    /// Vocabulary size (`{arch}.vocab_size`, else the length of `tokenizer.ggml.tokens`).
    pub vocab_size: usize,
    /// Longest context the model was trained for (`{arch}.context_length`).
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon (`{arch}.attention.layer_norm_rms_epsilon`).
    pub rms_norm_eps: f32,
    /// RoPE of global layers (`{arch}.rope.freq_base`, default 10 000; linear scaling from
    /// `{arch}.rope.scaling.type` / `.factor`).
    pub rope: RopeConfig,
    /// RoPE of sliding-window layers (`{arch}.rope.freq_base_swa`; Gemma 3 files omit it and
    /// llama.cpp assumes 10 000, unscaled). Equal to `rope` where no layer slides.
    pub rope_local: RopeConfig,
    /// Rotated elements per head (`{arch}.rope.dimension_count`; defaults to `head_dim`).
    pub rope_dim: usize,
    /// Sliding window length (`{arch}.attention.sliding_window`), if any layer slides.
    pub sliding_window: Option<usize>,
    /// Per layer, which attention it runs. Gemma 3: every sixth layer (5, 11, 17, ...) global,
    /// the rest sliding; llama.cpp hard-codes the pattern 6, a file may state
    /// `{arch}.attention.sliding_window_pattern` (a period, or one bool per layer).
    pub layer_attention: Vec<AttentionKind>,
    /// Attention scores are scaled by `query_pre_attn_scalar^-0.5` (head_dim, except Gemma 3
    /// 27B, which uses hidden / heads as llama.cpp does).
    pub query_pre_attn_scalar: f32,
    /// Embeddings are multiplied by this (sqrt(hidden) for Gemma), if at all.
    pub embedding_scale: Option<f32>,
    /// Tanh soft-cap of attention logits (`{arch}.attn_logit_softcapping`).
    pub attn_logit_softcapping: Option<f32>,
    /// Tanh soft-cap of final logits (`{arch}.final_logit_softcapping`).
    pub final_logit_softcapping: Option<f32>,
    /// The MLP's activation.
    pub activation: MlpActivation,
    /// RMSNorm on q and k per head (`blk.N.attn_q_norm` / `attn_k_norm`).
    pub qk_norm: bool,
    /// Norms after attention and after the MLP (`blk.N.post_attention_norm` / `post_ffw_norm`).
    pub post_norms: bool,
    /// The output head is the embedding matrix (no `output.weight` tensor). From metadata alone
    /// ([`GgufHyperparams::from_metadata`]) this is a guess by architecture;
    /// [`GgufHyperparams::from_gguf`] looks at the tensors.
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry biases (Qwen2; [`GgufHyperparams::from_gguf`] checks for
    /// `blk.0.attn_q.bias`).
    pub attention_bias: bool,
    /// Beginning-of-sequence token (`tokenizer.ggml.bos_token_id`).
    pub bos_token_id: Option<u32>,
    /// End-of-sequence tokens (`tokenizer.ggml.eos_token_id`, plus Gemma's `<end_of_turn>`
    /// when the vocabulary has it, as its generation config lists both).
    pub eos_token_ids: Vec<u32>,
}

impl GgufHyperparams {
    /// Reads the hyperparameters and checks tensors for what metadata does not say (tied
    /// output head, attention biases).
    pub fn from_gguf(file: &GgufFile) -> Result<Self, GgufError> {
        let mut hp = Self::from_metadata(file.metadata())?;
        hp.tie_word_embeddings = !file.has_tensor("output.weight");
        hp.attention_bias = file.has_tensor("blk.0.attn_q.bias");
        hp.qk_norm = file.has_tensor("blk.0.attn_q_norm.weight");
        Ok(hp)
    }

    /// Reads the hyperparameters from metadata alone.
    pub fn from_metadata(m: &GgufMetadata) -> Result<Self, GgufError> {
        let arch_name: &str = m.get("general.architecture")?;
        let architecture =
            GgufArchitecture::from_name(arch_name).ok_or_else(|| GgufError::UnsupportedArchitecture {
                path: m.path().to_owned(),
                architecture: arch_name.to_owned(),
                supported: GgufArchitecture::SUPPORTED,
            })?;
        let p = architecture.key_prefix();
        let key = |k: &str| format!("{p}.{k}");
        let positive = |k: &str| -> Result<usize, GgufError> {
            let k = key(k);
            let v: usize = m.get(&k)?;
            if v == 0 { Err(m.invalid(&k, "is 0")) } else { Ok(v) }
        };

        let num_layers = positive("block_count")?;
        let hidden_size = positive("embedding_length")?;
        let intermediate_size = positive("feed_forward_length")?;
        let num_heads = positive("attention.head_count")?;
        let num_kv_heads = m.get_opt::<usize>(&key("attention.head_count_kv"))?.unwrap_or(num_heads);
        if num_kv_heads == 0 || !num_heads.is_multiple_of(num_kv_heads) {
            return Err(m.invalid(
                &key("attention.head_count_kv"),
                format!("is {num_kv_heads}, which does not divide {num_heads} query heads"),
            ));
        }
        let head_dim = match m.get_opt::<usize>(&key("attention.key_length"))? {
            Some(d) => d,
            None if hidden_size.is_multiple_of(num_heads) => hidden_size / num_heads,
            None => {
                return Err(m.invalid(&key("attention.head_count"), "does not divide the embedding length"));
            }
        };
        let value_head_dim = m.get_opt::<usize>(&key("attention.value_length"))?.unwrap_or(head_dim);
        let vocab_size = match m.get_opt::<usize>(&key("vocab_size"))? {
            Some(v) => v,
            None => m.get::<&[String]>("tokenizer.ggml.tokens")?.len(),
        };
        let max_position_embeddings = m.get(&key("context_length"))?;
        let rms_norm_eps: f32 = m.get(&key("attention.layer_norm_rms_epsilon"))?;
        let rope_dim = m.get_opt::<usize>(&key("rope.dimension_count"))?.unwrap_or(head_dim);

        let theta = m.get_opt::<f32>(&key("rope.freq_base"))?.unwrap_or(10_000.0);
        let scaling = rope_scaling(m, &key("rope.scaling.type"), &key("rope.scaling.factor"))?;
        let rope = RopeConfig { theta, scaling };
        let is_gemma = architecture == GgufArchitecture::Gemma3;
        let local_default = if is_gemma { 10_000.0 } else { theta };
        let local_theta = m.get_opt::<f32>(&key("rope.freq_base_swa"))?.unwrap_or(local_default);
        let rope_local = if is_gemma || local_theta != theta {
            RopeConfig { theta: local_theta, scaling: RopeScaling::None }
        } else {
            rope
        };

        let sliding_window = m.get_opt::<usize>(&key("attention.sliding_window"))?;
        let layer_attention =
            layer_attention(m, &key("attention.sliding_window_pattern"), num_layers, sliding_window, is_gemma)?;

        let query_pre_attn_scalar = if is_gemma && num_layers == 62 {
            // Gemma 3 27B scales by hidden / heads, not head_dim (llama.cpp `LLM_TYPE_27B`).
            (hidden_size / num_heads) as f32
        } else {
            head_dim as f32
        };

        let bos_token_id = m.get_opt::<u32>("tokenizer.ggml.bos_token_id")?;
        let mut eos_token_ids: Vec<u32> = m.get_opt::<u32>("tokenizer.ggml.eos_token_id")?.into_iter().collect();
        if is_gemma {
            // Gemma's generation config stops on `<end_of_turn>` too; the GGUF keeps only `<eos>`.
            if let Some(tokens) = m.get_opt::<&[String]>("tokenizer.ggml.tokens")?
                && let Some(i) = tokens.iter().position(|t| t == "<end_of_turn>")
            {
                let i = u32::try_from(i).unwrap_or(u32::MAX);
                if !eos_token_ids.contains(&i) {
                    eos_token_ids.push(i);
                }
            }
        }

        Ok(Self {
            architecture,
            num_layers,
            hidden_size,
            intermediate_size,
            num_heads,
            num_kv_heads,
            head_dim,
            value_head_dim,
            vocab_size,
            max_position_embeddings,
            rms_norm_eps,
            rope,
            rope_local,
            rope_dim,
            sliding_window,
            layer_attention,
            query_pre_attn_scalar,
            embedding_scale: is_gemma.then(|| (hidden_size as f32).sqrt()),
            attn_logit_softcapping: m.get_opt(&key("attn_logit_softcapping"))?,
            final_logit_softcapping: m.get_opt(&key("final_logit_softcapping"))?,
            activation: if is_gemma { MlpActivation::GeluTanh } else { MlpActivation::Silu },
            qk_norm: is_gemma,
            post_norms: is_gemma,
            tie_word_embeddings: is_gemma,
            attention_bias: architecture == GgufArchitecture::Qwen2,
            bos_token_id,
            eos_token_ids,
        })
    }

    /// Query heads sharing one key/value head.
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }
}

fn rope_scaling(m: &GgufMetadata, type_key: &str, factor_key: &str) -> Result<RopeScaling, GgufError> {
    match m.get_opt::<&str>(type_key)? {
        None | Some("none") => Ok(RopeScaling::None),
        Some("linear") => {
            let factor: f32 = m.get(factor_key)?;
            if factor > 0.0 {
                Ok(RopeScaling::Linear { factor })
            } else {
                Err(m.invalid(factor_key, "is not positive"))
            }
        }
        Some(other) => Err(m.invalid(type_key, format!("is `{other}`; only `none` and `linear` are supported"))),
    }
}

fn layer_attention(
    m: &GgufMetadata,
    pattern_key: &str,
    num_layers: usize,
    sliding_window: Option<usize>,
    is_gemma: bool,
) -> Result<Vec<AttentionKind>, GgufError> {
    let Some(window) = sliding_window else { return Ok(vec![AttentionKind::Global; num_layers]) };
    let kind = |sliding: bool| if sliding { AttentionKind::Sliding { window } } else { AttentionKind::Global };
    let period = |n: usize| (0..num_layers).map(|i| kind((i + 1) % n != 0)).collect::<Vec<_>>();
    match m.value(pattern_key) {
        None if is_gemma => Ok(period(6)),
        // A window with no pattern: every layer slides (Mistral v0.1 style).
        None => Ok(vec![AttentionKind::Sliding { window }; num_layers]),
        Some(GgufValue::Array(GgufArray::Bool(per_layer))) if per_layer.len() == num_layers => {
            Ok(per_layer.iter().map(|&s| kind(s)).collect())
        }
        Some(v) => match v.as_i128().and_then(|n| usize::try_from(n).ok()) {
            Some(0) => Ok(vec![AttentionKind::Sliding { window }; num_layers]),
            Some(n) => Ok(period(n)),
            None => {
                Err(m.invalid(pattern_key, format!("is {}, expected a period or {num_layers} bools", v.describe())))
            }
        },
    }
}
