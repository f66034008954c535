//! `baton profile`'s library side on the tiny fixture: measure the real engine, fit, write a
//! profile file, and drive an emulated engine with it.

use std::path::Path;
use std::sync::Arc;

use baton_engine::profile::{ProfileConfig, fit, load_profile, measure};
use baton_engine::{EmulatedClock, EmulatedModel, Engine, EngineConfig, GenerationRequest, RequestId};
use baton_model::Checkpoint;

#[test]
fn measured_profile_drives_an_emulated_engine() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-llama");
    let ckpt = Checkpoint::open(&dir).expect("fixture loads");
    let config = ckpt.model.config().clone();
    let cfg = ProfileConfig {
        prompt_lens: vec![16, 64, 160],
        cached_ratios: vec![0.0, 0.5],
        batch_sizes: vec![1, 4],
        contexts: vec![32, 96],
        repeats: 1,
        ..ProfileConfig::default()
    };
    let mut lines = Vec::new();
    let samples = measure(Arc::new(ckpt.model), &cfg, &mut |l| lines.push(l.to_owned())).expect("measure");
    assert_eq!(lines.len(), 6 + 4, "one progress line per point");
    assert_eq!(samples.prefill.len(), 6);
    assert_eq!(samples.decode.len(), 4);
    // Half of 64 tokens is 2 whole blocks of 16: the prefix cache served them.
    assert!(samples.prefill.iter().any(|s| s.tokens == 64 && s.cached_ratio == 0.5), "{:?}", samples.prefill);
    assert!(samples.prefill.iter().all(|s| s.micros > 0) && samples.decode.iter().all(|s| s.micros > 0));

    let file = fit("tiny-llama/cpu", 1024, samples, 2).expect("fit");
    let p = &file.profile;
    for c in [p.prefill.fixed_us, p.prefill.per_token_us, p.prefill.attention_us, p.decode.fixed_us] {
        assert!(c >= 0.0 && c.is_finite(), "{p:?}");
    }
    let path = std::env::temp_dir().join(format!("baton-tiny-profile-{}.json", std::process::id()));
    std::fs::write(&path, serde_json::to_string_pretty(&file).expect("json")).expect("write");
    let loaded = load_profile(path.to_str().expect("utf-8")).expect("load");
    assert_eq!(&loaded, p);
    let _ = std::fs::remove_file(&path);

    let model = EmulatedModel { clock: EmulatedClock::Virtual, ..EmulatedModel::new(config, loaded.clone()) };
    let mut e = Engine::emulated(model, None, EngineConfig::default()).expect("engine");
    e.add_request(GenerationRequest::new(RequestId(1), vec![7; 100])).expect("valid");
    e.step().expect("prefill");
    assert_eq!(e.emulated_clock().expect("emulated").last_step_us, loaded.prefill_time(100, 0.0));
    e.step().expect("decode");
    assert_eq!(e.emulated_clock().expect("emulated").last_step_us, loaded.decode_step(1, 101));
}
