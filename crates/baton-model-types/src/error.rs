//! The error of every model crate: loading a checkpoint, building a tokenizer or a grammar,
//! and running the forward pass.

use std::path::PathBuf;

/// Everything that can go wrong loading or running a model. Every variant about a file names
/// the file, and where it applies, the field or tensor.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A file is not valid JSON.
    #[error("{path} is not valid JSON: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        source: serde_json::Error,
    },
    /// A required field is absent.
    #[error("{path}: missing field `{field}`")]
    MissingField {
        /// The file.
        path: PathBuf,
        /// The field.
        field: String,
    },
    /// A field has the wrong type or an unusable value.
    #[error("{path}: field `{field}` {reason}")]
    InvalidField {
        /// The file.
        path: PathBuf,
        /// The field.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The checkpoint's architecture is not one Baton implements.
    #[error("{path}: architecture `{architecture}` is not supported (supported: {supported})")]
    UnsupportedArchitecture {
        /// The config file.
        path: PathBuf,
        /// What the file says.
        architecture: String,
        /// What Baton knows.
        supported: &'static str,
    },
    /// A weights file is malformed.
    #[error("{path}: {reason}")]
    BadWeights {
        /// The weights file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A tensor the architecture needs is in no weights file.
    #[error("tensor `{name}` not found in {location}")]
    MissingTensor {
        /// The tensor's name.
        name: String,
        /// Where it was looked for.
        location: String,
    },
    /// A tensor has another shape than the config implies.
    #[error("tensor `{name}` in {path} has shape {actual:?}, expected {expected:?}")]
    ShapeMismatch {
        /// The tensor.
        name: String,
        /// The file holding it.
        path: PathBuf,
        /// Shape implied by config.json.
        expected: Vec<usize>,
        /// Shape in the file.
        actual: Vec<usize>,
    },
    /// The tokenizer failed to load or to encode/decode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template failed to compile or render.
    #[error("chat template: {0}")]
    Template(String),
    /// A grammar (structured output) failed to compile, or the vocabulary cannot carry one.
    #[error("grammar: {0}")]
    Grammar(String),
    /// The compute device failed or is missing (`--device cuda` without a GPU, a CUDA error).
    #[error("device: {0}")]
    Device(String),
    /// An input the model cannot take (token id out of vocabulary, empty batch, ...).
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// The tensor library failed.
    #[error("tensor math: {0}")]
    Candle(#[from] candle_core::Error),
}

/// Result with [`ModelError`].
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
