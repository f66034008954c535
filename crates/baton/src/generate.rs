//! `baton generate`: one prompt through a local engine.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use baton_engine::{Engine, EngineConfig, GenerationRequest, RequestId, StopParams};
use baton_kv::KvLayout;
use baton_model::{ChatMessage, Checkpoint, SamplingParams};
use serde::Serialize;

/// Arguments of `baton generate`.
#[derive(Debug, clap::Args)]
pub(crate) struct GenerateArgs {
    /// A checkpoint directory (Hugging Face layout: config.json, model.safetensors,
    /// tokenizer.json), a `.gguf` file, or a short name of `scripts/fetch-model.sh`
    /// (`smollm2-135m-instruct`, the default, or `gemma3-270m`) looked up in `$BATON_MODELS_DIR`
    /// or `.models`.
    #[arg(long)]
    model: Option<PathBuf>,
    /// The prompt text.
    #[arg(long)]
    prompt: String,
    /// Render the prompt as one user message through the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep only the k most likely tokens (0 keeps all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Nucleus sampling threshold (1 keeps all).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Seed of the sampler.
    #[arg(long)]
    seed: Option<u64>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Stop at this text (repeatable); the text is cut before it.
    #[arg(long)]
    stop: Vec<String>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV layout: block-major or layer-major.
    #[arg(long, default_value = "block-major")]
    layout: KvLayout,
    /// Where the model computes, in what type, and the KV cache's type (as `baton serve`).
    #[command(flatten)]
    device: crate::engine_flags::DeviceFlags,
    /// Print one JSON object instead of the text.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct GenerateReport {
    text: String,
    prompt_token_ids: Vec<u32>,
    token_ids: Vec<u32>,
    finish_reason: &'static str,
    prefill_tokens_per_s: f64,
    decode_tokens_per_s: f64,
    time_to_first_token_s: f64,
    total_s: f64,
}

/// The model to load. `arg` is a path (a GGUF file or a checkpoint directory) or a short name
/// of `scripts/fetch-model.sh` (`smollm2-135m-instruct`, `gemma3-270m`, ...); without it, the
/// default model. Names are looked up in [`baton_model::models_dir`] under the working
/// directory, then under the source tree this binary was built from. The error is one line
/// saying what to do.
pub(crate) fn model_path(arg: Option<&Path>) -> anyhow::Result<PathBuf> {
    let dirs = [
        baton_model::models_dir(Path::new(".")),
        baton_model::models_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")),
    ];
    resolve_model(arg, &dirs)
}

/// [`model_path`] over the given models directories.
fn resolve_model(arg: Option<&Path>, models_dirs: &[PathBuf]) -> anyhow::Result<PathBuf> {
    let known = match arg {
        Some(path) if path.exists() => return Ok(path.to_owned()),
        Some(path) => match path.to_str().and_then(baton_model::known_model) {
            Some(m) => m,
            None => anyhow::bail!(
                "--model {}: no such file or directory, and not a known model name (known: {}; fetch one with \
                 `scripts/fetch-model.sh NAME`, or pass a GGUF file or a Hugging Face checkpoint directory)",
                path.display(),
                baton_model::known_model_names()
            ),
        },
        None => &baton_model::KNOWN_MODELS[0],
    };
    let candidates: Vec<PathBuf> = models_dirs.iter().map(|d| d.join(known.file)).collect();
    match candidates.iter().find(|p| p.is_file()) {
        Some(p) => Ok(p.clone()),
        None => anyhow::bail!(
            "{} model `{}` ({}) is missing: run `scripts/fetch-model.sh {}`, or pass --model with another name ({}) \
             or a path",
            if arg.is_some() { "the" } else { "no --model given and the default" },
            known.name,
            candidates.first().map_or_else(|| known.file.into(), |p| p.display().to_string()),
            known.name,
            baton_model::known_model_names()
        ),
    }
}

pub(crate) fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let path = match model_path(args.model.as_deref()) {
        Ok(p) => p,
        Err(e) => {
            // One line, no backtrace: this is the user's next step, not a bug.
            eprintln!("baton: {e}");
            std::process::exit(2);
        }
    };
    let ckpt =
        Checkpoint::open_on(&path, args.device.options()).with_context(|| format!("loading {}", path.display()))?;
    let prompt = if args.chat {
        ckpt.encode_chat(&[ChatMessage::new("user", args.prompt.clone())])?.1
    } else {
        ckpt.tokenizer.encode(&args.prompt, true)?
    };
    let blocks = (prompt.len() + args.max_tokens).div_ceil(args.block_size) + 1;
    let config = EngineConfig {
        block_size: args.block_size,
        num_blocks: blocks,
        layout: args.layout,
        kv_dtype: args.device.kv_dtype(),
        ..EngineConfig::default()
    };
    let tokenizer = Arc::new(ckpt.tokenizer);
    let mut engine = Engine::new(Arc::new(ckpt.model), Some(tokenizer), config)?;
    engine.add_request(GenerationRequest {
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            seed: args.seed,
            ..SamplingParams::default()
        },
        stop: StopParams { max_tokens: args.max_tokens, ignore_eos: args.ignore_eos, stop_strings: args.stop },
        ..GenerationRequest::new(RequestId(0), prompt.clone())
    })?;

    let start = Instant::now();
    let mut first_token_at = None;
    let mut stdout = std::io::stdout().lock();
    let finished = loop {
        let out = engine.step()?;
        if first_token_at.is_none() && !out.tokens.is_empty() {
            first_token_at = Some(start.elapsed().as_secs_f64());
        }
        if !args.json {
            for t in &out.tokens {
                write!(stdout, "{}", t.text_delta)?;
                stdout.flush()?;
            }
        }
        if let Some(done) = out.finished.into_iter().next() {
            break done;
        }
    };
    let total = start.elapsed().as_secs_f64();
    let ttft = first_token_at.unwrap_or(total);
    let decoded = finished.token_ids.len().saturating_sub(1);
    let report = GenerateReport {
        prefill_tokens_per_s: prompt.len() as f64 / ttft,
        decode_tokens_per_s: if decoded > 0 { decoded as f64 / (total - ttft) } else { 0.0 },
        time_to_first_token_s: ttft,
        total_s: total,
        text: finished.text,
        prompt_token_ids: prompt,
        token_ids: finished.token_ids,
        finish_reason: finished.reason.as_openai(),
    };
    if args.json {
        writeln!(stdout, "{}", serde_json::to_string(&report)?)?;
    } else {
        writeln!(stdout)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("baton-resolve-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }

    #[test]
    fn model_names_resolve_in_the_models_dirs_and_paths_pass_through() {
        let (a, b) = (temp_dir("a"), temp_dir("b"));
        std::fs::write(b.join("gemma-3-270m-q4_k_m.gguf"), b"x").expect("write");
        std::fs::write(a.join(baton_model::DEFAULT_MODEL_FILE), b"x").expect("write");
        let dirs = [a.clone(), b.clone()];
        let got = |arg: Option<&str>| resolve_model(arg.map(Path::new), &dirs).map_err(|e| e.to_string());
        assert_eq!(got(Some("gemma3-270m")), Ok(b.join("gemma-3-270m-q4_k_m.gguf")));
        assert_eq!(got(None), Ok(a.join(baton_model::DEFAULT_MODEL_FILE)));
        assert_eq!(got(Some("smollm2-135m-instruct")), Ok(a.join(baton_model::DEFAULT_MODEL_FILE)));
        let path = b.join("gemma-3-270m-q4_k_m.gguf");
        assert_eq!(got(path.to_str()), Ok(path.clone()));
        let _ = std::fs::remove_dir_all(&a);
        let _ = std::fs::remove_dir_all(&b);
    }

    #[test]
    fn unknown_names_and_missing_models_say_what_to_do() {
        let empty = temp_dir("empty");
        let dirs = [empty.clone()];
        let err = |arg: Option<&str>| resolve_model(arg.map(Path::new), &dirs).expect_err("fails").to_string();
        let unknown = err(Some("gpt-9"));
        for needle in ["gpt-9", "smollm2-135m-instruct", "gemma3-270m", "scripts/fetch-model.sh"] {
            assert!(unknown.contains(needle), "{unknown}");
        }
        let missing = err(Some("gemma3-270m"));
        assert!(missing.contains("scripts/fetch-model.sh gemma3-270m"), "{missing}");
        let default = err(None);
        assert!(
            default.contains("default") && default.contains("scripts/fetch-model.sh smollm2-135m-instruct"),
            "{default}"
        );
        let _ = std::fs::remove_dir_all(&empty);
    }
}
