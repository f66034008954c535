//! The GGUF reader on small files these tests write themselves: no model download needed.

use std::path::Path;

use baton_gguf::{
    AttentionKind, GgmlTypeId, GgufArchitecture, GgufArray, GgufError, GgufFile, GgufHyperparams, GgufValue, GgufWriter,
};
use baton_model_types::ModelError;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

fn open(w: &GgufWriter) -> GgufFile {
    GgufFile::from_bytes(w.to_bytes(), Path::new("test.gguf")).expect("parses")
}

fn s(v: &str) -> GgufValue {
    GgufValue::String(v.to_owned())
}

fn strings(v: &[&str]) -> GgufValue {
    GgufValue::Array(GgufArray::String(v.iter().map(|s| (*s).to_owned()).collect()))
}

fn every_value_type() -> Vec<(&'static str, GgufValue)> {
    vec![
        ("t.u8", GgufValue::U8(200)),
        ("t.i8", GgufValue::I8(-100)),
        ("t.u16", GgufValue::U16(60_000)),
        ("t.i16", GgufValue::I16(-30_000)),
        ("t.u32", GgufValue::U32(4_000_000_000)),
        ("t.i32", GgufValue::I32(-2_000_000_000)),
        ("t.u64", GgufValue::U64(u64::MAX)),
        ("t.i64", GgufValue::I64(i64::MIN)),
        ("t.f32", GgufValue::F32(1.5e-6)),
        ("t.f64", GgufValue::F64(-2.25e300)),
        ("t.bool", GgufValue::Bool(true)),
        ("t.string", s("héllo ▁ wörld")),
        ("t.empty_string", s("")),
        ("t.arr_f32", GgufValue::Array(GgufArray::F32(vec![1.0, -2.5, f32::INFINITY]))),
        ("t.arr_i32", GgufValue::Array(GgufArray::I32(vec![1, -2, 3]))),
        ("t.arr_bool", GgufValue::Array(GgufArray::Bool(vec![true, false, true]))),
        ("t.arr_str", strings(&["a", "", "ccc"])),
        ("t.arr_u64", GgufValue::Array(GgufArray::U64(vec![]))),
        (
            "t.nested",
            GgufValue::Array(GgufArray::Array(vec![GgufArray::U8(vec![1, 2]), GgufArray::String(vec!["x".into()])])),
        ),
    ]
}

#[test]
fn metadata_of_every_type_round_trips_in_order() {
    let mut w = GgufWriter::new();
    for (k, v) in every_value_type() {
        w.add_metadata(k, v);
    }
    let f = open(&w);
    assert_eq!(f.version(), 3);
    let got: Vec<(String, GgufValue)> = f.metadata().iter().map(|(k, v)| (k.to_owned(), v.clone())).collect();
    let want: Vec<(String, GgufValue)> = every_value_type().into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
    assert_eq!(got, want);
    assert!(f.tensors().is_empty());
}

#[test]
fn typed_getters_widen_integers_and_name_the_key_on_error() {
    let mut w = GgufWriter::new();
    for (k, v) in every_value_type() {
        w.add_metadata(k, v);
    }
    let f = open(&w);
    let m = f.metadata();
    assert_eq!(m.get::<u32>("t.u8").expect("u8 widens"), 200);
    assert_eq!(m.get::<usize>("t.u16").expect("u16 widens"), 60_000);
    assert_eq!(m.get::<i64>("t.i32").expect("i32 widens"), -2_000_000_000);
    assert_eq!(m.get::<f64>("t.f32").expect("f32 widens"), f64::from(1.5e-6f32));
    assert_eq!(m.get::<&str>("t.string").expect("str"), "héllo ▁ wörld");
    assert_eq!(m.get::<&[String]>("t.arr_str").expect("strings"), ["a", "", "ccc"]);
    assert_eq!(m.get::<&[f32]>("t.arr_f32").expect("floats")[1], -2.5);
    assert!(m.get::<bool>("t.bool").expect("bool"));
    assert_eq!(m.get_opt::<u32>("t.absent").expect("absent is fine"), None);

    let e = m.get::<u32>("t.absent").expect_err("missing");
    assert!(matches!(&e, GgufError::MissingKey { key, .. } if key == "t.absent"), "{e}");
    assert!(e.to_string().contains("test.gguf") && e.to_string().contains("t.absent"), "{e}");
    let e = m.get::<u32>("t.i8").expect_err("negative does not fit u32");
    assert!(e.to_string().contains("`t.i8`"), "{e}");
    let e = m.get::<u16>("t.u32").expect_err("too big for u16");
    assert!(e.to_string().contains("`t.u32`"), "{e}");
    let e = m.get::<&str>("t.arr_str").expect_err("array is not a string");
    assert!(e.to_string().contains("array of 3 string"), "{e}");
    let model: ModelError = e.into();
    assert!(model.to_string().contains("t.arr_str"), "{model}");
}

fn ramp(rows: usize, cols: usize) -> Tensor {
    let n = rows * cols;
    let v: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0).collect();
    Tensor::from_vec(v, (rows, cols), &Device::Cpu).expect("tensor")
}

#[test]
fn tensors_of_each_type_round_trip_through_the_file() {
    let dev = Device::Cpu;
    let types = [
        GgmlDType::F32,
        GgmlDType::F16,
        GgmlDType::Q4_0,
        GgmlDType::Q5_0,
        GgmlDType::Q8_0,
        GgmlDType::Q2K,
        GgmlDType::Q3K,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ];
    let src = ramp(4, 512);
    let mut w = GgufWriter::new();
    let mut originals = Vec::new();
    for dtype in types {
        let q = QTensor::quantize(&src, dtype).expect("quantizes");
        w.add_qtensor(format!("w.{dtype:?}"), &q).expect("adds");
        originals.push((dtype, q));
    }
    // A 1-d tensor and a 3-d one, to check the dimension order.
    w.add_qtensor("norm", &QTensor::quantize(&ramp(1, 64).squeeze(0).expect("1d"), GgmlDType::F32).expect("q"))
        .expect("adds");
    let cube = ramp(6, 32).reshape((2, 3, 32)).expect("3d");
    w.add_qtensor("cube", &QTensor::quantize(&cube, GgmlDType::F32).expect("q")).expect("adds");

    let f = open(&w);
    assert_eq!(f.tensors().len(), types.len() + 2);
    for (dtype, q) in &originals {
        let name = format!("w.{dtype:?}");
        let info = f.tensor_info(&name).expect("listed");
        assert_eq!(info.shape, [4, 512]);
        assert_eq!(info.ggml_type, GgmlTypeId::from_dtype(*dtype));
        assert_eq!(info.ggml_type.dtype(), Some(*dtype));
        assert!(info.offset.is_multiple_of(32));
        let loaded = f.qtensor(&name, &dev).expect("loads");
        assert_eq!(loaded.dtype(), *dtype);
        assert_eq!(loaded.data().expect("data"), q.data().expect("data"), "{name}: bytes differ");
        let a = f.tensor(&name, &dev).expect("dequantizes");
        let b = q.dequantize(&dev).expect("dequantizes");
        let diff = (a - b).and_then(|d| d.abs()).and_then(|d| d.max_all()).and_then(|d| d.to_scalar::<f32>());
        assert_eq!(diff.expect("diff"), 0.0, "{name}");
    }
    assert_eq!(f.tensor("norm", &dev).expect("1d").dims(), [64]);
    let c = f.tensor("cube", &dev).expect("3d");
    assert_eq!(c.dims(), [2, 3, 32]);
    let same = (c - cube).and_then(|d| d.abs()).and_then(|d| d.max_all()).and_then(|d| d.to_scalar::<f32>());
    assert_eq!(same.expect("diff"), 0.0);
}

#[test]
fn general_alignment_places_the_data_and_each_tensor() {
    let mut w = GgufWriter::new();
    w.set_alignment(64);
    w.add_metadata("general.architecture", s("llama"));
    w.add_qtensor("a", &QTensor::quantize(&ramp(1, 3).squeeze(0).expect("1d"), GgmlDType::F32).expect("q"))
        .expect("adds");
    w.add_qtensor("b", &QTensor::quantize(&ramp(2, 32), GgmlDType::Q8_0).expect("q")).expect("adds");
    let f = open(&w);
    assert_eq!(f.alignment(), 64);
    assert!(f.data_offset().is_multiple_of(64));
    assert_eq!(f.tensor_info("b").expect("b").offset, 64);
    assert_eq!(f.tensor("a", &Device::Cpu).expect("a").dims(), [3]);
    assert_eq!(f.tensor("b", &Device::Cpu).expect("b").dims(), [2, 32]);

    // A file on disk goes through the memory map.
    let path = std::env::temp_dir().join(format!("baton-gguf-{}.gguf", std::process::id()));
    std::fs::write(&path, w.to_bytes()).expect("writes");
    let mapped = GgufFile::open(&path).expect("maps");
    assert_eq!(mapped.tensor("b", &Device::Cpu).expect("b").dims(), [2, 32]);
    std::fs::remove_file(&path).expect("removes");
}

fn malformed(bytes: Vec<u8>) -> String {
    let e = GgufFile::from_bytes(bytes, Path::new("bad.gguf")).expect_err("rejected");
    let msg = e.to_string();
    assert!(msg.contains("bad.gguf"), "{msg}");
    msg
}

#[test]
fn malformed_files_are_rejected_with_the_reason() {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", s("llama"));
    w.add_qtensor("t", &QTensor::quantize(&ramp(2, 32), GgmlDType::F32).expect("q")).expect("adds");
    let good = w.to_bytes();

    let mut bad = good.clone();
    bad[0] = b'X';
    assert!(malformed(bad).contains("magic"));

    let mut v1 = good.clone();
    v1[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert!(malformed(v1).contains("v1"));

    let mut big_endian = good.clone();
    big_endian[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert!(malformed(big_endian).contains("big-endian"));

    // Cut inside the metadata, and cut inside the tensor data.
    assert!(malformed(good[..66].to_vec()).contains("more bytes"));
    assert!(malformed(good[..30].to_vec()).contains("remaining bytes can hold"));
    assert!(malformed(good[..good.len() - 8].to_vec()).contains("runs past the end"));

    let mut huge_count = good.clone();
    huge_count[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(malformed(huge_count).contains("metadata entries"));

    let mut bad_type = GgufWriter::new();
    bad_type.add_metadata("k", GgufValue::U32(1));
    let mut bytes = bad_type.to_bytes();
    // magic, version, counts (24 bytes), key length (8) and "k" (1): the value type follows.
    bytes[33..37].copy_from_slice(&99u32.to_le_bytes());
    assert!(malformed(bytes).contains("unknown value type 99"));

    let mut odd_alignment = GgufWriter::new();
    odd_alignment.add_metadata("general.alignment", GgufValue::U32(24));
    let e = GgufFile::from_bytes(odd_alignment.to_bytes(), Path::new("bad.gguf")).expect_err("rejected");
    assert!(e.to_string().contains("general.alignment"), "{e}");
}

#[test]
fn a_type_candle_lacks_is_listed_but_does_not_load() {
    let mut w = GgufWriter::new();
    // IQ2_XXS: 66-byte blocks of 256.
    w.add_raw_tensor("iq", &[1, 256], GgmlTypeId(16), vec![0; 66]);
    let f = open(&w);
    let info = f.tensor_info("iq").expect("listed");
    assert_eq!(info.ggml_type.to_string(), "IQ2_XXS");
    let e = f.qtensor("iq", &Device::Cpu).expect_err("unsupported");
    assert!(e.to_string().contains("`iq`") && e.to_string().contains("IQ2_XXS"), "{e}");
    let e = f.qtensor("nope", &Device::Cpu).expect_err("missing");
    assert!(matches!(e, GgufError::MissingTensor { .. }), "{e}");
}

fn llama_metadata(w: &mut GgufWriter, arch: &str) {
    w.add_metadata("general.architecture", s(arch));
    w.add_metadata(format!("{arch}.block_count"), GgufValue::U32(4));
    w.add_metadata(format!("{arch}.embedding_length"), GgufValue::U32(64));
    w.add_metadata(format!("{arch}.feed_forward_length"), GgufValue::U32(128));
    w.add_metadata(format!("{arch}.attention.head_count"), GgufValue::U32(4));
    w.add_metadata(format!("{arch}.attention.head_count_kv"), GgufValue::U32(2));
    w.add_metadata(format!("{arch}.context_length"), GgufValue::U32(2048));
    w.add_metadata(format!("{arch}.attention.layer_norm_rms_epsilon"), GgufValue::F32(1e-5));
    w.add_metadata("tokenizer.ggml.tokens", strings(&["a", "b", "c"]));
}

#[test]
fn llama_hyperparameters_take_defaults_where_keys_are_absent() {
    let mut w = GgufWriter::new();
    llama_metadata(&mut w, "llama");
    let hp = GgufHyperparams::from_metadata(open(&w).metadata()).expect("maps");
    assert_eq!(hp.architecture, GgufArchitecture::Llama);
    assert_eq!((hp.num_layers, hp.hidden_size, hp.intermediate_size), (4, 64, 128));
    assert_eq!((hp.num_heads, hp.num_kv_heads, hp.head_dim, hp.group_size()), (4, 2, 16, 2));
    assert_eq!(hp.vocab_size, 3);
    assert_eq!(hp.rope.theta, 10_000.0);
    assert_eq!(hp.rope_local, hp.rope);
    assert_eq!(hp.layer_attention, vec![AttentionKind::Global; 4]);
    assert_eq!(hp.embedding_scale, None);
    assert!(!hp.tie_word_embeddings && !hp.qk_norm);

    let mut q = GgufWriter::new();
    llama_metadata(&mut q, "qwen2");
    q.add_metadata("qwen2.rope.freq_base", GgufValue::F32(1e6));
    let hp = GgufHyperparams::from_metadata(open(&q).metadata()).expect("maps");
    assert_eq!(hp.architecture, GgufArchitecture::Qwen2);
    assert!(hp.attention_bias);
    assert_eq!(hp.rope.theta, 1e6);
}

#[test]
fn hyperparameter_errors_name_the_key() {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", s("mamba"));
    let e = GgufHyperparams::from_metadata(open(&w).metadata()).expect_err("unsupported");
    assert!(e.to_string().contains("mamba"), "{e}");

    let mut w = GgufWriter::new();
    llama_metadata(&mut w, "llama");
    w.add_metadata("llama.attention.head_count_kv", GgufValue::U32(3));
    let e = GgufHyperparams::from_metadata(open(&w).metadata()).expect_err("3 does not divide 4");
    assert!(e.to_string().contains("llama.attention.head_count_kv"), "{e}");

    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", s("gemma3"));
    let e = GgufHyperparams::from_metadata(open(&w).metadata()).expect_err("no block count");
    assert!(e.to_string().contains("gemma3.block_count"), "{e}");
}

#[test]
fn sliding_window_pattern_from_metadata_overrides_the_default() {
    let mut w = GgufWriter::new();
    llama_metadata(&mut w, "gemma3");
    w.add_metadata("gemma3.attention.sliding_window", GgufValue::U32(8));
    let hp = GgufHyperparams::from_metadata(open(&w).metadata()).expect("maps");
    // Four layers under Gemma 3's fixed period of six: all sliding.
    assert_eq!(hp.layer_attention, vec![AttentionKind::Sliding { window: 8 }; 4]);
    assert_eq!(hp.rope_local.theta, 10_000.0);

    w.add_metadata("gemma3.attention.sliding_window_pattern", GgufValue::U32(2));
    w.add_metadata("gemma3.rope.freq_base_swa", GgufValue::F32(5_000.0));
    let hp = GgufHyperparams::from_metadata(open(&w).metadata()).expect("maps");
    let slide = AttentionKind::Sliding { window: 8 };
    assert_eq!(hp.layer_attention, [slide, AttentionKind::Global, slide, AttentionKind::Global]);
    assert_eq!(hp.rope_local.theta, 5_000.0);
}
