//! What Baton's model crates share, and nothing else: the one error type ([`ModelError`]) that
//! loading, tokenizing and running a model return, the [`WeightSource`] the forward pass asks
//! for tensors, and the parameters of a layer's math that a configuration names and the kernels
//! take ([`RopeConfig`], [`RopeScaling`], [`Activation`]).
//!
//! It sits below `baton-gguf` (the file format), `baton-text` (tokenizer, chat template,
//! grammar, sampling), `baton-cpu` (the CPU kernels) and `baton-model` (loading and the
//! forward pass), so that they can share these without depending on one another; `baton-model`
//! re-exports all of it, and users name it from there.
//!
//! ```
//! use baton_model_types::{ModelError, RopeConfig, RopeScaling};
//!
//! let rope = RopeConfig { theta: 10_000.0, scaling: RopeScaling::None };
//! let e = ModelError::InvalidInput(format!("theta {}", rope.theta));
//! assert_eq!(e.to_string(), "invalid input: theta 10000");
//! ```

pub mod error;
mod params;
mod weights;

pub use error::{ModelError, Result};
pub use params::{Activation, RopeConfig, RopeScaling};
pub use weights::WeightSource;
