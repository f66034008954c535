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
//! use baton_gguf::{GgufFile, GgufHyperparams};
//! let gguf = GgufFile::open(std::path::Path::new(".models/gemma-3-270m-q4_k_m.gguf"))?;
//! let hp = GgufHyperparams::from_metadata(gguf.metadata())?;
//! let embed = gguf.qtensor("token_embd.weight", &candle_core::Device::Cpu)?;
//! println!("{} layers, {:?}", hp.num_layers, embed.shape());
//! # Ok::<(), baton_gguf::GgufError>(())
//! ```
//!
//! Layout: [`reader`](parse_header) parses bytes without I/O; `file` maps and loads;
//! `metadata`/`value` are the typed table; `hparams` maps an architecture's keys to what a
//! forward pass needs; `weights` serves a file's tensors under Hugging Face names (a
//! [`WeightSource`](baton_model_types::WeightSource)); `writer` writes small files for tests;
//! [`known`] names the files `scripts/fetch-model.sh` fetches. The tokenizer and chat template
//! a file describes are built by `baton-text`; the forward pass over its weights is
//! `baton-model`'s.
//!
//! Invariant: the header, metadata and tensor table of any bytes parse or are refused with an
//! error naming the byte where parsing stopped, never a panic or a read out of bounds (counts
//! are checked against the bytes remaining before anything is made for them; `fuzz/`'s
//! `gguf_reader` target).

mod error;
mod file;
mod hparams;
pub mod known;
mod metadata;
mod reader;
mod tensor;
mod value;
mod weights;
mod writer;

pub use error::GgufError;
pub use file::{GgufFile, qtensor_from_bytes};
pub use hparams::{AttentionKind, GgufArchitecture, GgufHyperparams, MlpActivation};
pub use metadata::GgufMetadata;
pub use reader::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, GgufHeader, parse_header};
pub use tensor::{GgmlTypeId, GgufTensorInfo};
pub use value::{FromGgufValue, GgufArray, GgufValue, GgufValueType};
pub use weights::GgufWeights;
pub use writer::GgufWriter;
