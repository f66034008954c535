//! One Baton instance's loop.
//!
//! An [`Engine`] owns a model, a paged KV cache and the requests in flight. Each
//! [`Engine::step`] asks the pure [`planner`] what to compute — which running sequences
//! continue, which waiting ones are admitted, which are preempted — and then executes that plan:
//! allocate blocks, run one batched forward pass, sample, check stop conditions.
//!
//! ```no_run
//! use std::sync::Arc;
//! use baton_engine::{Engine, EngineConfig, GenerationRequest, RequestId};
//! use baton_model::Checkpoint;
//!
//! let ckpt = Checkpoint::open(std::path::Path::new("fixtures/models/tiny-llama"))?;
//! let prompt = ckpt.tokenizer.encode("Hello", true)?;
//! let mut engine = Engine::new(Arc::new(ckpt.model), Some(Arc::new(ckpt.tokenizer)), EngineConfig::default())?;
//! engine.add_request(GenerationRequest::new(RequestId(1), prompt))?;
//! for done in engine.run_to_completion()? {
//!     println!("{}", done.text);
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The same engine runs without weights as an [emulated] backend: the loop, the planner
//! and the KV pool are real, a step takes the time a cost profile predicts, and tokens are
//! deterministic (never end-of-sequence), so a request produces exactly `max_tokens` tokens.
//!
//! ```
//! use baton_engine::{EmulatedClock, EmulatedModel, Engine, EngineConfig, GenerationRequest, RequestId};
//! use baton_model::ModelConfig;
//! use baton_sched::CostProfile;
//!
//! let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-llama");
//! let config = ModelConfig::from_dir(&dir)?;
//! let model = EmulatedModel {
//!     clock: EmulatedClock::Virtual, // advance a counter instead of sleeping
//!     ..EmulatedModel::new(config, CostProfile::llama2_70b_8xh100())
//! };
//! let mut engine = Engine::emulated(model, None, EngineConfig::default())?;
//! engine.add_request(GenerationRequest::new(RequestId(1), vec![5; 1000]))?;
//! let done = engine.run_to_completion()?;
//! assert_eq!(done[0].token_ids.len(), 16); // the default max_tokens
//! let t = engine.emulated_clock().expect("emulated");
//! assert_eq!(t.steps, 17); // two prefill chunks (512 + 488 tokens), then 15 decode steps
//! assert!(t.total_us > 15 * 6_000); // a 70B decode step on 8×H100 reads 138 GB of weights: ≥ 6 ms
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod bench;
pub mod device_check;
pub mod emulated;
mod engine;
pub mod planner;
pub mod profile;
mod request;
mod sequence;
mod swapper;

pub use emulated::{EmulatedClock, EmulatedKv, EmulatedModel, EmulatedStats};
pub use engine::{Engine, EngineConfig, EngineLoad};
pub use request::{
    FinishReason, Finished, GenerationRequest, KvPiece, KvPrefix, KvRetention, KvStream, StepOutput, StopParams,
    TokenEvent,
};

/// Identifies a request across the system.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// What can go wrong in the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The request cannot be served as given (the message says why, for the client).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The engine's configuration is inconsistent.
    #[error("invalid engine configuration: {0}")]
    Config(String),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] baton_model::ModelError),
    /// The KV memory pool refused (out of blocks, disk tier I/O) or its accounting broke.
    #[error(transparent)]
    Kv(#[from] baton_kv::PoolError),
    /// An invariant broke: a bug.
    #[error("internal error: {0}")]
    Internal(String),
}
