//! Disaggregation at the engine level: a prefill engine computes the prompt and the first
//! token and keeps all of the request's KV; the KV moves into a decode engine with another
//! layout; the decode engine continues. The tokens and text must equal a colocated run.

use std::path::Path;
use std::sync::Arc;

use baton_engine::{Engine, EngineConfig, GenerationRequest, KvPiece, KvRetention, KvStream, RequestId, StopParams};
use baton_kv::{BlockId, KvLayout};
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
            assert_eq!(
                decode.device_invalidated_blocks(),
                reserved.blocks.len() as u64,
                "{name}: blocks reserved for received KV are read afresh by a GPU"
            );
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

/// What a layer-wise stream was told: (request, layer, layers, first block, blocks, tokens).
type Streamed = Arc<std::sync::Mutex<Vec<(u64, usize, usize, usize, Vec<BlockId>, usize)>>>;

struct Recorder(Streamed);

impl KvStream for Recorder {
    fn layer_written(&mut self, layer: usize, layers: usize, p: &KvPiece) {
        self.0.lock().expect("lock").push((p.id.0, layer, layers, p.first, p.blocks.clone(), p.tokens));
    }
}

/// A request that streams its KV hands over every layer of every prompt block exactly once
/// (a chunked prefill, a prefix from the cache, a partial last block), layer by layer in
/// order, only whole blocks before the last chunk; a request that does not stream hands
/// over nothing.
#[test]
fn a_streamed_prefill_hands_over_every_layer_of_every_block_once() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-llama");
    let ckpt = Checkpoint::open(&dir).expect("fixture loads");
    let layers = ckpt.model.config().num_layers;
    let config = EngineConfig { block_size: 4, num_blocks: 64, prefill_chunk: 6, ..EngineConfig::default() };
    let mut engine = Engine::new(Arc::new(ckpt.model), None, config).expect("engine");
    let streamed: Streamed = Arc::default();
    engine.set_kv_stream(Box::new(Recorder(streamed.clone())));
    let prompt: Vec<u32> = (1..=23).collect();
    let stop = StopParams { max_tokens: 1, ignore_eos: true, stop_strings: vec![] };
    let request = |id, prompt: &[u32], stream_kv| GenerationRequest {
        stop: stop.clone(),
        retain_kv: KvRetention::All,
        stream_kv,
        ..GenerationRequest::new(RequestId(id), prompt.to_vec())
    };
    // Request 1 streams beside request 2, which does not; request 3 finds 20 tokens of
    // request 1's prompt in the prefix cache (5 whole blocks) and computes 3.
    engine.add_request(request(1, &prompt, true)).expect("valid");
    engine.add_request(request(2, &prompt[..9], false)).expect("valid");
    let mut done = engine.run_to_completion().expect("runs");
    let mut extended = prompt[..20].to_vec();
    extended.extend([7, 8, 9]);
    engine.add_request(request(3, &extended, true)).expect("valid");
    done.extend(engine.run_to_completion().expect("runs"));
    let events = streamed.lock().expect("lock").clone();
    assert!(events.iter().all(|e| e.0 != 2), "a request that does not stream hands over nothing");
    for (id, tokens) in [(1, &prompt), (3, &extended)] {
        let kv = done.iter().find(|f| f.id == RequestId(id)).and_then(|f| f.kv.as_ref()).expect("retained KV");
        let mine: Vec<_> = events.iter().filter(|e| e.0 == id).collect();
        // Pieces in order, each reported for layers 0..L in order.
        let pieces: Vec<_> = mine.chunks(layers).collect();
        assert_eq!(mine.len() % layers, 0);
        let mut next = 0;
        for (i, piece) in pieces.iter().enumerate() {
            let (_, _, of, first, blocks, n) = piece[0];
            assert!(piece.iter().enumerate().all(|(l, e)| e.1 == l && e.2 == *of && e.3 == *first && e.4 == *blocks));
            assert_eq!(*of, layers);
            assert_eq!(*first, next, "request {id}: pieces follow each other");
            assert_eq!(blocks[..], kv.blocks[*first..*first + blocks.len()], "request {id}: its own blocks");
            let last = i + 1 == pieces.len();
            let want = if last { tokens.len() - first * 4 } else { blocks.len() * 4 };
            assert_eq!(*n, want, "request {id}: whole blocks before the last piece");
            next += blocks.len();
        }
        assert_eq!(next, tokens.len().div_ceil(4), "request {id}: every block of the prompt");
        if id == 3 {
            assert_eq!(pieces[0][0].4.len(), 6, "the cached prefix goes with the first chunk");
        }
    }
}

/// KV that arrived in the decode engine's device arena device to device (not in its host arena)
/// is settled — brought down to the host arena — before anything reads it there: when the
/// request ends and its blocks enter the prefix cache. With nothing kept (no prefix cache, no
/// retention) nothing is settled. Counted on the CPU too, where settling copies nothing.
#[test]
fn kv_that_arrived_on_the_device_is_settled_before_the_host_reads_it() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-llama");
    let ckpt = Checkpoint::open(&dir).expect("fixture loads");
    let tokenizer = Arc::new(ckpt.tokenizer.clone());
    let model = Arc::new(ckpt.model);
    let prompt = tokenizer.encode("Disaggregated inference separates prefill and decode.", true).expect("encodes");
    let stop = StopParams { max_tokens: 4, ignore_eos: true, stop_strings: vec![] };
    for prefix_caching in [true, false] {
        let config = EngineConfig { block_size: 4, num_blocks: 128, prefix_caching, ..EngineConfig::default() };
        let engine = || Engine::new(model.clone(), Some(tokenizer.clone()), config.clone()).expect("engine");
        let mut prefill = engine();
        prefill
            .add_request(GenerationRequest {
                stop: StopParams { max_tokens: 1, ..stop.clone() },
                retain_kv: KvRetention::All,
                ..GenerationRequest::new(RequestId(1), prompt.clone())
            })
            .expect("valid");
        let first = prefill.run_to_completion().expect("runs").remove(0);
        let held = first.kv.expect("the prefill keeps the request's KV");
        let mut decode = engine();
        let reserved = decode.reserve_kv(held.tokens).expect("room");
        decode.kv_mut().copy_blocks_from(prefill.kv(), &held.blocks, &reserved.blocks);
        decode.kv_arrived_on_device(&reserved.blocks);
        let n = reserved.blocks.len() as u64;
        assert_eq!(decode.device_kv_marks(), (n, 0), "marked, nothing settled while the request runs");
        decode
            .add_request(GenerationRequest {
                stop: stop.clone(),
                generated: first.token_ids.clone(),
                prefix: Some(reserved),
                ..GenerationRequest::new(RequestId(1), prompt.clone())
            })
            .expect("valid");
        decode.run_to_completion().expect("runs");
        let (_, settled) = decode.device_kv_marks();
        if prefix_caching {
            assert!(settled >= n, "the blocks entering the prefix cache were settled: {settled} of {n}");
        } else {
            assert_eq!(settled, 0, "nothing kept, nothing to settle");
        }
    }
}
