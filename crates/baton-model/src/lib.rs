//! Models for Baton: checkpoint loading, tokenizer and chat template, the forward pass over a
//! paged KV cache, and sampling.
//!
//! ```no_run
//! use baton_kv::{BlockAllocator, KvArena, KvLayout};
//! use baton_model::{Checkpoint, LogitsWanted, SeqStep, argmax};
//!
//! let ckpt = Checkpoint::open(std::path::Path::new("fixtures/models/tiny-llama"))?;
//! let ids = ckpt.tokenizer.encode("Hello", true)?;
//! let mut kv = KvArena::new(ckpt.model.kv_geometry(16), KvLayout::BlockMajor, 4);
//! let blocks = BlockAllocator::new(4).allocate(1).expect("free block");
//! let step = SeqStep { start_pos: 0, tokens: &ids, blocks: &blocks, logits: LogitsWanted::Last };
//! let logits = ckpt.model.forward(&[step], &mut kv)?;
//! println!("next token: {}", argmax(logits.of(0)));
//! # Ok::<(), baton_model::ModelError>(())
//! ```
//!
//! Layout: [`config`] parses `config.json`; [`weights`] reads safetensors (or makes random
//! weights); [`Model`] is the forward pass, with attention in `attention.rs` reading K/V
//! through block tables; [`Tokenizer`] and [`ChatTemplate`] turn text into ids;
//! [`Sampler`] picks tokens, under a [`Grammar`] when the request constrains its output
//! ([`grammar`]: JSON schemas and Lark grammars through llguidance).

mod attention;
mod checkpoint;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
mod device;
mod device_kv;
pub mod gemv;
pub mod gguf;
mod kernels;
mod linear;
mod model;
mod pool;
mod quant;
mod step;
pub mod weights;

// What moved to crates of their own, under the paths this crate's modules have always named it
// by: the error every model crate shares (`baton-model-types`), and sampling (`baton-text`).
use baton_model_types::error;
use baton_text::sampling;

pub use baton_gguf::known::{
    DEFAULT_MODEL, DEFAULT_MODEL_FILE, KNOWN_MODELS, KnownModel, default_model_path, known_model, known_model_names,
    known_model_path, models_dir,
};
pub use baton_text::{
    ChatMessage, ChatTemplate, Constraint, Grammar, GrammarCompiler, IncrementalDecoder, LogitAdjust, Sampler,
    SamplingParams, TokenLogprobs, Tokenizer, argmax, grammar, token_logprobs,
};
pub use checkpoint::{Checkpoint, Frontend};
pub use config::{Architecture, ModelConfig};
pub use device::{ComputeDevice, ComputeDtype, DeviceLimits, DeviceOptions, PackOffsets, StepPack};
pub use device_kv::DeviceKv;
pub use error::{ModelError, Result};
pub use model::Model;
pub use step::{LogitsWanted, SeqStep, StepLogits};
pub use weights::{DeviceRandomWeights, RandomWeights, SafetensorsWeights, WeightSource};
