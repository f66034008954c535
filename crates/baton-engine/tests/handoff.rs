//! Disaggregation at the engine level: a prefill engine computes the prompt and the first
//! token and keeps all of the request's KV; the KV moves into a decode engine with another
//! layout; the decode engine continues. The tokens and text must equal a colocated run.

use std::path::Path;
use std::sync::Arc;

use baton_engine::{Engine, EngineConfig, GenerationRequest, KvRetention, RequestId, StopParams};
use baton_kv::KvLayout;
use baton_model::Checkpoint;

#[test]
fn prefill_then_decode_equals_colocated() {
    for name in ["tiny-llama", "tiny-qwen2"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models").join(name);
        let ckpt = Checkpoint::open(&dir).expect("fixture loads");
        let tokenizer = Arc::new(ckpt.tokenizer.clone());
        let model = Arc::new(ckpt.model);
        let engine = |layout| {
            let config = EngineConfig { block_size: 4, num_blocks: 128, layout, ..EngineConfig::default() };
            Engine::new(model.clone(), Some(tokenizer.clone()), config).expect("engine")
        };
        let stop = StopParams { max_tokens: 12, ignore_eos: true, stop_strings: vec![] };
        for (i, text) in ["Disaggregated inference separates prefill and decode.", "Mooncake", "A"].iter().enumerate() {
            let prompt = tokenizer.encode(text, true).expect("encodes");
            let id = RequestId(i as u64);

            let mut colocated = engine(KvLayout::BlockMajor);
            colocated
                .add_request(GenerationRequest { stop: stop.clone(), ..GenerationRequest::new(id, prompt.clone()) })
                .expect("valid");
            let want = colocated.run_to_completion().expect("runs").remove(0);

            let mut prefill = engine(KvLayout::LayerMajor);
            prefill
                .add_request(GenerationRequest {
                    stop: StopParams { max_tokens: 1, ..stop.clone() },
                    retain_kv: KvRetention::All,
                    ..GenerationRequest::new(id, prompt.clone())
                })
                .expect("valid");
            let first = prefill.run_to_completion().expect("runs").remove(0);
            let held = first.kv.expect("the prefill keeps the request's KV");
            assert_eq!(held.tokens, prompt.len(), "{name}: KV of every prompt token, partial block included");

            let mut decode = engine(KvLayout::BlockMajor);
            let reserved = decode.reserve_kv(held.tokens).expect("room");
            decode.kv_mut().copy_blocks_from(prefill.kv(), &held.blocks, &reserved.blocks);
            prefill.release_kv(held).expect("releases");
            assert_eq!(prefill.available_blocks(), 128, "{name}: the prefill side holds nothing after handing over");
            decode
                .add_request(GenerationRequest {
                    stop: stop.clone(),
                    generated: first.token_ids.clone(),
                    prefix: Some(reserved),
                    ..GenerationRequest::new(id, prompt.clone())
                })
                .expect("valid");
            let rest = decode.run_to_completion().expect("runs").remove(0);
            assert_eq!(rest.cached_tokens, prompt.len(), "{name}: the decode side computed no prompt token");
            assert_eq!(rest.token_ids, want.token_ids, "{name} {text:?}: tokens");
            assert_eq!(rest.text, want.text, "{name} {text:?}: text (upstream tokens included)");
            assert!(want.text.starts_with(&first.text), "{name}: the prefill's text is the start");
            assert_eq!(decode.available_blocks(), 128);
            decode.pool().check_invariants().expect("decode pool accounting");
            prefill.pool().check_invariants().expect("prefill pool accounting");
        }
    }
}

/// The text deltas a request streams, one per token, run alone on a fresh engine.
fn stream_deltas(engine: &mut Engine, req: GenerationRequest) -> (Vec<u32>, Vec<String>) {
    let id = req.id;
    engine.add_request(req).expect("valid");
    let (mut tokens, mut deltas) = (Vec::new(), Vec::new());
    while engine.has_work() {
        for t in engine.step().expect("steps").tokens.into_iter().filter(|t| t.id == id) {
            tokens.push(t.token);
            deltas.push(t.text_delta);
        }
    }
    (tokens, deltas)
}

/// Mid-stream migration: another engine continues from the prompt and the tokens streamed so
/// far. Wherever the cut falls, even inside a multi-byte character (the tiny models stream byte
/// tokens), the text it streams continues the text already streamed, with nothing repeated and
/// nothing lost.
#[test]
fn a_migrated_sequence_streams_exactly_the_rest_of_the_text() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-llama");
    let ckpt = Checkpoint::open(&dir).expect("fixture loads");
    let tokenizer = Arc::new(ckpt.tokenizer.clone());
    let model = Arc::new(ckpt.model);
    let engine = || {
        let config = EngineConfig { block_size: 4, num_blocks: 128, ..EngineConfig::default() };
        Engine::new(model.clone(), Some(tokenizer.clone()), config).expect("engine")
    };
    let prompt = tokenizer.encode("Disaggregated inference separates prefill and decode.", true).expect("encodes");
    let stop = StopParams { max_tokens: 40, ignore_eos: true, stop_strings: vec![] };
    let request = |generated: Vec<u32>| GenerationRequest {
        stop: stop.clone(),
        generated,
        ..GenerationRequest::new(RequestId(1), prompt.clone())
    };
    let (tokens, deltas) = stream_deltas(&mut engine(), request(Vec::new()));
    let whole: String = deltas.concat();
    let mut cuts_inside_a_character = 0;
    for k in 1..tokens.len() {
        let before: String = deltas[..k].concat();
        let held_back = tokenizer.decode(&tokens[..k], true).expect("decodes").ends_with('\u{FFFD}');
        cuts_inside_a_character += usize::from(held_back);
        let (rest, rest_deltas) = stream_deltas(&mut engine(), request(tokens[..k].to_vec()));
        assert_eq!(rest, tokens[k..], "cut at {k}: tokens");
        assert_eq!(before + &rest_deltas.concat(), whole, "cut at {k} (inside a character: {held_back}): text");
    }
    assert!(cuts_inside_a_character > 0, "no cut fell inside a character: the test proves nothing");
}
