//! `config.json` and `generation_config.json` into a validated [`ModelConfig`].
//!
//! Both styles transformers writes are accepted: the current one (`rope_parameters`, `dtype`)
//! and the older one (`rope_theta`, `rope_scaling`, `torch_dtype` at the top level).

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

pub use baton_model_types::{Activation, RopeConfig, RopeScaling};

use crate::error::{ModelError, Result};
use crate::gguf::{AttentionKind, GgufArchitecture, GgufHyperparams, MlpActivation};

/// A transformer architecture Baton implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `LlamaForCausalLM`: GQA, RMSNorm, RoPE, SwiGLU.
    Llama,
    /// `Qwen2ForCausalLM`: Llama with q/k/v biases.
    Qwen2,
    /// Gemma 3 (from GGUF files): RMSNorm on q and k, norms after attention and after the MLP,
    /// GELU-tanh gated MLP, scaled embeddings, local sliding-window and global layers.
    Gemma3,
}

impl Architecture {
    const SUPPORTED: &'static str = "LlamaForCausalLM, Qwen2ForCausalLM (Gemma 3 from GGUF files)";

    fn from_hf(name: &str) -> Option<Self> {
        match name {
            "LlamaForCausalLM" | "llama" | "MistralForCausalLM" | "mistral" => Some(Self::Llama),
            "Qwen2ForCausalLM" | "qwen2" => Some(Self::Qwen2),
            _ => None,
        }
    }
}

/// Data type of the weights on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightDtype {
    /// float32.
    F32,
    /// float16.
    F16,
    /// bfloat16.
    Bf16,
}

/// What one layer's attention sees and how it rotates positions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerAttention {
    /// Sliding window in tokens (a query at `p` sees `p - window + 1 ..= p`), or `None` for
    /// attention over the whole context.
    pub window: Option<usize>,
    /// RoPE of this layer.
    pub rope: RopeConfig,
}

/// A model's shape and behaviour, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// The architecture.
    pub architecture: Architecture,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (fewer than query heads under GQA).
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Epsilon of RMSNorm.
    pub rms_norm_eps: f32,
    /// RoPE parameters.
    pub rope: RopeConfig,
    /// Longest context the model supports.
    pub max_position_embeddings: usize,
    /// Output head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry biases.
    pub attention_bias: bool,
    /// MLP projections carry biases.
    pub mlp_bias: bool,
    /// Weight dtype on disk.
    pub dtype: WeightDtype,
    /// Beginning-of-sequence token.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence tokens (generation stops on any).
    pub eos_token_ids: Vec<u32>,
    /// The MLP's gate activation.
    pub activation: Activation,
    /// Added to every RMSNorm weight (1 for checkpoints storing Gemma's `w` of `x * (1 + w)`;
    /// 0 otherwise, GGUF files included, which store `1 + w`).
    pub norm_weight_offset: f32,
    /// RMSNorm over each q and k head (before RoPE).
    pub qk_norm: bool,
    /// RMSNorm of the attention output and of the MLP output before each joins the residual.
    pub post_norms: bool,
    /// Embeddings are multiplied by this (sqrt(hidden) for Gemma), if at all.
    pub embedding_scale: Option<f32>,
    /// Attention scores are `q·k / sqrt(query_pre_attn_scalar)`; `None` means `head_dim`.
    pub query_pre_attn_scalar: Option<f32>,
    /// Tanh soft-cap of the final logits, if any.
    pub final_logit_softcapping: Option<f32>,
    /// Per layer: window and RoPE (`num_layers` entries).
    pub layer_attention: Vec<LayerAttention>,
}

impl ModelConfig {
    /// Reads `config.json` (and `generation_config.json` beside it, when present) from `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let mut config = Self::from_json(&read_json(&path)?, &path)?;
        let gen_path = dir.join("generation_config.json");
        if gen_path.exists() {
            config.apply_generation_config(&read_json(&gen_path)?, &gen_path)?;
        }
        Ok(config)
    }

    /// Parses the content of a `config.json`; `path` is named in errors.
    pub fn from_json(v: &Value, path: &Path) -> Result<Self> {
        let f = Fields { obj: object(v, path)?, path };
        let arch_name = match f.obj.get("architectures").and_then(|a| a.get(0)).and_then(Value::as_str) {
            Some(name) => name.to_owned(),
            None => f.string("model_type")?,
        };
        let architecture = Architecture::from_hf(&arch_name).ok_or_else(|| ModelError::UnsupportedArchitecture {
            path: path.to_owned(),
            architecture: arch_name.clone(),
            supported: Architecture::SUPPORTED,
        })?;
        let hidden_size = f.usize("hidden_size")?;
        let num_heads = f.usize("num_attention_heads")?;
        let num_kv_heads = f.opt_usize("num_key_value_heads")?.unwrap_or(num_heads);
        let head_dim = match f.opt_usize("head_dim")? {
            Some(d) => d,
            None => {
                if hidden_size % num_heads != 0 {
                    return Err(f.invalid("num_attention_heads", "does not divide hidden_size"));
                }
                hidden_size / num_heads
            }
        };
        if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(f.invalid("num_key_value_heads", "must divide num_attention_heads"));
        }
        if head_dim % 2 != 0 {
            return Err(f.invalid("head_dim", "must be even for RoPE"));
        }
        let act = f.opt_string("hidden_act")?.unwrap_or_else(|| "silu".into());
        if act != "silu" {
            return Err(f.invalid("hidden_act", &format!("is `{act}`; only `silu` is supported")));
        }
        if f.obj.get("use_sliding_window").and_then(Value::as_bool) == Some(true) {
            return Err(
                f.invalid("use_sliding_window", "is true; sliding windows are not supported for this architecture")
            );
        }
        let dtype = match f.opt_string("dtype")?.or(f.opt_string("torch_dtype")?).as_deref() {
            None | Some("float32") => WeightDtype::F32,
            Some("float16") => WeightDtype::F16,
            Some("bfloat16") => WeightDtype::Bf16,
            Some(other) => {
                return Err(f.invalid("dtype", &format!("is `{other}`; expected float32, float16 or bfloat16")));
            }
        };
        let attention_bias = match architecture {
            Architecture::Qwen2 => true,
            Architecture::Llama | Architecture::Gemma3 => f.opt_bool("attention_bias")?.unwrap_or(false),
        };
        let num_layers = f.usize("num_hidden_layers")?;
        let rope = rope_config(&f)?;
        Ok(Self {
            architecture,
            vocab_size: f.usize("vocab_size")?,
            hidden_size,
            intermediate_size: f.usize("intermediate_size")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: f.opt_f32("rms_norm_eps")?.unwrap_or(1e-6),
            rope,
            max_position_embeddings: f.opt_usize("max_position_embeddings")?.unwrap_or(4096),
            tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            attention_bias,
            mlp_bias: f.opt_bool("mlp_bias")?.unwrap_or(false),
            dtype,
            bos_token_id: token_id(&f, "bos_token_id")?.into_iter().next(),
            eos_token_ids: token_id(&f, "eos_token_id")?,
            ..Self::plain_decoder(num_layers, rope)
        })
    }

    /// The options of a plain pre-norm decoder (Llama, Qwen2): SiLU, no q/k or post norms,
    /// unscaled embeddings, every layer global with `rope`. The shape fields are placeholders
    /// (a one-layer model of width 0) for struct update syntax: set them all.
    pub fn plain_decoder(num_layers: usize, rope: RopeConfig) -> Self {
        Self {
            architecture: Architecture::Llama,
            vocab_size: 0,
            hidden_size: 0,
            intermediate_size: 0,
            num_layers,
            num_heads: 0,
            num_kv_heads: 0,
            head_dim: 0,
            rms_norm_eps: 1e-6,
            rope,
            max_position_embeddings: 4096,
            tie_word_embeddings: false,
            attention_bias: false,
            mlp_bias: false,
            dtype: WeightDtype::F32,
            bos_token_id: None,
            eos_token_ids: Vec::new(),
            activation: Activation::Silu,
            norm_weight_offset: 0.0,
            qk_norm: false,
            post_norms: false,
            embedding_scale: None,
            query_pre_attn_scalar: None,
            final_logit_softcapping: None,
            layer_attention: vec![LayerAttention { window: None, rope }; num_layers],
        }
    }

    /// The configuration a GGUF file's hyperparameters describe; `path` is named in errors.
    pub fn from_gguf(hp: &GgufHyperparams, path: &Path) -> Result<Self> {
        let invalid = |field: &str, reason: String| ModelError::InvalidField {
            path: path.to_owned(),
            field: format!("{}.{field}", hp.architecture.key_prefix()),
            reason,
        };
        if hp.value_head_dim != hp.head_dim {
            return Err(invalid(
                "attention.value_length",
                format!(
                    "is {}; only value heads as wide as key heads ({}) are supported",
                    hp.value_head_dim, hp.head_dim
                ),
            ));
        }
        if hp.rope_dim != hp.head_dim || !hp.head_dim.is_multiple_of(2) {
            return Err(invalid(
                "rope.dimension_count",
                format!("is {}; only RoPE over the whole (even) head of {} is supported", hp.rope_dim, hp.head_dim),
            ));
        }
        if let Some(cap) = hp.attn_logit_softcapping {
            return Err(invalid(
                "attn_logit_softcapping",
                format!("is {cap}; attention soft-capping is not supported"),
            ));
        }
        let architecture = match hp.architecture {
            GgufArchitecture::Gemma3 => Architecture::Gemma3,
            GgufArchitecture::Llama => Architecture::Llama,
            GgufArchitecture::Qwen2 => Architecture::Qwen2,
        };
        let layer_attention = hp
            .layer_attention
            .iter()
            .map(|kind| match *kind {
                AttentionKind::Global => LayerAttention { window: None, rope: hp.rope },
                AttentionKind::Sliding { window } => LayerAttention { window: Some(window), rope: hp.rope_local },
            })
            .collect();
        Ok(Self {
            architecture,
            vocab_size: hp.vocab_size,
            hidden_size: hp.hidden_size,
            intermediate_size: hp.intermediate_size,
            num_layers: hp.num_layers,
            num_heads: hp.num_heads,
            num_kv_heads: hp.num_kv_heads,
            head_dim: hp.head_dim,
            rms_norm_eps: hp.rms_norm_eps,
            rope: hp.rope,
            max_position_embeddings: hp.max_position_embeddings,
            tie_word_embeddings: hp.tie_word_embeddings,
            attention_bias: hp.attention_bias,
            mlp_bias: false,
            dtype: WeightDtype::F32,
            bos_token_id: hp.bos_token_id,
            eos_token_ids: hp.eos_token_ids.clone(),
            activation: match hp.activation {
                MlpActivation::Silu => Activation::Silu,
                MlpActivation::GeluTanh => Activation::GeluTanh,
            },
            norm_weight_offset: 0.0,
            qk_norm: hp.qk_norm,
            post_norms: hp.post_norms,
            embedding_scale: hp.embedding_scale,
            query_pre_attn_scalar: Some(hp.query_pre_attn_scalar),
            final_logit_softcapping: hp.final_logit_softcapping,
            layer_attention,
        })
    }

    /// Multiplier of `q·k` in attention.
    pub fn attention_scale(&self) -> f32 {
        1.0 / self.query_pre_attn_scalar.unwrap_or(self.head_dim as f32).sqrt()
    }

    /// Takes BOS and EOS from a `generation_config.json`, which wins over `config.json`.
    pub fn apply_generation_config(&mut self, v: &Value, path: &Path) -> Result<()> {
        let f = Fields { obj: object(v, path)?, path };
        if let Some(bos) = token_id(&f, "bos_token_id")?.into_iter().next() {
            self.bos_token_id = Some(bos);
        }
        let eos = token_id(&f, "eos_token_id")?;
        if !eos.is_empty() {
            self.eos_token_ids = eos;
        }
        Ok(())
    }
}

fn rope_config(f: &Fields<'_>) -> Result<RopeConfig> {
    // Current style: everything under `rope_parameters`. Older: `rope_theta` at the top level
    // and the scaling under `rope_scaling`.
    let (params, params_name) = match f.obj.get("rope_parameters") {
        Some(Value::Object(p)) => (Some(p), "rope_parameters"),
        _ => match f.obj.get("rope_scaling") {
            Some(Value::Object(p)) => (Some(p), "rope_scaling"),
            _ => (None, "rope_scaling"),
        },
    };
    let theta = params
        .and_then(|p| p.get("rope_theta"))
        .and_then(Value::as_f64)
        .or_else(|| f.obj.get("rope_theta").and_then(Value::as_f64))
        .unwrap_or(10_000.0) as f32;
    let Some(p) = params else {
        return Ok(RopeConfig { theta, scaling: RopeScaling::None });
    };
    let kind = p.get("rope_type").or_else(|| p.get("type")).and_then(Value::as_str).unwrap_or("default");
    let num = |key: &str| -> Result<f32> {
        p.get(key)
            .and_then(Value::as_f64)
            .map(|x| x as f32)
            .ok_or_else(|| ModelError::MissingField { path: f.path.to_owned(), field: format!("{params_name}.{key}") })
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: num("factor")? },
        "llama3" => RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")? as usize,
        },
        other => {
            return Err(f.invalid(
                &format!("{params_name}.rope_type"),
                &format!("is `{other}`; supported: default, linear, llama3"),
            ));
        }
    };
    Ok(RopeConfig { theta, scaling })
}

/// `bos_token_id` / `eos_token_id`: absent, null, a number or a list of numbers.
fn token_id(f: &Fields<'_>, key: &str) -> Result<Vec<u32>> {
    let as_id = |v: &Value| v.as_u64().and_then(|x| u32::try_from(x).ok());
    match f.obj.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(v @ Value::Number(_)) => as_id(v).map(|x| vec![x]).ok_or_else(|| f.invalid(key, "is not a token id")),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| as_id(v).ok_or_else(|| f.invalid(key, "holds something that is not a token id")))
            .collect(),
        Some(_) => Err(f.invalid(key, "must be a token id or a list of them")),
    }
}

pub(crate) fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io { path: path.to_owned(), source })?;
    serde_json::from_str(&text).map_err(|source| ModelError::Json { path: path.to_owned(), source })
}

fn object<'a>(v: &'a Value, path: &Path) -> Result<&'a Map<String, Value>> {
    v.as_object().ok_or_else(|| ModelError::InvalidField {
        path: path.to_owned(),
        field: "(top level)".into(),
        reason: "must be a JSON object".into(),
    })
}

/// Typed access to the fields of one JSON object, with errors naming the file and field.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    path: &'a Path,
}

impl Fields<'_> {
    fn invalid(&self, field: &str, reason: &str) -> ModelError {
        ModelError::InvalidField { path: self.path.to_owned(), field: field.into(), reason: reason.into() }
    }

    fn missing(&self, field: &str) -> ModelError {
        ModelError::MissingField { path: PathBuf::from(self.path), field: field.into() }
    }

    fn present(&self, key: &str) -> Option<&Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        self.present(key)
            .map(|v| v.as_u64().map(|x| x as usize).ok_or_else(|| self.invalid(key, "must be a non-negative integer")))
            .transpose()
    }

    fn usize(&self, key: &str) -> Result<usize> {
        let v = self.opt_usize(key)?.ok_or_else(|| self.missing(key))?;
        if v == 0 {
            return Err(self.invalid(key, "must be positive"));
        }
        Ok(v)
    }

    fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        self.present(key)
            .map(|v| v.as_f64().map(|x| x as f32).ok_or_else(|| self.invalid(key, "must be a number")))
            .transpose()
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.present(key).map(|v| v.as_bool().ok_or_else(|| self.invalid(key, "must be true or false"))).transpose()
    }

    fn opt_string(&self, key: &str) -> Result<Option<String>> {
        self.present(key)
            .map(|v| v.as_str().map(str::to_owned).ok_or_else(|| self.invalid(key, "must be a string")))
            .transpose()
    }

    fn string(&self, key: &str) -> Result<String> {
        self.opt_string(key)?.ok_or_else(|| self.missing(key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<ModelConfig> {
        ModelConfig::from_json(&v, Path::new("config.json"))
    }

    fn base() -> Value {
        json!({"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
               "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2})
    }

    #[test]
    fn both_rope_styles_parse() {
        let mut new = base();
        new["rope_parameters"] = json!({"rope_theta": 500000.0, "rope_type": "default"});
        assert_eq!(parse(new).expect("parses").rope.theta, 500000.0);
        let mut old = base();
        old["rope_theta"] = json!(1e6);
        old["torch_dtype"] = json!("bfloat16");
        let c = parse(old).expect("parses");
        assert_eq!(c.rope.theta, 1e6);
        assert_eq!(c.dtype, WeightDtype::Bf16);
        assert_eq!(c.head_dim, 4);
        assert_eq!(c.num_kv_heads, 2);
    }

    #[test]
    fn llama3_scaling_parses() {
        let mut v = base();
        v["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        assert!(matches!(parse(v).expect("parses").rope.scaling, RopeScaling::Llama3 { .. }));
    }

    #[test]
    fn errors_name_file_and_field() {
        let mut v = base();
        v.as_object_mut().expect("object").remove("hidden_size");
        let e = parse(v).expect_err("missing").to_string();
        assert!(e.contains("config.json") && e.contains("hidden_size"), "{e}");
        let mut v = base();
        v["architectures"] = json!(["MambaForCausalLM"]);
        let e = parse(v).expect_err("unknown").to_string();
        assert!(e.contains("MambaForCausalLM") && e.contains("not supported"), "{e}");
        let mut v = base();
        v["num_attention_heads"] = json!("two");
        assert!(parse(v).expect_err("bad type").to_string().contains("num_attention_heads"));
    }

    #[test]
    fn eos_may_be_a_list() {
        let mut v = base();
        v["eos_token_id"] = json!([1, 7]);
        assert_eq!(parse(v).expect("parses").eos_token_ids, vec![1, 7]);
    }
}
