//! `baton check-device`: the same requests through two engines, one on the CPU and one on a
//! device, greedy, and what differs. The GPU backend's correctness check (`scripts/gpu-check.sh`):
//! in float32 its tokens must equal the CPU engine's; in bfloat16 its logits are compared with
//! transformers' by the script.
//!
//! The models: a checkpoint (the fixtures, with their reference prompts), or a random model of
//! Gemma 3's shape (sliding and global layers, q/k norms, post norms, GELU, an embedding scale
//! and a soft-capped head), the same weights on both sides.

use std::path::Path;
use std::sync::Arc;

use baton_kv::{KvDtype, KvLayout};
use baton_model::config::{Activation, Architecture, LayerAttention, ModelConfig, RopeConfig, RopeScaling};
use baton_model::{Checkpoint, DeviceOptions, Model, RandomWeights};
use serde::Serialize;

use crate::{Engine, EngineConfig, EngineError, GenerationRequest, RequestId, StopParams};

/// One prompt's outcome on both engines.
#[derive(Debug, Clone, Serialize)]
pub struct CaseResult {
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// Greedy tokens of the reference engine (the CPU).
    pub reference_tokens: Vec<u32>,
    /// Greedy tokens of the engine under test.
    pub device_tokens: Vec<u32>,
    /// Tokens equal up to the first difference.
    pub equal_prefix: usize,
    /// The device's logits after the whole prompt (for a comparison with another reference).
    pub device_last_logits: Vec<f32>,
    /// Largest difference of those logits from the reference engine's.
    pub max_abs_logit_diff: f32,
    /// The reference logits' top-1 minus top-2 after the prompt.
    pub reference_top2_margin: f32,
}

/// A prompt's greedy tokens and its logits after the prompt.
type Outcome = (Vec<u32>, Vec<f32>);

/// A Gemma 3–shaped configuration for random weights: small, with every Gemma 3 option on.
pub fn gemma3_shaped() -> ModelConfig {
    let rope = RopeConfig { theta: 10_000.0, scaling: RopeScaling::None };
    let global = RopeConfig { theta: 1_000_000.0, scaling: RopeScaling::None };
    let layers = 6;
    let layer_attention = (0..layers)
        .map(|l| {
            if l % 3 == 2 {
                LayerAttention { window: None, rope: global }
            } else {
                LayerAttention { window: Some(8), rope }
            }
        })
        .collect();
    ModelConfig {
        architecture: Architecture::Gemma3,
        vocab_size: 512,
        hidden_size: 128,
        intermediate_size: 384,
        num_heads: 4,
        num_kv_heads: 1,
        head_dim: 64,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: true,
        bos_token_id: Some(2),
        eos_token_ids: vec![1],
        activation: Activation::GeluTanh,
        norm_weight_offset: 1.0,
        qk_norm: true,
        post_norms: true,
        embedding_scale: Some(128f32.sqrt()),
        query_pre_attn_scalar: Some(64.0),
        final_logit_softcapping: Some(30.0),
        layer_attention,
        max_position_embeddings: 2048,
        ..ModelConfig::plain_decoder(layers, rope)
    }
}

/// Loads a model for the check: `gemma3-random` (see [`gemma3_shaped`]) or a checkpoint path.
pub fn load(model: &str, device: DeviceOptions) -> Result<Model, EngineError> {
    if model == "gemma3-random" {
        Ok(Model::load_on(&gemma3_shaped(), &RandomWeights { seed: 3, std: 0.1 }, device)?)
    } else {
        Ok(Checkpoint::open_on(Path::new(model), device)?.model)
    }
}

/// Runs each prompt alone, then all together in one batch, on both models, greedy for
/// `max_tokens`, and compares. `kv_dtype` is the device engine's (the CPU's is float32).
pub fn compare(
    reference: Arc<Model>,
    device: Arc<Model>,
    kv_dtype: KvDtype,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> Result<Vec<CaseResult>, EngineError> {
    let run = |model: &Arc<Model>, kv_dtype: KvDtype| -> Result<Vec<Outcome>, EngineError> {
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0) + max_tokens + 2;
        let config = EngineConfig {
            block_size: 16,
            num_blocks: prompts.len() * longest.div_ceil(16) + 16,
            layout: KvLayout::BlockMajor,
            max_batch_tokens: 512,
            prefill_chunk: 64,
            kv_dtype,
            ..EngineConfig::default()
        };
        let mut engine = Engine::new(model.clone(), None, config)?;
        for (i, p) in prompts.iter().enumerate() {
            engine.add_request(GenerationRequest {
                stop: StopParams { max_tokens, ignore_eos: true, stop_strings: vec![] },
                return_prompt_logits: true,
                ..GenerationRequest::new(RequestId(i as u64), p.clone())
            })?;
        }
        let mut done = engine.run_to_completion()?;
        done.sort_by_key(|f| f.id.0);
        let vocab = model.config().vocab_size;
        Ok(done
            .into_iter()
            .map(|f| {
                let logits = f.prompt_logits.unwrap_or_default();
                let last = logits.len().saturating_sub(vocab);
                (f.token_ids, logits[last..].to_vec())
            })
            .collect())
    };
    let cpu = run(&reference, KvDtype::F32)?;
    let dev = run(&device, kv_dtype)?;
    Ok(prompts
        .iter()
        .zip(cpu.into_iter().zip(dev))
        .map(|(p, ((ct, cl), (dt, dl)))| {
            let equal_prefix = ct.iter().zip(&dt).take_while(|(a, b)| a == b).count();
            let max_abs_logit_diff = cl.iter().zip(&dl).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            let mut sorted = cl.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            let reference_top2_margin = if sorted.len() > 1 { sorted[0] - sorted[1] } else { f32::INFINITY };
            CaseResult {
                prompt: p.clone(),
                reference_tokens: ct,
                device_tokens: dt,
                equal_prefix,
                device_last_logits: dl,
                max_abs_logit_diff,
                reference_top2_margin,
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The harness itself, CPU against CPU: every token equal, logits identical. (On a GPU the
    /// same function compares the CUDA engine, `scripts/gpu-check.sh`.)
    #[test]
    fn the_cpu_engine_matches_itself_on_the_gemma3_shape() {
        let a = Arc::new(load("gemma3-random", DeviceOptions::default()).expect("loads"));
        let b = Arc::new(load("gemma3-random", DeviceOptions::default()).expect("loads"));
        let prompts = vec![vec![2, 17, 99, 4], (0..40).map(|i| (i * 7 + 3) % 512).collect()];
        let r = compare(a, b, KvDtype::F32, &prompts, 6).expect("runs");
        for c in &r {
            assert_eq!(c.equal_prefix, 6, "{c:?}");
            assert_eq!(c.max_abs_logit_diff, 0.0);
            assert_eq!(c.device_last_logits.len(), 512);
        }
    }
}
