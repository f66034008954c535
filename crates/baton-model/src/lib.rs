//! Models for Baton: checkpoint loading and the forward pass over a paged KV cache, on the CPU
//! or (feature `cuda`) a GPU; with the tokenizer, chat template and sampling re-exported from
//! the crates below, so a user names this one.
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
//! weights); [`Checkpoint`] puts a model, its tokenizer and chat template together; [`Model`]
//! is the forward pass, with its layers in `linear.rs` and attention in `attention.rs`
//! reading K/V through block tables; `backend.rs` is the interface every backend implements
//! (the CPU's and the stand-in device's in `model.rs`, CUDA's in `cuda/`), `device.rs` and
//! `device_kv.rs` what a device is asked and keeps. Below it, each a crate of its own: `baton-model-types` ([`ModelError`],
//! [`WeightSource`], the RoPE and activation parameters), `baton-gguf` (the GGUF format,
//! [`gguf`] here, and the known models), `baton-text` ([`Tokenizer`] and [`ChatTemplate`] turn
//! text into ids; [`Sampler`] picks tokens, under a [`Grammar`] when the request constrains its
//! output: [`grammar`], JSON schemas and Lark grammars through llguidance) and `baton-cpu` (the
//! CPU kernels; [`gemv`] here).

mod attention;
pub mod backend;
mod checkpoint;
pub mod config;
// The one place the `cuda` feature is named: the real backend, or a stub whose functions say
// how to build with it (candle's pattern), behind the same paths.
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda_stub.rs"]
pub mod cuda;
mod device;
mod device_kv;
pub mod gguf;
mod linear;
mod model;
mod step;
pub mod weights;

// What moved to crates of their own, under the paths this crate's modules have always named it
// by: the error every model crate shares (`baton-model-types`), sampling (`baton-text`) and the
// CPU kernels (`baton-cpu`).
use baton_cpu::{kernels, pool, quant};
use baton_model_types::error;
use baton_text::sampling;

pub use backend::{Backend, KvState, STAND_IN_ARENA_NAME};
pub use baton_cpu::gemv;
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
pub use device::{
    ComputeDevice, ComputeDtype, DeviceLimits, DeviceOptions, GpuOptions, KernelCheck, KvExport, PackOffsets,
    PrefillAttention, StepPack,
};
pub use device_kv::DeviceKv;
pub use error::{ModelError, Result};
pub use model::Model;
pub use step::{LogitsWanted, SeqStep, StepLogits};
pub use weights::{DeviceRandomWeights, RandomWeights, SafetensorsWeights, WeightSource};
