//! The grammar glue on the real vocabularies of the models `scripts/fetch-model.sh` fetches:
//! SmolLM2's byte-level BPE and Gemma 3's SentencePiece (byte fallback, `▁` for spaces). Each
//! token's bytes spell the text it encodes, special tokens are marked, and a JSON schema
//! sampled under the grammar with random logits parses and validates.
//!
//! Needs the models: run `scripts/fetch-model.sh smollm2-135m-instruct gemma3-270m` (the tests
//! fail, not skip, without them).

use std::path::PathBuf;

use baton_gguf::GgufFile;
use baton_gguf::known::known_model_path;
use baton_text::{Constraint, Tokenizer, argmax, tokenizer_from_gguf};
use rand::{Rng, SeedableRng, rngs::StdRng};
use serde_json::{Value, json};

fn tokenizer(name: &str) -> Tokenizer {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let path = known_model_path(&root, name).expect("a known model");
    assert!(path.is_file(), "{} is missing: run `scripts/fetch-model.sh {name}` first", path.display());
    tokenizer_from_gguf(GgufFile::open(&path).expect("opens").metadata()).expect("the tokenizer builds")
}

fn check(name: &str) {
    let t = tokenizer(name);
    let bytes = t.token_bytes();
    assert_eq!(bytes.len(), t.vocab_size(), "{name}");
    for text in
        ["Hello, world!", "  two spaces\tand a tab\n", "{\"a\": [1, 2.5e3], \"b\": null}", "naïve café – 東京 🙂"]
    {
        let ids = t.encode(text, false).expect("encodes");
        let spelled: Vec<u8> = ids.iter().flat_map(|&i| bytes[i as usize].clone()).collect();
        assert_eq!(String::from_utf8_lossy(&spelled), text, "{name}: {ids:?}");
    }
    let eos = t.eos_token_id().expect("an EOS token");
    assert_eq!(bytes[eos as usize][0], 0xFF, "{name}: EOS is a special token");

    let compiler = t.grammar_compiler().expect("the compiler builds");
    let schema = json!({"type": "object", "properties": {"word": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["word", "n"],
        "additionalProperties": false});
    let mut rng = StdRng::seed_from_u64(5);
    let mut grammar = compiler.compile(&Constraint::JsonSchema(schema)).expect("compiles");
    let mut tokens = Vec::new();
    while !grammar.is_finished() {
        assert!(tokens.len() < 200, "{name}: the grammar never ended");
        let mut logits: Vec<f32> = (0..t.vocab_size()).map(|_| rng.random::<f32>()).collect();
        grammar.mask(&mut logits);
        let token = argmax(&logits);
        grammar.commit(token).expect("allowed");
        tokens.push(token);
    }
    let text = t.decode(&tokens, true).expect("decodes");
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: {text:?}: {e}"));
    assert!(v["word"].as_str().is_some_and(|w| w.chars().count() <= 8), "{name}: {text}");
    assert!(v["n"].as_i64().is_some_and(|n| (-5..=5).contains(&n)), "{name}: {text}");
}

#[test]
fn smollm2_byte_level_vocabulary() {
    check("smollm2-135m-instruct");
}

#[test]
fn gemma3_sentencepiece_vocabulary() {
    check("gemma3-270m");
}
