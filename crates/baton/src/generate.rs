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
    /// tokenizer.json) or a `.gguf` file. Default: Gemma 3 270M from `$BATON_MODELS_DIR` or
    /// `.models` (fetch it with `scripts/fetch-model.sh`).
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

/// The model to load: `arg` when given, else the default model where
/// [`baton_model::default_model_path`] puts it (under the working directory, then under the
/// source tree this binary was built from). The error is one line saying how to fetch it.
pub(crate) fn model_path(arg: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(path) = arg {
        return Ok(path.to_owned());
    }
    let here = baton_model::default_model_path(Path::new("."));
    let built_from = baton_model::default_model_path(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."));
    match [&here, &built_from].into_iter().find(|p| p.is_file()) {
        Some(p) => Ok(p.clone()),
        None => anyhow::bail!(
            "no model given and the default model ({}) is missing: run `scripts/fetch-model.sh`, or pass --model",
            here.display()
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
    let ckpt = Checkpoint::open(&path).with_context(|| format!("loading {}", path.display()))?;
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
