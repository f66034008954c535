//! `baton profile`: time the real CPU backend and write the fitted cost profile that
//! `baton sim --profile FILE` and emulated workers load.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use baton_engine::profile::{ProfileConfig, fit, measure};
use baton_model::Checkpoint;

/// Arguments of `baton profile`.
#[derive(Debug, clap::Args)]
pub(crate) struct ProfileArgs {
    /// A checkpoint directory (Hugging Face layout) or a `.gguf` file.
    #[arg(long)]
    model: PathBuf,
    /// Where to write the profile (JSON: the cost profile's fields, the fit error, the samples).
    #[arg(long, default_value = "profile.json")]
    out: PathBuf,
    /// Prompt lengths of the prefill samples.
    #[arg(long, value_delimiter = ',', default_values_t = ProfileConfig::default().prompt_lens)]
    prompt_lens: Vec<usize>,
    /// Cached fractions of each prompt.
    #[arg(long, value_delimiter = ',', default_values_t = ProfileConfig::default().cached_ratios)]
    cached_ratios: Vec<f64>,
    /// Batch sizes of the decode samples.
    #[arg(long, value_delimiter = ',', default_values_t = ProfileConfig::default().batch_sizes)]
    batches: Vec<usize>,
    /// Context per sequence of the decode samples.
    #[arg(long, value_delimiter = ',', default_values_t = ProfileConfig::default().contexts)]
    contexts: Vec<usize>,
    /// Repetitions per point (the median is kept).
    #[arg(long, default_value_t = ProfileConfig::default().repeats)]
    repeats: usize,
}

pub(crate) fn run(a: ProfileArgs) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let ckpt = Checkpoint::open(&a.model).with_context(|| format!("loading {}", a.model.display()))?;
    let cfg = ProfileConfig {
        prompt_lens: a.prompt_lens,
        cached_ratios: a.cached_ratios,
        batch_sizes: a.batches,
        contexts: a.contexts,
        repeats: a.repeats,
        ..ProfileConfig::default()
    };
    let model = Arc::new(ckpt.model);
    let kv_bytes_per_token = model.kv_geometry(cfg.block_size).bytes_per_token() as u64;
    let points = cfg.prompt_lens.len() * cfg.cached_ratios.len() + cfg.batch_sizes.len() * cfg.contexts.len();
    eprintln!("profiling {} at {points} points, {} repeats each", a.model.display(), cfg.repeats);
    let mut done = 0;
    let samples = measure(model, &cfg, &mut |line| {
        done += 1;
        eprintln!("[{done:>3}/{points}] {line}");
    })?;
    let name = a.model.file_stem().map_or_else(|| "model".to_owned(), |s| s.to_string_lossy().into_owned());
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let file = fit(&format!("{name}/cpu"), kv_bytes_per_token, samples, threads)?;
    std::fs::write(&a.out, serde_json::to_string_pretty(&file)?)
        .with_context(|| format!("writing {}", a.out.display()))?;
    let (p, d) = (&file.profile.prefill, &file.profile.decode);
    eprintln!(
        "prefill_time(x, y) = {:.1} + {:.3}·n + {:.6}·(x² − c²) µs; decode_step(b, C) = {:.1} + {:.3}·b + {:.5}·C µs",
        p.fixed_us, p.per_token_us, p.attention_us, d.fixed_us, d.per_seq_us, d.per_context_token_us
    );
    eprintln!(
        "mean relative error of the fit {:.1}%; wrote {} in {:.1} s (use it with: baton sim --profile {})",
        file.fit_error * 100.0,
        a.out.display(),
        t0.elapsed().as_secs_f64(),
        a.out.display()
    );
    Ok(())
}
