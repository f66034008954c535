//! Tokenizer: encode, decode, and decode incrementally while tokens stream out; each token's
//! bytes (what a grammar matches against, [`crate::grammar`]).

use std::path::Path;
use std::sync::{Arc, OnceLock};

use baton_model_types::{ModelError, Result};
use tokenizers::DecoderWrapper;

use crate::grammar::GrammarCompiler;

/// A tokenizer with the model's special tokens.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Beginning-of-sequence text, as the chat template sees it.
    pub bos_token: Option<String>,
    /// End-of-sequence text, as the chat template sees it.
    pub eos_token: Option<String>,
    /// The grammar compiler over this vocabulary, built on first use and shared by every clone
    /// (the conductor's validator and the engines of `baton serve` hold one tokenizer).
    grammar: Arc<OnceLock<std::result::Result<Arc<GrammarCompiler>, String>>>,
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
        Self { inner, bos_token: None, eos_token: None, grammar: Arc::default() }
    }

    /// Encodes text; `add_special_tokens` applies the post-processor (which adds BOS where the
    /// model wants it), as transformers does by default. Only the ids are kept, so the encoding
    /// skips character offsets (`encode_fast`: the same ids, a fraction of the allocations).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode_fast(text, add_special_tokens).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
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

    /// The id of the end-of-sequence token, when the tokenizer knows its text.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token.as_deref().and_then(|t| self.token_to_id(t))
    }

    /// The grammar compiler of this vocabulary: built once (its token trie is the costly part),
    /// then shared.
    pub fn grammar_compiler(&self) -> Result<Arc<GrammarCompiler>> {
        self.grammar
            .get_or_init(|| {
                // The compiler encodes with a clone that does not share this cache (sharing would
                // be a reference cycle).
                let own = Self { grammar: Arc::default(), ..self.clone() };
                GrammarCompiler::new(self.eos_token_id(), &self.token_bytes(), move |text| own.encode(text, false).ok())
                    .map(Arc::new)
            })
            .clone()
            .map_err(ModelError::Grammar)
    }

    /// The most bytes of text one token can stand for (at least 4, a whole UTF-8 character an
    /// unknown-token fallback may swallow). A text longer than `n` times this cannot encode into
    /// `n` tokens or fewer, which lets a server refuse an over-long prompt without tokenising it.
    pub fn longest_token_bytes(&self) -> usize {
        let specials: std::collections::HashSet<u32> = self.inner.get_added_tokens_decoder().into_keys().collect();
        self.token_bytes()
            .iter()
            .enumerate()
            .map(|(id, b)| if specials.contains(&(id as u32)) { b.len().saturating_sub(1) } else { b.len() })
            .max()
            .unwrap_or(0)
            .max(4)
    }

    /// Every token's bytes, indexed by id: what the token adds to the text, byte for byte.
    /// A byte-level BPE vocabulary (GPT-2's alphabet) is mapped back to bytes; a SentencePiece
    /// one has `<0xNN>` byte tokens and `▁` for a space. Special tokens are the marker byte
    /// `0xFF` and then their text (as llguidance's token trie expects: no text can spell them).
    /// Ids the vocabulary lacks are empty.
    pub fn token_bytes(&self) -> Vec<Vec<u8>> {
        let style = SpellingStyle::of(self.inner.get_decoder());
        let specials: std::collections::HashMap<u32, bool> =
            self.inner.get_added_tokens_decoder().into_iter().map(|(id, t)| (id, t.special)).collect();
        let chars = byte_level_chars();
        (0..self.vocab_size() as u32)
            .map(|id| {
                let Some(piece) = self.inner.id_to_token(id) else { return Vec::new() };
                match specials.get(&id) {
                    Some(true) => [&[SPECIAL_TOKEN_MARKER], piece.as_bytes()].concat(),
                    Some(false) => piece.into_bytes(),
                    None => style.bytes(&piece, &chars).unwrap_or_else(|| {
                        // A piece outside the spelling (rare): its decoded text.
                        self.inner.decode(&[id], false).unwrap_or_default().into_bytes()
                    }),
                }
            })
            .collect()
    }
}

/// The byte that starts a special token's bytes in [`Tokenizer::token_bytes`] (never valid
/// UTF-8, so no text spells a special token).
pub(crate) const SPECIAL_TOKEN_MARKER: u8 = 0xFF;

/// How a vocabulary spells bytes in its token strings.
#[derive(Debug, Clone, Copy)]
enum SpellingStyle {
    /// GPT-2's byte-level alphabet: each byte is one printable character.
    ByteLevel,
    /// SentencePiece: `<0xNN>` tokens for bytes, this character for a space.
    ByteFallback(char),
    /// Neither: decode each token.
    Decoded,
}

impl SpellingStyle {
    fn of(decoder: Option<&DecoderWrapper>) -> Self {
        fn walk(d: &DecoderWrapper, level: &mut bool, fallback: &mut bool) {
            match d {
                DecoderWrapper::ByteLevel(_) => *level = true,
                DecoderWrapper::ByteFallback(_) => *fallback = true,
                DecoderWrapper::Sequence(s) => s.get_decoders().iter().for_each(|d| walk(d, level, fallback)),
                _ => {}
            }
        }
        let (mut level, mut fallback) = (false, false);
        if let Some(d) = decoder {
            walk(d, &mut level, &mut fallback);
        }
        match (level, fallback) {
            (true, _) => SpellingStyle::ByteLevel,
            (false, true) => SpellingStyle::ByteFallback('\u{2581}'),
            (false, false) => SpellingStyle::Decoded,
        }
    }

    /// The bytes a token string stands for; `None` when it is not spelled this way.
    fn bytes(self, piece: &str, chars: &std::collections::HashMap<char, u8>) -> Option<Vec<u8>> {
        match self {
            SpellingStyle::ByteLevel => piece.chars().map(|c| chars.get(&c).copied()).collect(),
            SpellingStyle::ByteFallback(space) => {
                if let Some(hex) = piece.strip_prefix("<0x").and_then(|p| p.strip_suffix('>'))
                    && hex.len() == 2
                {
                    return u8::from_str_radix(hex, 16).ok().map(|b| vec![b]);
                }
                Some(piece.replace(space, " ").into_bytes())
            }
            SpellingStyle::Decoded => None,
        }
    }
}

/// GPT-2's byte-level alphabet, character to byte: printable Latin-1 bytes stand for
/// themselves, the others for U+0100 onwards in byte order.
fn byte_level_chars() -> std::collections::HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (char::from(b), b)
            } else {
                let c = char::from_u32(next).expect("U+0100..U+0143 are characters");
                next += 1;
                (c, b)
            }
        })
        .collect()
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
