//! The conventions the GGUF stores Gemma 3 in, checked end to end: a plain, unbatched forward
//! pass written with candle ops straight from the tensors (no KV cache, no Baton kernels)
//! reproduces transformers' top-8 logits at the last prompt position only if the norm weights
//! are used as stored (`x * w`: the file holds Gemma's `1 + w`), q/k are rotated NeoX-style
//! (halves, no permutation), global layers use the file's RoPE base and local layers 10 000.
//!
//! A reference for the lead's paged forward pass, not a replacement for it. Needs the model
//! (`scripts/fetch-model.sh gemma3-270m`).

use std::path::PathBuf;

use baton_gguf::known::known_model_path;
use baton_gguf::{AttentionKind, GgufFile, GgufHyperparams};
use candle_core::quantized::QMatMul;
use candle_core::{D, DType, Device, Module, Tensor};

fn model_path() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let path = known_model_path(&root, "gemma3-270m").expect("a known model");
    assert!(path.is_file(), "{} is missing: run `scripts/fetch-model.sh gemma3-270m`", path.display());
    path
}

type R<T> = candle_core::Result<T>;

fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> R<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)
}

/// NeoX rotation: the first and second halves of each head are the pairs.
fn rope(x: &Tensor, theta: f64) -> R<Tensor> {
    let (t, _, d) = x.dims3()?;
    let inv: Vec<f32> = (0..d / 2).map(|i| (1.0 / theta.powf(2.0 * i as f64 / d as f64)) as f32).collect();
    let inv = Tensor::new(inv, x.device())?;
    let pos = Tensor::arange(0u32, t as u32, x.device())?.to_dtype(DType::F32)?;
    let freqs = pos.unsqueeze(1)?.broadcast_mul(&inv.unsqueeze(0)?)?; // [t, d/2]
    let (cos, sin) = (freqs.cos()?.unsqueeze(1)?, freqs.sin()?.unsqueeze(1)?);
    let (x1, x2) = (x.narrow(2, 0, d / 2)?, x.narrow(2, d / 2, d / 2)?);
    let r1 = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
    let r2 = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
    Tensor::cat(&[r1, r2], 2)
}

fn last_logits(f: &GgufFile, hp: &GgufHyperparams, ids: &[u32]) -> R<Vec<f32>> {
    let dev = Device::Cpu;
    let eps = f64::from(hp.rms_norm_eps);
    let load = |n: &str| f.tensor(n, &dev).map_err(candle_core::Error::wrap);
    let qmm = |n: &str| f.qtensor(n, &dev).map_err(candle_core::Error::wrap).and_then(QMatMul::from_qtensor);
    let t = ids.len();
    let (nh, nkv, hd) = (hp.num_heads, hp.num_kv_heads, hp.head_dim);
    let embed = f.qtensor("token_embd.weight", &dev).map_err(candle_core::Error::wrap)?;
    let ids_t = Tensor::new(ids, &dev)?;
    let mut h = (embed.embedding(&ids_t)? * f64::from(hp.embedding_scale.unwrap_or(1.0)))?;
    let mask: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { f32::NEG_INFINITY } else { 0.0 }).collect();
    let mask = Tensor::from_vec(mask, (t, t), &dev)?;
    for l in 0..hp.num_layers {
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        let x = rms_norm(&h, &load(&n("attn_norm"))?, eps)?;
        let q = qmm(&n("attn_q"))?.forward(&x)?.reshape((t, nh, hd))?;
        let k = qmm(&n("attn_k"))?.forward(&x)?.reshape((t, nkv, hd))?;
        let v = qmm(&n("attn_v"))?.forward(&x)?.reshape((t, nkv, hd))?;
        let q = rms_norm(&q, &load(&n("attn_q_norm"))?, eps)?;
        let k = rms_norm(&k, &load(&n("attn_k_norm"))?, eps)?;
        let theta = match hp.layer_attention[l] {
            AttentionKind::Global => hp.rope.theta,
            AttentionKind::Sliding { .. } => hp.rope_local.theta,
        };
        let (q, k) = (rope(&q, f64::from(theta))?, rope(&k, f64::from(theta))?);
        // [heads, t, hd]; the single KV head serves all query heads.
        let q = q.transpose(0, 1)?.contiguous()?;
        let k = k.transpose(0, 1)?.repeat((nh / nkv, 1, 1))?.contiguous()?;
        let v = v.transpose(0, 1)?.repeat((nh / nkv, 1, 1))?.contiguous()?;
        let scores = (q.matmul(&k.t()?)? / f64::from(hp.query_pre_attn_scalar).sqrt())?.broadcast_add(&mask)?;
        let probs = candle_core::Tensor::exp(&scores.broadcast_sub(&scores.max_keepdim(D::Minus1)?)?)?;
        let probs = probs.broadcast_div(&probs.sum_keepdim(D::Minus1)?)?;
        let attn = probs.matmul(&v)?.transpose(0, 1)?.reshape((t, nh * hd))?;
        let attn = qmm(&n("attn_output"))?.forward(&attn)?;
        h = (h + rms_norm(&attn, &load(&n("post_attention_norm"))?, eps)?)?;
        let x = rms_norm(&h, &load(&n("ffn_norm"))?, eps)?;
        let gate = qmm(&n("ffn_gate"))?.forward(&x)?.gelu()?;
        let up = qmm(&n("ffn_up"))?.forward(&x)?;
        let mlp = qmm(&n("ffn_down"))?.forward(&(gate * up)?)?;
        h = (h + rms_norm(&mlp, &load(&n("post_ffw_norm"))?, eps)?)?;
    }
    let h = rms_norm(&h.narrow(0, t - 1, 1)?, &load("output_norm.weight")?, eps)?;
    QMatMul::from_qtensor(embed)?.forward(&h)?.squeeze(0)?.to_vec1()
}

#[test]
fn a_plain_forward_from_the_stored_tensors_matches_the_reference_top8() {
    let f = GgufFile::open(&model_path()).expect("opens");
    let hp = GgufHyperparams::from_gguf(&f).expect("hyperparameters");
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let text = std::fs::read_to_string(root.join("fixtures/gemma3-270m/reference.json")).expect("reference");
    let reference: serde_json::Value = serde_json::from_str(&text).expect("json");
    for case in reference["cases"].as_array().expect("cases") {
        let list = |k: &str| case[k].as_array().expect("list").clone();
        let ids: Vec<u32> = list("input_ids").iter().map(|v| v.as_u64().expect("id") as u32).collect();
        let want: Vec<u32> = list("last_top8_ids").iter().map(|v| v.as_u64().expect("id") as u32).collect();
        let want_top = list("last_top8_logits")[0].as_f64().expect("logit") as f32;
        let logits = last_logits(&f, &hp, &ids).expect("forward");
        let mut order: Vec<u32> = (0..logits.len() as u32).collect();
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        let top8 = &order[..8];
        let shared = want.iter().filter(|id| top8.contains(id)).count();
        let prompt = &case["prompt"];
        assert_eq!(top8[0], want[0], "{prompt}: top-1 {top8:?} vs reference {want:?}");
        assert!(shared >= 6, "{prompt}: top-8 {top8:?} shares {shared} with reference {want:?}");
        let got_top = logits[top8[0] as usize];
        assert!((got_top - want_top).abs() < 0.5, "{prompt}: top logit {got_top} vs reference {want_top}");
    }
}
