//! `baton check-device`: the device's engine against the CPU's (see
//! `baton_engine::device_check`).

use std::path::PathBuf;
use std::sync::Arc;

use baton_engine::device_check;
use baton_model::{ComputeDevice, ComputeDtype, DeviceOptions};

/// Arguments of `baton check-device`.
#[derive(Debug, clap::Args)]
pub(crate) struct CheckDeviceArgs {
    /// A checkpoint directory or GGUF file, or `gemma3-random` (a random model of Gemma 3's
    /// shape, the same weights on both sides).
    #[arg(long, required_unless_present = "kernels")]
    model: Option<String>,
    /// Instead of a model: check the device's fast kernels (the tensor-core prefill attention)
    /// against its plain ones on random data, and exit non-zero if one is off.
    #[arg(long)]
    kernels: bool,
    /// The device under test.
    #[arg(long, default_value = "cuda", value_name = "cpu|cuda[:N]")]
    device: ComputeDevice,
    /// Its compute type.
    #[arg(long, default_value = "float32", value_name = "auto|bfloat16|float16|float32")]
    dtype: ComputeDtype,
    /// The prompts: a JSON file of token id lists. Default: the checkpoint's `reference.json`
    /// cases (their `input_ids`), or a few fixed prompts for `gemma3-random`.
    #[arg(long)]
    ids: Option<PathBuf>,
    /// Drop each prompt's first token (the fixtures' greedy references were made without BOS).
    #[arg(long)]
    skip_bos: bool,
    /// Greedy tokens per prompt.
    #[arg(long, default_value_t = 24)]
    max_tokens: usize,
    /// Print the whole report (with the device's logits) as JSON.
    #[arg(long)]
    json: bool,
}

pub(crate) fn run(a: CheckDeviceArgs) -> anyhow::Result<()> {
    if a.kernels {
        return check_kernels(a.device, a.json);
    }
    let model = a.model.clone().ok_or_else(|| anyhow::anyhow!("--model is required"))?;
    let mut prompts: Vec<Vec<u32>> = match &a.ids {
        Some(f) => serde_json::from_str(&std::fs::read_to_string(f)?)?,
        None if model == "gemma3-random" => {
            vec![
                vec![2, 17, 99, 4],
                (0..40).map(|i| (i * 7 + 3) % 512).collect(),
                (0..100).map(|i| (i * 13 + 5) % 512).collect(),
            ]
        }
        None => {
            let r: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(PathBuf::from(&model).join("reference.json"))?)?;
            let cases = r["cases"].as_array().ok_or_else(|| anyhow::anyhow!("reference.json has no cases"))?;
            cases.iter().map(|c| serde_json::from_value(c["input_ids"].clone())).collect::<Result<_, _>>()?
        }
    };
    if a.skip_bos {
        prompts.iter_mut().for_each(|p| {
            p.remove(0);
        });
    }
    let device = DeviceOptions { device: a.device, dtype: a.dtype, ..DeviceOptions::default() };
    let reference = Arc::new(device_check::load(&model, DeviceOptions::default())?);
    let under_test = Arc::new(device_check::load(&model, device)?);
    let kv = crate::engine_flags::default_kv_dtype(device);
    let results = device_check::compare(reference, under_test, kv, &prompts, a.max_tokens)?;
    let equal = results.iter().filter(|r| r.equal_prefix == a.max_tokens).count();
    if a.json {
        println!("{}", serde_json::to_string(&results)?);
    } else {
        for (i, r) in results.iter().enumerate() {
            println!(
                "prompt {i} ({} tokens): {}/{} greedy tokens equal, max |logit diff| {:.2e} (top-2 margin {:.3})",
                r.prompt.len(),
                r.equal_prefix,
                a.max_tokens,
                r.max_abs_logit_diff,
                r.reference_top2_margin
            );
        }
    }
    eprintln!(
        "{}: {equal}/{} prompts with every greedy token equal to the CPU engine's ({} on {}, KV {kv:?})",
        model,
        results.len(),
        a.dtype,
        a.device
    );
    Ok(())
}

fn check_kernels(device: ComputeDevice, json: bool) -> anyhow::Result<()> {
    let checks = device.check_kernels()?;
    if json {
        println!("{}", serde_json::to_string(&checks)?);
    }
    for c in &checks {
        eprintln!(
            "{} {}: max |diff| {:.2e} (tolerance {:.0e}; values up to {:.2})",
            if c.passed() { "ok  " } else { "FAIL" },
            c.name,
            c.max_abs_diff,
            c.tolerance,
            c.max_abs
        );
    }
    let failed = checks.iter().filter(|c| !c.passed()).count();
    anyhow::ensure!(failed == 0, "{failed} of {} kernel checks off", checks.len());
    Ok(())
}
