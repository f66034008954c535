//! Checkpoint formats: float16 and bfloat16 safetensors, sharded checkpoints with an index, and
//! clear errors for malformed files. Each variant is written from the tiny-llama fixture into a
//! temporary directory and run through the engine.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use baton_engine::{Engine, EngineConfig, GenerationRequest, RequestId, StopParams};
use baton_model::Checkpoint;
use safetensors::{Dtype, SafeTensors, tensor::TensorView};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-llama")
}

/// A fresh directory with the fixture's config and tokenizer files.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("baton-formats-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    for f in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    {
        std::fs::copy(fixture().join(f), dir.join(f)).expect("copies");
    }
    dir
}

/// The fixture's tensors as (name, shape, f32 values), in name order.
fn tensors() -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(fixture().join("model.safetensors")).expect("weights");
    let st = SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut out: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(name, v)| {
            let values = v.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            (name, v.shape().to_vec(), values)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn write(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)], dtype: Dtype) {
    let encoded: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, s, v)| {
            let bytes = match dtype {
                Dtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                Dtype::F16 => v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect(),
                Dtype::BF16 => v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect(),
                other => panic!("{other:?}"),
            };
            (n.clone(), s.clone(), bytes)
        })
        .collect();
    let views: BTreeMap<String, TensorView<'_>> =
        encoded.iter().map(|(n, s, b)| (n.clone(), TensorView::new(dtype, s.clone(), b).expect("view"))).collect();
    safetensors::serialize_to_file(views, None, path).expect("writes");
}

fn set_dtype(dir: &Path, dtype: &str) {
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("reads")).expect("json");
    config["dtype"] = serde_json::json!(dtype);
    std::fs::write(&path, config.to_string()).expect("writes");
}

/// Prompt logits and 8 greedy tokens of a fixed prompt.
fn run(dir: &Path) -> (Vec<f32>, Vec<u32>) {
    let ckpt = Checkpoint::open(dir).expect("loads");
    let prompt = ckpt.tokenizer.encode("Disaggregated inference separates prefill and decode.", true).expect("encodes");
    let mut e = Engine::new(Arc::new(ckpt.model), None, EngineConfig::default()).expect("engine");
    e.add_request(GenerationRequest {
        stop: StopParams { max_tokens: 8, ignore_eos: true, stop_strings: vec![] },
        return_prompt_logits: true,
        ..GenerationRequest::new(RequestId(0), prompt)
    })
    .expect("valid");
    let done = e.run_to_completion().expect("runs").remove(0);
    (done.prompt_logits.expect("logits"), done.token_ids)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn half_precision_and_sharded_checkpoints_load() {
    let (want, _) = run(&fixture());
    let all = tensors();

    // float16 and bfloat16 weights are widened to float32; only their rounding shows.
    for (dtype, name, tolerance) in [(Dtype::F16, "float16", 0.01), (Dtype::BF16, "bfloat16", 0.1)] {
        let dir = scratch(name);
        write(&dir.join("model.safetensors"), &all, dtype);
        set_dtype(&dir, name);
        let (got, _) = run(&dir);
        let d = max_diff(&got, &want);
        assert!(d > 0.0 && d < tolerance, "{name}: max |logit diff| {d} (expected rounding only, below {tolerance})");
        std::fs::remove_dir_all(dir).ok();
    }

    // Sharded: the same float32 tensors across two files and an index give the same logits.
    let dir = scratch("sharded");
    let (a, b) = all.split_at(all.len() / 2);
    write(&dir.join("model-00001-of-00002.safetensors"), a, Dtype::F32);
    write(&dir.join("model-00002-of-00002.safetensors"), b, Dtype::F32);
    let map: serde_json::Map<String, serde_json::Value> = a
        .iter()
        .map(|t| (t.0.clone(), "model-00001-of-00002.safetensors".into()))
        .chain(b.iter().map(|t| (t.0.clone(), "model-00002-of-00002.safetensors".into())))
        .collect();
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).expect("writes");
    let (got, tokens) = run(&dir);
    assert_eq!(got, want, "sharded float32 weights give identical logits");
    assert_eq!(tokens, run(&fixture()).1);
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn malformed_checkpoints_are_clear_errors() {
    let all = tensors();
    let error = |dir: &Path| Checkpoint::open(dir).expect_err("must fail").to_string();

    let dir = scratch("truncated");
    write(&dir.join("model.safetensors"), &all, Dtype::F32);
    let bytes = std::fs::read(dir.join("model.safetensors")).expect("reads");
    std::fs::write(dir.join("model.safetensors"), &bytes[..bytes.len() / 2]).expect("writes");
    let e = error(&dir);
    assert!(e.contains("model.safetensors"), "names the file: {e}");

    let without: Vec<_> = all.iter().filter(|t| t.0 != "model.norm.weight").cloned().collect();
    write(&dir.join("model.safetensors"), &without, Dtype::F32);
    let e = error(&dir);
    assert!(e.contains("model.norm.weight"), "names the tensor: {e}");

    write(&dir.join("model.safetensors"), &all, Dtype::F32);
    std::fs::write(dir.join("config.json"), r#"{"architectures": ["LlamaForCausalLM"], "vocab_size": 512}"#)
        .expect("writes");
    let e = error(&dir);
    assert!(e.contains("config.json") && e.contains("hidden_size"), "names the file and field: {e}");

    std::fs::write(dir.join("config.json"), "{ not json").expect("writes");
    let e = error(&dir);
    assert!(e.contains("config.json") && e.contains("JSON"), "{e}");

    std::fs::remove_file(dir.join("model.safetensors")).expect("removes");
    std::fs::copy(fixture().join("config.json"), dir.join("config.json")).expect("copies");
    let e = error(&dir);
    assert!(e.contains("model.safetensors"), "names the missing file: {e}");
    std::fs::remove_dir_all(dir).ok();
}
