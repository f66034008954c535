//! The tokenizer and chat template a GGUF file describes, on small files these tests write
//! themselves: no model download needed.

use std::path::Path;

use baton_gguf::{GgufArray, GgufFile, GgufValue, GgufWriter};
use baton_text::{ChatMessage, chat_template_from_gguf, tokenizer_from_gguf};

/// The file `w` writes, read back.
fn open(w: &GgufWriter) -> GgufFile {
    GgufFile::from_bytes(w.to_bytes(), Path::new("tokenizer.gguf")).expect("parses")
}

fn strings(v: &[&str]) -> GgufValue {
    GgufValue::Array(GgufArray::String(v.iter().map(|s| (*s).to_owned()).collect()))
}

fn s(v: &str) -> GgufValue {
    GgufValue::String(v.to_owned())
}

/// Writes a SentencePiece-style tokenizer: `(token, token_type, score)` triples.
fn spm_tokenizer_metadata(w: &mut GgufWriter, vocab: &[(&str, i32, f32)], bos: u32, eos: u32, unk: u32) {
    w.add_metadata("tokenizer.ggml.model", s("llama"));
    w.add_metadata("tokenizer.ggml.tokens", strings(&vocab.iter().map(|v| v.0).collect::<Vec<_>>()));
    w.add_metadata("tokenizer.ggml.token_type", GgufValue::Array(GgufArray::I32(vocab.iter().map(|v| v.1).collect())));
    w.add_metadata("tokenizer.ggml.scores", GgufValue::Array(GgufArray::F32(vocab.iter().map(|v| v.2).collect())));
    w.add_metadata("tokenizer.ggml.bos_token_id", GgufValue::U32(bos));
    w.add_metadata("tokenizer.ggml.eos_token_id", GgufValue::U32(eos));
    w.add_metadata("tokenizer.ggml.unknown_token_id", GgufValue::U32(unk));
    w.add_metadata("tokenizer.ggml.add_bos_token", GgufValue::Bool(true));
}

#[test]
fn sentencepiece_vocabulary_becomes_a_bpe_with_byte_fallback() {
    let vocab = [
        ("<unk>", 2, 0.0),
        ("<s>", 3, 0.0),
        ("</s>", 3, 0.0),
        ("<0x78>", 6, 0.0),
        ("\u{2581}", 1, -1.0),
        ("h", 1, -2.0),
        ("i", 1, -3.0),
        ("\u{2581}h", 1, -4.0),
        ("hi", 1, -5.0),
        ("\u{2581}hi", 1, -6.0),
        ("<ctl>", 3, 0.0),
    ];
    let mut w = GgufWriter::new();
    spm_tokenizer_metadata(&mut w, &vocab, 1, 2, 0);
    let tok = tokenizer_from_gguf(open(&w).metadata()).expect("builds");
    assert_eq!(tok.bos_token.as_deref(), Some("<s>"));
    assert_eq!(tok.eos_token.as_deref(), Some("</s>"));
    // A prefix space is added (add_space_prefix defaults to true), 'x' falls back to a byte.
    assert_eq!(tok.encode("hi hix", true).expect("encodes"), [1, 9, 9, 3]);
    assert_eq!(tok.encode("hi", false).expect("encodes"), [9]);
    assert_eq!(tok.decode(&[1, 9, 9, 3], true).expect("decodes"), "hi hix");
    // A control token matches whole; the text after it gets no prefix space.
    assert_eq!(tok.encode("<ctl>hi", false).expect("encodes"), [10, 8]);
}

#[test]
fn gemma_vocabulary_keeps_spaces_and_ranks_merges_by_position() {
    // Scores would merge `\u{2581}h` before `hi`; Gemma's vocabulary order says `hi` first.
    let vocab = [
        ("<pad>", 3, -1000.0),
        ("<eos>", 3, -1000.0),
        ("<bos>", 3, -1000.0),
        ("<unk>", 2, -1000.0),
        ("  ", 4, -1000.0),
        ("<0x78>", 6, 0.0),
        ("\u{2581}", 1, -6.0),
        ("h", 1, -7.0),
        ("i", 1, -8.0),
        ("hi", 1, -100.0),
        ("\u{2581}h", 1, -1.0),
    ];
    let mut w = GgufWriter::new();
    spm_tokenizer_metadata(&mut w, &vocab, 2, 1, 3);
    w.add_metadata("tokenizer.ggml.add_space_prefix", GgufValue::Bool(false));
    let tok = tokenizer_from_gguf(open(&w).metadata()).expect("builds");
    // No prefix space; two spaces are the respelled `\u{2581}\u{2581}` token (4).
    assert_eq!(tok.encode("hi  hi", true).expect("encodes"), [2, 9, 4, 9]);
    assert_eq!(tok.encode("hi hi", false).expect("encodes"), [9, 6, 9]);
    assert_eq!(tok.encode("x", false).expect("encodes"), [5]);
    assert_eq!(tok.decode(&[9, 4, 9, 6, 9, 5], false).expect("decodes"), "hi  hi hix");
}

#[test]
fn byte_level_vocabulary_uses_the_merges() {
    let mut w = GgufWriter::new();
    // GPT-2's byte-level alphabet writes a space as 'Ġ'.
    let tokens = ["<|bos|>", "h", "i", "Ġ", "hi", "Ġhi", "<|eot|>"];
    w.add_metadata("tokenizer.ggml.model", s("gpt2"));
    w.add_metadata("tokenizer.ggml.pre", s("qwen2"));
    w.add_metadata("tokenizer.ggml.tokens", strings(&tokens));
    w.add_metadata("tokenizer.ggml.token_type", GgufValue::Array(GgufArray::I32(vec![3, 1, 1, 1, 1, 1, 3])));
    w.add_metadata("tokenizer.ggml.merges", strings(&["h i", "Ġ hi"]));
    w.add_metadata("tokenizer.ggml.bos_token_id", GgufValue::U32(0));
    w.add_metadata("tokenizer.ggml.eos_token_id", GgufValue::U32(6));
    w.add_metadata("tokenizer.ggml.add_bos_token", GgufValue::Bool(false));
    w.add_metadata("tokenizer.chat_template", s("{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"));
    let f = open(&w);
    let tok = tokenizer_from_gguf(f.metadata()).expect("builds");
    assert_eq!(tok.encode("hi hi", true).expect("encodes"), [4, 5]);
    assert_eq!(tok.encode("hi<|eot|>", true).expect("encodes"), [4, 6]);
    assert_eq!(tok.decode(&[4, 5, 6], true).expect("decodes"), "hi hi");

    let template = chat_template_from_gguf(f.metadata(), &tok).expect("compiles").expect("present");
    let out = template.render(&[ChatMessage::new("user", "hi")], false).expect("renders");
    assert_eq!(out, "hi<|eot|>");
}
