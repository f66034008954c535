//! Tokenizer: encode, decode, and decode incrementally while tokens stream out.

use std::path::Path;

use crate::error::{ModelError, Result};

/// A tokenizer with the model's special tokens.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Beginning-of-sequence text, as the chat template sees it.
    pub bos_token: Option<String>,
    /// End-of-sequence text, as the chat template sees it.
    pub eos_token: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("vocab_size", &self.vocab_size()).finish()
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", path.display())))?;
        Ok(Self::from_tokenizer(inner))
    }

    /// Wraps a tokenizer built elsewhere (from a GGUF vocabulary, say).
    pub fn from_tokenizer(inner: tokenizers::Tokenizer) -> Self {
        Self { inner, bos_token: None, eos_token: None }
    }

    /// Encodes text; `add_special_tokens` applies the post-processor (which adds BOS where the
    /// model wants it), as transformers does by default.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, add_special_tokens).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes ids to text.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(|e| ModelError::Tokenizer(e.to_string()))
    }

    /// The id of a token's text, if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

/// Turns a growing list of token ids into text deltas, never splitting a multi-byte character
/// (the prefix/read offset scheme of TGI and vLLM: decode a short window before the new tokens
/// and emit only what the new tokens added once it no longer ends in a replacement character).
#[derive(Debug, Clone, Default)]
pub struct IncrementalDecoder {
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDecoder {
    /// Text the tokens past the last call added, or an empty string while a character is
    /// incomplete. `ids` is the whole generated sequence so far.
    pub fn step(&mut self, tokenizer: &Tokenizer, ids: &[u32]) -> Result<String> {
        let prefix = tokenizer.decode(&ids[self.prefix_offset..self.read_offset], true)?;
        let full = tokenizer.decode(&ids[self.prefix_offset..], true)?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.is_char_boundary(prefix.len()) {
            let delta = full[prefix.len()..].to_owned();
            self.prefix_offset = self.read_offset;
            self.read_offset = ids.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }

    /// The text still held back at the end of generation (an incomplete character decodes to
    /// U+FFFD, as a full decode would show it).
    pub fn flush(&mut self, tokenizer: &Tokenizer, ids: &[u32]) -> Result<String> {
        let prefix = tokenizer.decode(&ids[self.prefix_offset..self.read_offset], true)?;
        let full = tokenizer.decode(&ids[self.prefix_offset..], true)?;
        self.prefix_offset = ids.len();
        self.read_offset = ids.len();
        Ok(full.get(prefix.len()..).unwrap_or_default().to_owned())
    }
}
