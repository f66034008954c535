//! The tokenizer Gemma 3 270M's GGUF file describes, against transformers' reference: every
//! reference prompt encodes to its ids and every continuation decodes to its text.
//!
//! Needs the model: run `scripts/fetch-model.sh gemma3-270m` first (CI does).

use std::path::PathBuf;
use std::sync::OnceLock;

use baton_gguf::GgufFile;
use baton_gguf::known::known_model_path;
use baton_text::{Tokenizer, chat_template_from_gguf, tokenizer_from_gguf};
use serde_json::Value;

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn gguf() -> &'static GgufFile {
    static FILE: OnceLock<GgufFile> = OnceLock::new();
    FILE.get_or_init(|| {
        let path = known_model_path(&repo_root(), "gemma3-270m").expect("a known model");
        assert!(path.is_file(), "{} is missing: run `scripts/fetch-model.sh gemma3-270m`", path.display());
        GgufFile::open(&path).expect("the fetched model parses")
    })
}

fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| tokenizer_from_gguf(gguf().metadata()).expect("tokenizer builds"))
}

fn reference() -> Value {
    let path = repo_root().join("fixtures/gemma3-270m/reference.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("reference.json is JSON")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("an id list").iter().map(|x| x.as_u64().expect("an id") as u32).collect()
}

#[test]
fn gemma3_tokenizer_encodes_every_reference_prompt() {
    let tok = tokenizer();
    assert_eq!(tok.bos_token.as_deref(), Some("<bos>"));
    assert_eq!(tok.eos_token.as_deref(), Some("<eos>"));
    assert_eq!(tok.vocab_size(), 262_144);
    for case in reference()["cases"].as_array().expect("cases") {
        let prompt = case["prompt"].as_str().expect("prompt");
        let got = tok.encode(prompt, true).expect("encodes");
        assert_eq!(got, ids(&case["input_ids"]), "prompt {prompt:?}");
    }
}

#[test]
fn gemma3_tokenizer_decodes_every_reference_continuation() {
    let tok = tokenizer();
    for case in reference()["cases"].as_array().expect("cases") {
        let text = tok.decode(&ids(&case["greedy_ids"]), true).expect("decodes");
        assert_eq!(text, case["greedy_text"].as_str().expect("text"), "prompt {:?}", case["prompt"]);
        // The prompt survives a round trip (BOS is skipped as a special token).
        let prompt = case["prompt"].as_str().expect("prompt");
        let round = tok.decode(&tok.encode(prompt, true).expect("encodes"), true).expect("decodes");
        assert_eq!(round, prompt);
    }
}

#[test]
fn gemma3_tokenizer_keeps_control_tokens_whole() {
    let tok = tokenizer();
    let ids = tok.encode("<start_of_turn>user\nHi<end_of_turn>", false).expect("encodes");
    assert_eq!(ids.first(), Some(&105));
    assert!(ids.contains(&106), "{ids:?}");
    assert_eq!(tok.decode(&ids, true).expect("decodes"), "user\nHi");
    // Bytes the vocabulary lacks fall back to <0xNN> tokens and decode back.
    let odd = "\u{1F9A9}\u{0007}";
    assert_eq!(tok.decode(&tok.encode(odd, false).expect("encodes"), true).expect("decodes"), odd);
}

#[test]
fn gemma3_base_model_has_no_chat_template() {
    let t = chat_template_from_gguf(gguf().metadata(), tokenizer()).expect("reads");
    assert!(t.is_none());
}
