//! GGUF v3: reading llama.cpp's model files.
//!
//! A GGUF file is a header, a metadata table (typed key/value pairs: architecture
//! hyperparameters, the tokenizer's vocabulary, the chat template), a tensor table, and the
//! tensor data at aligned offsets. [`GgufFile::open`] memory-maps a file and parses everything
//! but the data; tensors load on demand as candle [`QTensor`](candle_core::quantized::QTensor)s
//! (quantized matrix work through candle's kernels) or dequantized to f32
//! [`Tensor`](candle_core::Tensor)s.
//!
//! ```no_run
//! use baton_model::gguf::{GgufFile, GgufHyperparams};
//! let gguf = GgufFile::open(std::path::Path::new(".models/gemma-3-270m-q4_k_m.gguf"))?;
//! let hp = GgufHyperparams::from_metadata(gguf.metadata())?;
//! let tokenizer = baton_model::gguf::tokenizer_from_gguf(gguf.metadata())?;
//! let embed = gguf.qtensor("token_embd.weight", &candle_core::Device::Cpu)?;
//! println!("{} layers, {:?}", hp.num_layers, embed.shape());
//! # Ok::<(), baton_model::ModelError>(())
//! ```
//!
//! Layout: [`reader`](parse_header) parses bytes without I/O; `file` maps and loads;
//! `metadata`/`value` are the typed table; `hparams` maps an architecture's keys to what a
//! forward pass needs; `tokenizer` rebuilds the tokenizer the file describes; `writer` writes
//! small files for tests.

mod error;
mod file;
mod hparams;
mod metadata;
mod reader;
mod tensor;
mod tokenizer;
mod value;
mod weights;
mod writer;

pub use error::GgufError;
pub use file::GgufFile;
pub(crate) use file::qtensor_from_bytes;
pub use hparams::{AttentionKind, GgufArchitecture, GgufHyperparams, MlpActivation};
pub use metadata::GgufMetadata;
pub use reader::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, GgufHeader, parse_header};
pub use tensor::{GgmlTypeId, GgufTensorInfo};
pub use tokenizer::{chat_template_from_gguf, tokenizer_from_gguf};
pub use value::{FromGgufValue, GgufArray, GgufValue, GgufValueType};
pub use weights::GgufWeights;
pub use writer::GgufWriter;
