//! GGUF v3, llama.cpp's model files, as this crate's users have always named it: the format
//! is `baton-gguf`'s (re-exported here whole), the tokenizer and chat template a file describes
//! `baton-text`'s.

pub(crate) use baton_gguf::qtensor_from_bytes;
pub use baton_gguf::{
    ALIGNMENT_KEY, AttentionKind, DEFAULT_ALIGNMENT, FromGgufValue, GGUF_MAGIC, GgmlTypeId, GgufArchitecture,
    GgufArray, GgufError, GgufFile, GgufHeader, GgufHyperparams, GgufMetadata, GgufTensorInfo, GgufValue,
    GgufValueType, GgufWeights, GgufWriter, MlpActivation, parse_header,
};
pub use baton_text::{chat_template_from_gguf, tokenizer_from_gguf};
