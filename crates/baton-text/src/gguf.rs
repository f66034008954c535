//! The tokenizer a GGUF file describes (`tokenizer.ggml.*`), rebuilt as a `tokenizers`
//! tokenizer that encodes as transformers' GGUF loader does, and the chat template.
//!
//! - `llama` (SentencePiece vocabulary with scores): a BPE whose merges are derived from the
//!   vocabulary, with byte fallback and `▁` for spaces. Gemma's vocabulary (recognisable by
//!   tokens that are runs of plain spaces) ranks merges by vocabulary position, writes space runs
//!   as `▁` runs, replaces spaces with `▁` in a normalizer and splits nothing before the BPE;
//!   other SentencePiece files rank merges by score and use a `Metaspace` pre-tokenizer.
//! - `gpt2` (byte-level BPE with `tokenizer.ggml.merges`): the split regex named by
//!   `tokenizer.ggml.pre` (Llama 3, Qwen2, ...) in front of a byte-level pre-tokenizer; for
//!   `smollm` (SmolLM2), `starcoder` and `refact`, each digit is split off first.
//!
//! Control tokens (`token_type` 3) are special added tokens, so `<start_of_turn>` in a rendered
//! chat encodes as one id and decoding with `skip_special_tokens` drops them. BOS (and EOS) are
//! added by a template post-processor when `tokenizer.ggml.add_bos_token` (`add_eos_token`) is
//! true.

use std::collections::HashMap;

use baton_gguf::{GgufArray, GgufError, GgufMetadata};
use baton_model_types::ModelError;
use tokenizers::decoders::{
    DecoderWrapper, byte_fallback::ByteFallback, byte_level::ByteLevel as ByteLevelDecoder, fuse::Fuse,
    sequence::Sequence as DecoderSequence, strip::Strip,
};
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::{NormalizerWrapper, replace::Replace};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::chat::ChatTemplate;
use crate::tokenizer::Tokenizer;

/// SentencePiece's space marker.
const SPACE: char = '\u{2581}';
/// `token_type` of control tokens (`<bos>`, `<start_of_turn>`, ...).
const TOKEN_TYPE_CONTROL: i32 = 3;

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `tokenizer.ggml.pre` names whose splitting is each digit alone, then GPT-2's regex.
const DIGITS_THEN_GPT2: &[&str] = &["smollm", "starcoder", "refact"];

/// The split regex for a `tokenizer.ggml.pre` name; `None` means GPT-2's, which the byte-level
/// pre-tokenizer applies itself.
fn pre_split(pre: &str) -> Option<&'static str> {
    match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "smaug-bpe" | "dbrx" | "pixtral" => Some(LLAMA3_SPLIT),
        "qwen2" | "deepseek-r1-qwen" | "megrez" => Some(QWEN2_SPLIT),
        _ => None,
    }
}

/// Builds the tokenizer a GGUF file describes, with BOS/EOS text set for chat templates.
pub fn tokenizer_from_gguf(m: &GgufMetadata) -> Result<Tokenizer, GgufError> {
    let fail = |reason: String| GgufError::Tokenizer { path: m.path().to_owned(), reason };
    let model: &str = m.get("tokenizer.ggml.model")?;
    let tokens: &[String] = m.get("tokenizer.ggml.tokens")?;
    let token_types = token_types(m, tokens.len())?;
    let token_at = |key: &str| -> Result<Option<String>, GgufError> {
        match m.get_opt::<usize>(key)? {
            None => Ok(None),
            Some(i) => tokens
                .get(i)
                .cloned()
                .map(Some)
                .ok_or_else(|| m.invalid(key, format!("is {i}, past the {} tokens", tokens.len()))),
        }
    };
    let bos = token_at("tokenizer.ggml.bos_token_id")?;
    let eos = token_at("tokenizer.ggml.eos_token_id")?;
    let unk = token_at("tokenizer.ggml.unknown_token_id")?;

    let mut inner = match model {
        "llama" if is_gemma_vocabulary(tokens) => gemma(m, tokens, unk.as_deref()).map_err(fail)?,
        "llama" => sentencepiece(m, tokens, unk.as_deref())?,
        "gpt2" => byte_level(m, tokens)?,
        other => {
            return Err(m.invalid("tokenizer.ggml.model", format!("is `{other}`; supported: llama, gpt2")));
        }
    };

    // Control tokens match verbatim in text and are skipped by `decode(.., true)`. (A byte-level
    // vocabulary spells them in its own alphabet only when they are plain ASCII-like text.)
    let control: Vec<AddedToken> = tokens
        .iter()
        .zip(&token_types)
        .filter(|&(_, &ty)| ty == TOKEN_TYPE_CONTROL)
        .map(|(t, _)| AddedToken::from(t.clone(), true).normalized(false))
        .collect();
    inner.add_special_tokens(control).map_err(|e| fail(format!("control tokens: {e}")))?;

    let add_bos = m.get_opt::<bool>("tokenizer.ggml.add_bos_token")?.unwrap_or(model == "llama");
    let add_eos = m.get_opt::<bool>("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let mut specials = Vec::new();
    let with_id = |t: &String| (t.clone(), inner.token_to_id(t).unwrap_or_default());
    if let (true, Some(b)) = (add_bos, &bos) {
        single.push(format!("{b}:0"));
        pair.push(format!("{b}:0"));
        specials.push(with_id(b));
    }
    single.push("$A:0".to_owned());
    pair.push("$A:0".to_owned());
    if let (true, Some(e)) = (add_eos, &eos) {
        single.push(format!("{e}:0"));
        pair.push(format!("{e}:0"));
        specials.push(with_id(e));
    }
    if let (true, Some(b)) = (add_bos, &bos) {
        pair.push(format!("{b}:1"));
    }
    pair.push("$B:1".to_owned());
    if let (true, Some(e)) = (add_eos, &eos) {
        pair.push(format!("{e}:1"));
    }
    if !specials.is_empty() {
        let post = TemplateProcessing::builder()
            .try_single(single)
            .and_then(|b| b.try_pair(pair))
            .map_err(|e| fail(format!("BOS/EOS template: {e}")))?
            .special_tokens(specials)
            .build()
            .map_err(|e| fail(format!("BOS/EOS template: {e}")))?;
        inner.with_post_processor(Some(post));
    }

    let mut tokenizer = Tokenizer::from_tokenizer(inner);
    tokenizer.bos_token = bos;
    tokenizer.eos_token = eos;
    Ok(tokenizer)
}

/// The chat template a GGUF file carries (`tokenizer.chat_template`), if any, with the BOS/EOS
/// text of `tokenizer`.
pub fn chat_template_from_gguf(m: &GgufMetadata, tokenizer: &Tokenizer) -> Result<Option<ChatTemplate>, ModelError> {
    let Some(source) = m.get_opt::<&str>("tokenizer.chat_template")? else { return Ok(None) };
    ChatTemplate::new(source, tokenizer.bos_token.as_deref(), tokenizer.eos_token.as_deref())
        .map(Some)
        .map_err(|e| ModelError::Template(format!("{}: tokenizer.chat_template: {e}", m.path().display())))
}

fn token_types(m: &GgufMetadata, n: usize) -> Result<Vec<i32>, GgufError> {
    const KEY: &str = "tokenizer.ggml.token_type";
    let Some(types) = m.get_opt::<&GgufArray>(KEY)? else { return Ok(vec![1; n]) };
    let types = types.to_i64_vec().ok_or_else(|| m.invalid(KEY, "is not an integer array"))?;
    if types.len() != n {
        return Err(m.invalid(KEY, format!("has {} entries for {n} tokens", types.len())));
    }
    Ok(types.into_iter().map(|t| i32::try_from(t).unwrap_or(0)).collect())
}

/// Gemma writes runs of spaces as spaces where SentencePiece writes `▁`.
fn is_gemma_vocabulary(tokens: &[String]) -> bool {
    tokens.iter().any(|t| !t.is_empty() && t.contains(' ') && t.trim().is_empty())
}

/// A run of spaces as the vocabulary's BPE sees it: `▁` per space.
fn respell_spaces(token: &str) -> String {
    if token.contains(' ') && token.trim().is_empty() {
        SPACE.to_string().repeat(token.chars().count())
    } else {
        token.to_owned()
    }
}

/// Merges derived from a vocabulary: for each token, every split into two tokens, ranked by
/// `rank` of the merged token (higher first), ties between a token's splits broken by the
/// pieces' scores (higher first). What transformers' `GGUFTokenizerSkeleton` does.
fn derive_merges(tokens: &[String], scores: &[f32], rank: impl Fn(usize) -> f64) -> Vec<(String, String)> {
    // Later duplicates win, as in a Python dict built from the list.
    let index: HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i)).collect();
    let mut merges: Vec<(f64, usize, usize, usize)> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for token in tokens {
        if !seen.insert(token.as_str()) {
            continue;
        }
        let merged = index[token.as_str()];
        let start = merges.len();
        for (split, _) in token.char_indices().skip(1) {
            let (l, r) = token.split_at(split);
            if let (Some(&li), Some(&ri)) = (index.get(l), index.get(r)) {
                merges.push((rank(merged), li, ri, split));
            }
        }
        merges[start..].sort_by(|a, b| {
            let key = |m: &(f64, usize, usize, usize)| (scores[m.1], scores[m.2]);
            key(b).partial_cmp(&key(a)).unwrap_or(std::cmp::Ordering::Equal)
        });
    }
    merges.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap_or(std::cmp::Ordering::Equal));
    merges.into_iter().map(|(_, l, r, _)| (tokens[l].clone(), tokens[r].clone())).collect()
}

fn scores_of(m: &GgufMetadata, n: usize) -> Result<Vec<f32>, GgufError> {
    const KEY: &str = "tokenizer.ggml.scores";
    let scores: &[f32] = m.get(KEY)?;
    if scores.len() != n {
        return Err(m.invalid(KEY, format!("has {} entries for {n} tokens", scores.len())));
    }
    Ok(scores.to_vec())
}

fn bpe(
    tokens: &[String],
    merges: Vec<(String, String)>,
    unk: Option<&str>,
    byte_fallback: bool,
) -> Result<tokenizers::Tokenizer, String> {
    let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let mut builder = BPE::builder().vocab_and_merges(vocab, merges).byte_fallback(byte_fallback);
    if let Some(unk) = unk {
        builder = builder.unk_token(unk.to_owned()).fuse_unk(true);
    }
    let model = builder.build().map_err(|e| format!("BPE: {e}"))?;
    Ok(tokenizers::Tokenizer::new(model))
}

fn gemma(m: &GgufMetadata, tokens: &[String], unk: Option<&str>) -> Result<tokenizers::Tokenizer, String> {
    let tokens: Vec<String> = tokens.iter().map(|t| respell_spaces(t)).collect();
    let scores = scores_of(m, tokens.len()).map_err(|e| e.to_string())?;
    // The scores of a Gemma file are merge ranks with placeholders (-1000 for every special and
    // whitespace token); the vocabulary's order is the merge order.
    let merges = derive_merges(&tokens, &scores, |i| -(i as f64));
    let mut tk = bpe(&tokens, merges, unk, true)?;
    let normalizer = Replace::new(" ", SPACE.to_string()).map_err(|e| e.to_string())?;
    tk.with_normalizer(Some(NormalizerWrapper::Replace(normalizer))).map_err(|e| e.to_string())?;
    let add_prefix_space = m.get_opt::<bool>("tokenizer.ggml.add_space_prefix").map_err(|e| e.to_string())?;
    tk.with_decoder(Some(spm_decoder(true, add_prefix_space.unwrap_or(true))));
    Ok(tk)
}

fn sentencepiece(m: &GgufMetadata, tokens: &[String], unk: Option<&str>) -> Result<tokenizers::Tokenizer, GgufError> {
    let fail = |reason: String| GgufError::Tokenizer { path: m.path().to_owned(), reason };
    let scores = scores_of(m, tokens.len())?;
    let merges = derive_merges(tokens, &scores, |i| f64::from(scores[i]));
    let mut tk = bpe(tokens, merges, unk, true).map_err(fail)?;
    let add_prefix_space = m.get_opt::<bool>("tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
    let scheme = if add_prefix_space { PrependScheme::First } else { PrependScheme::Never };
    tk.with_pre_tokenizer(Some(PreTokenizerWrapper::Metaspace(Metaspace::new(SPACE, scheme, false))));
    tk.with_decoder(Some(spm_decoder(false, add_prefix_space)));
    Ok(tk)
}

/// SentencePiece decoding: `▁` back to spaces, `<0xNN>` tokens back to bytes, and the prefix
/// space dropped when encoding added one. Gemma replaces before byte fallback, as transformers'
/// Gemma converter does.
fn spm_decoder(replace_first: bool, strip_prefix_space: bool) -> DecoderWrapper {
    let replace = DecoderWrapper::Replace(Replace::new(SPACE.to_string(), " ").unwrap_or_else(|_| unreachable!()));
    let mut seq = Vec::new();
    if replace_first {
        seq.push(replace.clone());
    }
    seq.push(DecoderWrapper::ByteFallback(ByteFallback::new()));
    seq.push(DecoderWrapper::Fuse(Fuse::new()));
    if !replace_first {
        seq.push(replace);
    }
    if strip_prefix_space {
        seq.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
    }
    DecoderWrapper::Sequence(DecoderSequence::new(seq))
}

fn byte_level(m: &GgufMetadata, tokens: &[String]) -> Result<tokenizers::Tokenizer, GgufError> {
    const KEY: &str = "tokenizer.ggml.merges";
    let fail = |reason: String| GgufError::Tokenizer { path: m.path().to_owned(), reason };
    let merges: &[String] = m.get(KEY)?;
    let merges = merges
        .iter()
        .map(|s| s.split_once(' ').map(|(a, b)| (a.to_owned(), b.to_owned())))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| m.invalid(KEY, "has an entry without a space"))?;
    let mut tk = bpe(tokens, merges, None, false).map_err(fail)?;
    let pre = m.get_opt::<&str>("tokenizer.ggml.pre")?.unwrap_or("default");
    let pre_tokenizer = match pre_split(pre) {
        // llama.cpp's `smollm` (and `starcoder`, `refact`): every digit apart (its first regex,
        // `\p{N}`), then GPT-2's split, as SmolLM2's tokenizer.json (`Digits` then `ByteLevel`).
        _ if DIGITS_THEN_GPT2.contains(&pre) => PreTokenizerWrapper::Sequence(PreSequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
        ])),
        Some(regex) => {
            let split = Split::new(SplitPattern::Regex(regex.to_owned()), SplitDelimiterBehavior::Isolated, false)
                .map_err(|e| fail(format!("split regex for `{pre}`: {e}")))?;
            PreTokenizerWrapper::Sequence(PreSequence::new(vec![
                PreTokenizerWrapper::Split(split),
                PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, false)),
            ]))
        }
        None => PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
    };
    tk.with_pre_tokenizer(Some(pre_tokenizer));
    tk.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevelDecoder::default())));
    Ok(tk)
}
