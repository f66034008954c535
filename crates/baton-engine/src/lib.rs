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

pub mod bench;
mod engine;
pub mod planner;
mod request;
mod sequence;

pub use engine::{Engine, EngineConfig};
pub use request::{
    FinishReason, Finished, GenerationRequest, KvPrefix, KvRetention, StepOutput, StopParams, TokenEvent,
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
