//! Errors of reading a GGUF file. Every one names the file, and where it applies the metadata
//! key or the tensor.

use std::path::PathBuf;

use baton_model_types::ModelError;

/// What can go wrong reading a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be opened or mapped.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The header, metadata or tensor table is not valid GGUF.
    #[error("{path} is not a valid GGUF file: {reason} (at byte {offset})")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// Byte offset where parsing stopped.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// A metadata key the caller needs is absent.
    #[error("{path}: missing metadata key `{key}`")]
    MissingKey {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
    },
    /// A metadata value has another type than the caller needs.
    #[error("{path}: metadata key `{key}` is {actual}, expected {expected}")]
    KeyType {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// What the caller needs.
        expected: &'static str,
        /// What the file holds.
        actual: String,
    },
    /// A metadata value has the right type but an unusable value.
    #[error("{path}: metadata key `{key}` {reason}")]
    InvalidValue {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// `general.architecture` names an architecture Baton does not map.
    #[error("{path}: architecture `{architecture}` is not supported (supported: {supported})")]
    UnsupportedArchitecture {
        /// The file.
        path: PathBuf,
        /// What the file says.
        architecture: String,
        /// What Baton knows.
        supported: &'static str,
    },
    /// No tensor of that name.
    #[error("{path}: no tensor `{name}`")]
    MissingTensor {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
    },
    /// A tensor cannot be loaded (unsupported type, bad shape, tensor library failure).
    #[error("{path}: tensor `{name}`: {reason}")]
    Tensor {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// What went wrong.
        reason: String,
    },
    /// The tokenizer described by the metadata cannot be built.
    #[error("{path}: tokenizer: {reason}")]
    Tokenizer {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
}

impl From<GgufError> for ModelError {
    fn from(e: GgufError) -> Self {
        match e {
            GgufError::Io { path, source } => ModelError::Io { path, source },
            GgufError::MissingKey { path, key } => ModelError::MissingField { path, field: key },
            GgufError::KeyType { path, key, expected, actual } => {
                ModelError::InvalidField { path, field: key, reason: format!("is {actual}, expected {expected}") }
            }
            GgufError::InvalidValue { path, key, reason } => ModelError::InvalidField { path, field: key, reason },
            GgufError::UnsupportedArchitecture { path, architecture, supported } => {
                ModelError::UnsupportedArchitecture { path, architecture, supported }
            }
            GgufError::MissingTensor { path, name } => {
                ModelError::MissingTensor { name, location: path.display().to_string() }
            }
            GgufError::Malformed { path, offset, reason } => {
                ModelError::BadWeights { path, reason: format!("not a valid GGUF file: {reason} (at byte {offset})") }
            }
            GgufError::Tensor { path, name, reason } => {
                ModelError::BadWeights { path, reason: format!("tensor `{name}`: {reason}") }
            }
            e @ GgufError::Tokenizer { .. } => ModelError::Tokenizer(e.to_string()),
        }
    }
}
