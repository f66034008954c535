//! Batch invariance on the CPU: a greedy request's logits are the same, bit for bit, whatever
//! else is in its steps and however its prompt is chunked (issue #63, item 2).
//!
//! One target prompt runs alone (its whole prompt in one step, then one-row decode steps), then
//! inside batches of 2 to 32 mixed requests with small prefill chunks and token budgets, so that
//! its prompt is cut into chunks of several sizes and its rows share steps with other prompts'
//! chunks and other sequences' decode rows. Every time, the logits of each of its prompt
//! positions (`return_prompt_logits`) must equal those it had alone bit for bit, and so must each
//! generated token and its log-probabilities (the chosen token's and the 20 most likely ones',
//! which depend on the whole row of logits through its log-sum-exp).
//!
//! The paths a row can take differ by batch: the one-row decode kernels, products of up to 32
//! rows (the int16 dot kernels, in register tiles of 1–8 rows), larger ones (int16 panels,
//! float32 GEMM), attention in one piece or split across threads. Run on a float32 fixture and
//! on the real GGUF models (SmolLM2's Q4_1 and Q8_0 blocks, Gemma 3's Q5_0, Q8_0, Q4_K and
//! Q6_K), which take every one of them.
//!
//! Needs the models: run `scripts/fetch-model.sh` (the GGUF tests fail, not skip, without it).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use baton_engine::{Engine, EngineConfig, GenerationRequest, RequestId, StopParams};
use baton_model::{Checkpoint, Model, TokenLogprobs};

/// A small deterministic generator, so the workload is the same on every run.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

/// What one run of the target gave: its tokens, their log-probabilities and its prompt logits,
/// floats as bits (so that equality is bit equality, NaN included).
#[derive(Debug, PartialEq, Eq)]
struct Outcome {
    tokens: Vec<u32>,
    logprobs: Vec<(u32, Vec<(u32, u32)>)>,
    prompt_logits: Vec<u32>,
}

impl Outcome {
    /// The first difference from `alone`, in words.
    fn first_difference(&self, alone: &Outcome, vocab: usize) -> Option<String> {
        if let Some(i) = self.prompt_logits.iter().zip(&alone.prompt_logits).position(|(a, b)| a != b) {
            let (got, want) = (f32::from_bits(self.prompt_logits[i]), f32::from_bits(alone.prompt_logits[i]));
            return Some(format!("prompt position {} logit {}: {got} vs {want} alone", i / vocab, i % vocab));
        }
        if let Some(i) = self.logprobs.iter().zip(&alone.logprobs).position(|(a, b)| a != b) {
            let lp = |o: &Outcome| f32::from_bits(o.logprobs[i].0);
            return Some(format!(
                "generated token {i} ({} vs {} alone): log-probability {} vs {}",
                self.tokens[i],
                alone.tokens[i],
                lp(self),
                lp(alone)
            ));
        }
        (self != alone).then(|| format!("tokens {:?} vs {:?} alone", self.tokens, alone.tokens))
    }
}

fn bits(l: &TokenLogprobs) -> (u32, Vec<(u32, u32)>) {
    (l.logprob.to_bits(), l.top.iter().map(|&(t, p)| (t, p.to_bits())).collect())
}

const TARGET: RequestId = RequestId(1_000);

fn target(prompt: &[u32], max_tokens: usize) -> GenerationRequest {
    GenerationRequest {
        stop: StopParams { max_tokens, ignore_eos: true, stop_strings: vec![] },
        return_prompt_logits: true,
        logprobs: Some(20),
        ..GenerationRequest::new(TARGET, prompt.to_vec())
    }
}

/// Runs `requests` (the target among them, added after `delay` steps; the others at once) to
/// completion and returns the target's outcome.
fn run(
    model: &Arc<Model>,
    config: EngineConfig,
    target: GenerationRequest,
    others: Vec<GenerationRequest>,
    delay: usize,
) -> Outcome {
    let mut e = Engine::new(model.clone(), None, config).expect("engine");
    for r in others {
        e.add_request(r).expect("valid");
    }
    let mut target = Some(target);
    let (mut tokens, mut logprobs, mut prompt_logits) = (Vec::new(), Vec::new(), None);
    let mut steps = 0;
    while target.is_some() || e.has_work() {
        if steps == delay
            && let Some(t) = target.take()
        {
            e.add_request(t).expect("valid");
        }
        let out = e.step().expect("step");
        for t in out.tokens.iter().filter(|t| t.id == TARGET) {
            tokens.push(t.token);
            logprobs.push(bits(t.logprobs.as_ref().expect("asked for")));
        }
        for f in out.finished.into_iter().filter(|f| f.id == TARGET) {
            assert_eq!(f.token_ids, tokens);
            prompt_logits = f.prompt_logits;
        }
        steps += 1;
        assert!(steps < 100_000, "no progress");
    }
    let prompt_logits = prompt_logits.expect("asked for").iter().map(|l| l.to_bits()).collect();
    Outcome { tokens, logprobs, prompt_logits }
}

/// The target alone, then in each batch; panics at the first batch whose outcome differs.
fn check(model: Arc<Model>, target_len: usize, max_tokens: usize, longest_other: u64) {
    let vocab = model.config().vocab_size as u64;
    let mut rng = Lcg(63);
    let mut prompt = |len: usize| (0..len).map(|_| 3 + rng.next(vocab.min(20_000) - 3) as u32).collect::<Vec<u32>>();
    let target_prompt = prompt(target_len);
    let solo =
        EngineConfig { prefix_caching: false, prefill_chunk: 4096, max_batch_tokens: 4096, ..EngineConfig::default() };
    let alone = run(&model, solo, target(&target_prompt, max_tokens), Vec::new(), 0);
    assert_eq!(alone.tokens.len(), max_tokens);
    assert_eq!(alone.prompt_logits.len(), target_len * vocab as usize);

    // (batch size, prefill chunk, step token budget, steps before the target arrives).
    let batches =
        [(2, 5, 64, 0), (3, 4096, 4096, 1), (5, 16, 48, 2), (8, 7, 40, 0), (16, 33, 256, 3), (32, 64, 512, 1)];
    let mut lengths = Lcg(7);
    for (batch, chunk, budget, delay) in batches {
        let others: Vec<GenerationRequest> = (0..batch - 1)
            .map(|i| {
                let len = 1 + lengths.next(longest_other) as usize;
                GenerationRequest {
                    stop: StopParams {
                        max_tokens: 1 + lengths.next(2 * max_tokens as u64) as usize,
                        ignore_eos: true,
                        stop_strings: vec![],
                    },
                    ..GenerationRequest::new(RequestId(i as u64), prompt(len))
                }
            })
            .collect();
        let config = EngineConfig {
            prefix_caching: false,
            max_num_seqs: batch,
            prefill_chunk: chunk,
            max_batch_tokens: budget,
            ..EngineConfig::default()
        };
        let got = run(&model, config, target(&target_prompt, max_tokens), others, delay);
        if let Some(diff) = got.first_difference(&alone, vocab as usize) {
            panic!("batch of {batch}, prefill chunk {chunk}, budget {budget}: {diff}");
        }
    }
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn known(name: &str) -> Arc<Model> {
    let path = baton_model::known_model_path(&repo_root(), name).expect("a known model");
    assert!(path.is_file(), "{} is missing: run `scripts/fetch-model.sh {name}` first", path.display());
    Arc::new(Checkpoint::open(&path).expect("the GGUF loads").model)
}

#[test]
fn a_float32_model_is_batch_invariant() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-llama");
    check(Arc::new(Checkpoint::open(&dir).expect("fixture loads").model), 140, 16, 160);
}

#[test]
fn smollm2_is_batch_invariant() {
    check(known("smollm2-135m-instruct"), 140, 12, 96);
}

#[test]
fn gemma3_is_batch_invariant() {
    check(known("gemma3-270m"), 140, 8, 96);
}
