//! `baton profile`: time the real engine and fit the cost model the simulator and the emulated
//! backend use.
//!
//! [`measure`] runs engine steps on a loaded model — prefills of several prompt lengths with
//! several cached fractions (the cached part comes from the engine's own prefix cache, so the
//! step is exactly what serving a partly cached prompt costs), and decode steps of several batch
//! sizes and contexts — and returns the samples; [`fit`] turns them into a
//! [`CostProfile`] with [`baton_sched::fit_prefill`] and
//! [`baton_sched::fit_decode`]. [`ProfileFile`] is what the command writes: the profile's fields
//! (so [`CostProfile::from_json`] reads the file as it is) plus the samples and the fit's error.
//! [`load_profile`] reads a profile by name or file for `baton sim --profile` and emulated workers.

use std::sync::Arc;
use std::time::Instant;

use baton_model::Model;
use baton_sched::{CostProfile, DecodeSample, FitError, Link, PrefillSample, fit_decode, fit_error, fit_prefill};
use serde::{Deserialize, Serialize};

use crate::{Engine, EngineConfig, EngineError, GenerationRequest, RequestId, StopParams};

/// What to measure.
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileConfig {
    /// Prompt lengths of the prefill samples.
    pub prompt_lens: Vec<usize>,
    /// Cached fractions of each prompt (rounded down to whole KV blocks by the prefix cache).
    pub cached_ratios: Vec<f64>,
    /// Batch sizes of the decode samples.
    pub batch_sizes: Vec<usize>,
    /// Context per sequence of the decode samples.
    pub contexts: Vec<usize>,
    /// Repetitions of each point (the median is kept).
    pub repeats: usize,
    /// Tokens per KV block.
    pub block_size: usize,
}

impl Default for ProfileConfig {
    /// A grid that takes seconds on the tiny fixture model and a minute or so on a 270M one.
    fn default() -> Self {
        Self {
            prompt_lens: vec![32, 128, 256, 512],
            cached_ratios: vec![0.0, 0.5],
            batch_sizes: vec![1, 4, 16],
            contexts: vec![64, 384],
            repeats: 3,
            block_size: 16,
        }
    }
}

/// The measurements.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProfileSamples {
    /// Prefill steps.
    pub prefill: Vec<PrefillSample>,
    /// Decode steps.
    pub decode: Vec<DecodeSample>,
}

/// A profile file: the cost profile's own fields, then how it was obtained.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProfileFile {
    /// The fitted profile (its fields are the file's top level).
    #[serde(flatten)]
    pub profile: CostProfile,
    /// Mean relative error of the fit over its own samples.
    pub fit_error: f64,
    /// The samples it was fitted to.
    pub samples: ProfileSamples,
}

/// Why profiling failed.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// The engine failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The samples could not be fitted.
    #[error("fitting the cost model: {0}")]
    Fit(#[from] FitError),
    /// The configuration asks for nothing, or for prompts longer than the model's context.
    #[error("bad profile configuration: {0}")]
    Config(String),
    /// A profile file could not be read or parsed.
    #[error("profile {path}: {message}")]
    File {
        /// The file.
        path: String,
        /// What went wrong.
        message: String,
    },
}

/// A small deterministic generator of prompt tokens.
struct Tokens(u64);

impl Tokens {
    fn prompt(&mut self, len: usize, vocab: usize) -> Vec<u32> {
        (0..len)
            .map(|_| {
                self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                // Skip the first few ids (BOS, EOS, padding in most vocabularies).
                4 + ((self.0 >> 33) as usize % vocab.saturating_sub(4).max(1)) as u32
            })
            .collect()
    }
}

/// The median of the shared definition ([`baton_measure::percentile`]: of an even count, the
/// mean of the middle two), to the microsecond; 0 of nothing.
fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    if v.is_empty() { 0 } else { baton_measure::percentile(&v, 50.0).round() as u64 }
}

/// Times prefill and decode steps of `model` on the real engine, reporting each point to
/// `progress`.
pub fn measure(
    model: Arc<Model>,
    cfg: &ProfileConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<ProfileSamples, ProfileError> {
    let mc = model.config().clone();
    let longest_prompt = cfg.prompt_lens.iter().copied().max().unwrap_or(0);
    let longest_ctx = cfg.contexts.iter().copied().max().unwrap_or(0);
    if cfg.prompt_lens.is_empty() || cfg.batch_sizes.is_empty() || cfg.contexts.is_empty() || cfg.repeats == 0 {
        return Err(ProfileError::Config("give prompt lengths, batch sizes, contexts and repeats > 0".into()));
    }
    if longest_prompt.max(longest_ctx + cfg.repeats + 4) >= mc.max_position_embeddings {
        return Err(ProfileError::Config(format!(
            "prompts and contexts must stay below the model's context of {} tokens",
            mc.max_position_embeddings
        )));
    }
    let vocab = mc.vocab_size;
    let bs = cfg.block_size;
    let mut tokens = Tokens(0x00c0_ffee);
    let mut out = ProfileSamples::default();

    // Prefill: one step computes the whole uncached part of the prompt.
    let engine_cfg = EngineConfig {
        block_size: bs,
        num_blocks: (2 * longest_prompt).div_ceil(bs) * (cfg.repeats + 2) + 16,
        max_batch_tokens: longest_prompt.max(1),
        prefill_chunk: longest_prompt.max(1),
        max_num_seqs: 1,
        prefix_caching: true,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(model.clone(), None, engine_cfg)?;
    let mut next_id = 0u64;
    let mut run_one = |engine: &mut Engine, prompt: Vec<u32>| -> Result<(u64, usize), EngineError> {
        next_id += 1;
        let req = GenerationRequest {
            stop: StopParams { max_tokens: 1, ignore_eos: true, stop_strings: vec![] },
            ..GenerationRequest::new(RequestId(next_id), prompt)
        };
        engine.add_request(req)?;
        let t0 = Instant::now();
        let step = engine.step()?;
        let us = t0.elapsed().as_micros() as u64;
        let f = step.finished.into_iter().next().ok_or_else(|| {
            EngineError::Internal("a one-token request did not finish in one step; raise max_batch_tokens".into())
        })?;
        Ok((us, f.cached_tokens))
    };
    // Warm up (thread pool, caches).
    run_one(&mut engine, tokens.prompt(longest_prompt.clamp(2, 64), vocab))?;
    for &x in &cfg.prompt_lens {
        for &y in &cfg.cached_ratios {
            let mut times = Vec::new();
            let mut cached = 0;
            for _ in 0..cfg.repeats {
                let prompt = tokens.prompt(x.max(2), vocab);
                let c = ((x as f64 * y.clamp(0.0, 1.0)) as usize).min(x - 1);
                if c >= bs {
                    // Put the first c tokens in the prefix cache: a request whose prompt starts so.
                    let mut warm = prompt[..c].to_vec();
                    warm.push(prompt[c].wrapping_add(1) % vocab as u32);
                    run_one(&mut engine, warm)?;
                }
                let (us, hit) = run_one(&mut engine, prompt)?;
                times.push(us);
                cached = hit;
            }
            let us = median(times);
            let ratio = cached as f64 / x.max(1) as f64;
            progress(&format!("prefill {x:>5} tokens, {cached:>5} cached: {:>9.3} ms", us as f64 / 1000.0));
            out.prefill.push(PrefillSample { tokens: x as u64, cached_ratio: ratio, micros: us });
        }
    }
    drop(engine);

    // Decode: `b` sequences of `ctx` prompt tokens, timed once all of them decode.
    for &b in &cfg.batch_sizes {
        for &ctx in &cfg.contexts {
            let steps = cfg.repeats + 2;
            let engine_cfg = EngineConfig {
                block_size: bs,
                num_blocks: b * (ctx + steps + 2).div_ceil(bs) + 8,
                max_batch_tokens: b * ctx.max(1),
                prefill_chunk: ctx.max(1),
                max_num_seqs: b,
                prefix_caching: false,
                ..EngineConfig::default()
            };
            let mut engine = Engine::new(model.clone(), None, engine_cfg)?;
            for _ in 0..b {
                next_id += 1;
                engine.add_request(GenerationRequest {
                    stop: StopParams { max_tokens: steps + 2, ignore_eos: true, stop_strings: vec![] },
                    ..GenerationRequest::new(RequestId(next_id), tokens.prompt(ctx.max(2), vocab))
                })?;
            }
            // The prefill step(s), until every sequence decodes.
            let mut guard = 0;
            while engine.step()?.computed_tokens != b {
                guard += 1;
                if guard > 64 {
                    return Err(EngineError::Internal("the decode batch never formed".into()).into());
                }
            }
            let mut times = Vec::new();
            // The loop above ran the prefill and one decode step (computing position ctx); the
            // i-th timed step computes position ctx + 1 + i, so each sequence then has
            // ctx + 2 + i tokens of KV (a step's context counts the token it computes).
            for _ in 0..cfg.repeats {
                let t0 = Instant::now();
                let step = engine.step()?;
                times.push(t0.elapsed().as_micros() as u64);
                if step.computed_tokens != b {
                    return Err(
                        EngineError::Internal("a decode step did not compute one token per sequence".into()).into()
                    );
                }
            }
            let us = median(times);
            let total_context = (b * (ctx + 2 + cfg.repeats / 2)) as u64;
            progress(&format!(
                "decode batch {b:>3}, context {ctx:>5} tokens each: {:>9.3} ms per step",
                us as f64 / 1000.0
            ));
            out.decode.push(DecodeSample { batch: b as u64, total_context, micros: us });
        }
    }
    Ok(out)
}

/// Fits a profile to samples. `kv_bytes_per_token` is the model's (`2·L·H·D·4` for float32 KV);
/// links are those of one host (the CPU backend's workers share memory): assumed figures, stated
/// in the profile's `source`.
pub fn fit(
    name: &str,
    kv_bytes_per_token: u64,
    samples: ProfileSamples,
    threads: usize,
) -> Result<ProfileFile, ProfileError> {
    let prefill = fit_prefill(&samples.prefill)?;
    let decode = fit_decode(&samples.decode)?;
    let profile = CostProfile {
        name: name.to_owned(),
        source: format!(
            "baton profile: {} prefill and {} decode steps timed on this host ({threads} threads), least squares; links assumed (same-host shared memory 10 GB/s, disk 2 GB/s)",
            samples.prefill.len(),
            samples.decode.len()
        ),
        kv_bytes_per_token,
        // The emulated engine takes the model configuration's.
        layers: None,
        prefill,
        decode,
        network: Link { bytes_per_s: 10_000_000_000, latency_us: 20 },
        host_to_device: Link { bytes_per_s: 10_000_000_000, latency_us: 5 },
        disk_to_device: Link { bytes_per_s: 2_000_000_000, latency_us: 100 },
    };
    let fit_error = fit_error(&profile, &samples.prefill, &samples.decode);
    Ok(ProfileFile { profile, fit_error, samples })
}

/// A cost profile by name (`a800`, `h100`: LLaMA-2-70B on 8 GPUs, from published figures) or
/// from a file (`baton profile`'s output, or any JSON with a profile's fields).
pub fn load_profile(spec: &str) -> Result<CostProfile, ProfileError> {
    match spec {
        "a800" => Ok(CostProfile::llama2_70b_8xa800()),
        "h100" => Ok(CostProfile::llama2_70b_8xh100()),
        path => {
            let file = |message: String| ProfileError::File { path: path.to_owned(), message };
            let text = std::fs::read_to_string(path).map_err(|e| file(e.to_string()))?;
            CostProfile::from_json(&text).map_err(|e| file(e.to_string()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_profile_file_reads_back_as_a_cost_profile() {
        let truth = CostProfile::llama2_70b_8xh100();
        let mut samples = ProfileSamples::default();
        for x in [64u64, 256, 1024, 4096] {
            for y in [0.0, 0.5] {
                samples.prefill.push(PrefillSample { tokens: x, cached_ratio: y, micros: truth.prefill_time(x, y) });
            }
        }
        for b in [1u64, 8, 32] {
            for c in [500u64, 5000] {
                samples.decode.push(DecodeSample {
                    batch: b,
                    total_context: b * c,
                    micros: truth.decode_step(b, b * c),
                });
            }
        }
        let f = fit("test/cpu", 1024, samples, 2).expect("fit");
        assert!(f.fit_error < 0.01, "{}", f.fit_error);
        let json = serde_json::to_string_pretty(&f).expect("json");
        let back = CostProfile::from_json(&json).expect("a profile file is a cost profile");
        assert_eq!(back, f.profile);
        let dir = std::env::temp_dir().join(format!("baton-profile-{}.json", std::process::id()));
        std::fs::write(&dir, &json).expect("write");
        assert_eq!(load_profile(dir.to_str().expect("utf-8")).expect("load"), f.profile);
        assert_eq!(load_profile("h100").expect("named"), truth);
        assert!(load_profile("/nonexistent/profile.json").is_err());
    }
}
