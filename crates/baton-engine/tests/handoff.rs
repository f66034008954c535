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
