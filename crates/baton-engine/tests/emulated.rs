//! The emulated backend: the real loop, planner and KV pool with step times from a cost profile
//! and deterministic tokens. Requests run to their exact lengths, the pool's accounting holds,
//! step times are the profile's, and outputs do not depend on batching.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use baton_engine::{
    EmulatedClock, EmulatedModel, Engine, EngineConfig, FinishReason, GenerationRequest, KvRetention, RequestId,
    StopParams,
};
use baton_model::{ModelConfig, Tokenizer};
use baton_sched::CostProfile;

fn fixture() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-llama")
}

/// The tiny fixture's vocabulary and tokenizer, with a 70B-class profile's step times.
fn model(clock: EmulatedClock) -> EmulatedModel {
    let config = ModelConfig::from_dir(&fixture()).expect("config");
    EmulatedModel { clock, ..EmulatedModel::new(config, CostProfile::llama2_70b_8xh100()) }
}

fn tokenizer() -> Arc<Tokenizer> {
    Arc::new(Tokenizer::from_file(&fixture().join("tokenizer.json")).expect("tokenizer"))
}

fn request(id: u64, prompt_len: usize, max_tokens: usize) -> GenerationRequest {
    let prompt = (0..prompt_len).map(|i| 2 + ((id as usize * 31 + i * 7) % 400) as u32).collect();
    GenerationRequest {
        stop: StopParams { max_tokens, ..StopParams::default() },
        ..GenerationRequest::new(RequestId(id), prompt)
    }
}

#[test]
fn requests_finish_with_exact_lengths_and_clean_accounting() {
    let config = EngineConfig {
        block_size: 16,
        num_blocks: 32,
        max_batch_tokens: 256,
        prefill_chunk: 128,
        ..EngineConfig::default()
    };
    let mut e = Engine::emulated(model(EmulatedClock::Virtual), Some(tokenizer()), config).expect("engine");
    assert!(e.model().is_none());
    let lens = [(32, 200), (40, 180), (17, 1), (50, 150), (300, 40), (64, 64), (5, 200), (250, 9)];
    for (i, &(p, m)) in lens.iter().enumerate() {
        e.add_request(request(i as u64, p, m)).expect("valid");
    }
    let mut done = Vec::new();
    let mut preempted = 0;
    while e.has_work() {
        let out = e.step().expect("step");
        preempted += out.preempted;
        done.extend(out.finished);
        e.pool().check_invariants().expect("pool accounting holds after every step");
    }
    assert!(preempted > 0, "32 blocks of 16 are tight enough to preempt");
    assert_eq!(done.len(), lens.len());
    for f in &done {
        let (_, m) = lens[f.id.0 as usize];
        assert_eq!(f.reason, FinishReason::Length, "never EOS");
        assert_eq!(f.token_ids.len(), m, "request {}", f.id.0);
        assert!(f.token_ids.iter().all(|&t| (t as usize) < e.model_config().vocab_size));
    }
    assert!(done.iter().any(|f| !f.text.is_empty()), "the tokenizer gives text");
    assert_eq!(e.available_blocks(), 32, "every block is free or merely cached");
    assert!(e.emulated_clock().expect("emulated").total_us > 0);
}

#[test]
fn step_times_are_the_profiles() {
    let profile = CostProfile::llama2_70b_8xh100();
    let config = EngineConfig { prefix_caching: false, ..EngineConfig::default() };
    let mut e = Engine::emulated(model(EmulatedClock::Virtual), None, config.clone()).expect("engine");
    // One prefill of 500 tokens, alone: exactly prefill_time(500, 0).
    e.add_request(request(1, 500, 3)).expect("valid");
    let out = e.step().expect("step");
    assert_eq!(e.emulated_clock().expect("emulated").last_step_us, profile.prefill_time(500, 0.0));
    assert_eq!((out.computed_tokens, out.decode_batch, out.decode_context), (500, 0, 0));
    // Its next step is a decode of one sequence with 501 tokens of context.
    let out = e.step().expect("step");
    assert_eq!(e.emulated_clock().expect("emulated").last_step_us, profile.decode_step(1, 501));
    assert_eq!((out.computed_tokens, out.decode_batch, out.decode_context), (1, 1, 501));

    // With the sleeping clock, a decode step's wall time is the profile's: never less, and more
    // only by the scheduler's wake-up latency (generous bound: this machine is shared).
    let mut e = Engine::emulated(model(EmulatedClock::Sleep), None, config).expect("engine");
    for i in 0..4 {
        e.add_request(request(i, 100, 4)).expect("valid");
    }
    e.step().expect("prefill step");
    for k in 1..=2u64 {
        let t0 = Instant::now();
        e.step().expect("decode step");
        let wall = t0.elapsed().as_micros() as u64;
        let predicted = e.emulated_clock().expect("emulated").last_step_us;
        assert_eq!(predicted, profile.decode_step(4, 4 * (100 + k)));
        assert!(wall >= predicted && wall < predicted + 30_000, "wall {wall} µs vs predicted {predicted} µs");
    }
}

/// A prefix found on the host tier is copied back within the step, so the emulated step costs
/// its prefill plus the copy over the profile's host-to-device link.
#[test]
fn a_prefix_swapped_in_from_host_costs_its_copy() {
    let profile = CostProfile::llama2_70b_8xh100();
    let config = EngineConfig { block_size: 16, num_blocks: 32, host_blocks: 64, ..EngineConfig::default() };
    let mut e = Engine::emulated(model(EmulatedClock::Virtual), None, config).expect("engine");
    let (a, b) = (request(1, 320, 1), request(2, 320, 1));
    let prompt = a.prompt.clone();
    for r in [a, b] {
        e.add_request(r).expect("valid");
        e.run_to_completion().expect("runs");
    }
    // b's 20 blocks pushed the tail of a's 20 to the host tier.
    let [device, host, disk] = e.pool().peek_prefix(&prompt[..319]);
    assert!(host > 0 && disk == 0, "a's prefix: {device} blocks on the device, {host} on host");
    e.add_request(GenerationRequest { id: RequestId(3), ..request(1, 320, 1) }).expect("valid");
    e.step().expect("step");
    let cached = ((device + host) * 16) as u64;
    let copy = profile.kv_transfer_time((host * 16) as u64, profile.host_to_device);
    assert_eq!(e.emulated_clock().expect("emulated").last_step_us, profile.prefill_time_cached(320, cached) + copy);
    assert_eq!(e.device_invalidated_blocks(), host as u64, "a GPU would upload exactly the blocks copied up");
    // The next step copies nothing.
    e.add_request(request(4, 40, 1)).expect("valid");
    e.step().expect("step");
    assert_eq!(e.emulated_clock().expect("emulated").last_step_us, profile.prefill_time_cached(40, 0));
}

/// A sleeping emulated engine whose host link takes 20 ms a block and whose prefill takes 32 ms
/// one, after two requests of 320 tokens: the first one's prefix is partly on the host tier.
/// Returns the engine, its profile and that prefix's blocks on the device and on the host.
fn slow_host_engine() -> (Engine, CostProfile, [usize; 2]) {
    let mut profile = CostProfile::llama2_70b_8xh100();
    profile.prefill.per_token_us = 2_000.0;
    profile.host_to_device.bytes_per_s = profile.kv_bytes_per_token * 16 * 50;
    let config = ModelConfig::from_dir(&fixture()).expect("config");
    let model = EmulatedModel { clock: EmulatedClock::Sleep, ..EmulatedModel::new(config, profile.clone()) };
    let engine_config = EngineConfig { block_size: 16, num_blocks: 32, host_blocks: 64, ..EngineConfig::default() };
    let mut e = Engine::emulated(model, None, engine_config).expect("engine");
    let prompt = request(1, 320, 1).prompt;
    for r in [request(1, 320, 1), request(2, 320, 1)] {
        e.add_request(r).expect("valid");
        e.run_to_completion().expect("runs");
    }
    let [device, host, _] = e.pool().peek_prefix(&prompt[..319]);
    assert!(host > 0, "a's prefix: {device} blocks on the device, {host} on host");
    (e, profile, [device, host])
}

/// A request aborted while its prefix is copied from the host: the slots the copy writes are
/// given back once it ends, and nothing stays held.
#[test]
fn a_request_aborted_during_its_swap_in_leaves_nothing_held() {
    let (mut e, _, _) = slow_host_engine();
    e.add_request(GenerationRequest { id: RequestId(3), ..request(1, 320, 2) }).expect("valid");
    let out = e.step().expect("step");
    assert_eq!(out.computed_tokens, 0, "request 3 waits for its copy");
    assert!(e.available_blocks() < 32, "the copy's device slots are reserved");
    e.abort(RequestId(3)).expect("abort");
    assert!(e.has_work(), "the copy still holds its slots");
    assert!(e.run_to_completion().expect("runs").is_empty());
    assert!(!e.has_work());
    e.pool().check_invariants().expect("pool accounting holds");
    assert_eq!(e.available_blocks(), 32, "every block is free or merely cached");
}

/// A prefix found on the host tier is copied beside the step loop (the engine's copier
/// thread, with a sleeping clock): the request waits for its copy while the others keep
/// decoding, and no step is charged for the copy. The profile makes the copy worth taking
/// (20 ms a block over the host link, against 32 ms to compute one) and long against a decode
/// step (about 7 ms).
#[test]
fn a_prefix_on_the_host_is_copied_while_the_others_decode() {
    let (mut e, profile, [device, host]) = slow_host_engine();
    let marked = e.device_invalidated_blocks();
    // A long decode, then the request that finds a's prefix partly on the host.
    e.add_request(request(5, 16, 400)).expect("valid");
    e.step().expect("prefill");
    e.add_request(GenerationRequest { id: RequestId(3), ..request(1, 320, 2) }).expect("valid");
    let (mut decoded_meanwhile, mut steps) = (0, 0);
    let first = loop {
        let out = e.step().expect("step");
        steps += 1;
        assert!(steps < 10_000, "request 3 never ran");
        let copy = profile.kv_transfer_time((host * 16) as u64, profile.host_to_device);
        assert!(e.emulated_clock().expect("emulated").last_step_us < copy, "no step waits for the copy");
        if let Some(t) = out.tokens.iter().find(|t| t.id == RequestId(3)) {
            break t.token;
        }
        decoded_meanwhile += out.tokens.iter().filter(|t| t.id == RequestId(5)).count();
    };
    assert!(decoded_meanwhile >= 3, "request 5 decoded {decoded_meanwhile} tokens while request 3's prefix was copied");
    let done = e.run_to_completion().expect("runs");
    let three = done.iter().find(|f| f.id == RequestId(3)).expect("request 3 finished");
    assert_eq!(three.cached_tokens, (device + host) * 16, "the prefix came from the device and the host");
    assert_eq!(three.token_ids[0], first);
    // A GPU must upload the blocks the copier wrote: at least those on the host when the test
    // began (request 5's blocks may push more of the prefix there before request 3 is
    // admitted), at most the whole prefix.
    let copied = e.device_invalidated_blocks() - marked;
    assert!((host as u64..=(device + host) as u64).contains(&copied), "{copied} blocks marked stale");
    e.pool().check_invariants().expect("pool accounting holds");
    assert_eq!(e.available_blocks(), 32, "every block is free or merely cached");
}

/// A prefix on a tier whose copy takes longer than computing it again (the 70B profile's 6 GB/s
/// disk: 874 µs a block, against 558 µs to compute it) is computed again: the step charges no
/// copy, the output is the same, and the recomputed blocks take the disk blocks' place.
#[test]
fn a_prefix_on_a_disk_slower_than_recomputing_is_computed_again() {
    let profile = CostProfile::llama2_70b_8xh100();
    let dir = std::env::temp_dir().join(format!("baton-emulated-disk-{}", std::process::id()));
    let config = EngineConfig {
        block_size: 16,
        num_blocks: 32,
        disk_blocks: 64,
        disk_dir: Some(dir.clone()),
        ..EngineConfig::default()
    };
    let mut e = Engine::emulated(model(EmulatedClock::Virtual), None, config).expect("engine");
    let prompt = request(1, 320, 1).prompt;
    let mut outputs = Vec::new();
    for r in [request(1, 320, 1), request(2, 320, 1)] {
        e.add_request(r).expect("valid");
        outputs.push(e.run_to_completion().expect("runs").remove(0).token_ids);
    }
    let [device, host, disk] = e.pool().peek_prefix(&prompt[..319]);
    assert!(disk > 0 && host == 0, "the tail of the first prompt is on disk: {device} + {disk} blocks");
    e.add_request(GenerationRequest { id: RequestId(3), ..request(1, 320, 1) }).expect("valid");
    let out = e.step().expect("step");
    let cached = (device * 16) as u64;
    assert_eq!(e.emulated_clock().expect("emulated").last_step_us, profile.prefill_time_cached(320, cached));
    assert_eq!(out.finished[0].token_ids, outputs[0], "the same output");
    assert_eq!(e.pool().peek_prefix(&prompt[..319])[2], 0, "the recomputed blocks replaced the disk ones");
    e.pool().check_invariants().expect("pool accounting holds");
    drop(e);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn outputs_do_not_depend_on_batching_and_hand_over() {
    let run_alone = |r: GenerationRequest| {
        let mut e = Engine::emulated(model(EmulatedClock::Virtual), None, EngineConfig::default()).expect("engine");
        e.add_request(r).expect("valid");
        e.run_to_completion().expect("runs").remove(0).token_ids
    };
    let alone: Vec<_> = (0..5).map(|i| run_alone(request(i, 40 + i as usize * 13, 20))).collect();
    let mut e = Engine::emulated(model(EmulatedClock::Virtual), None, EngineConfig::default()).expect("engine");
    for i in 0..5 {
        e.add_request(request(i, 40 + i as usize * 13, 20)).expect("valid");
    }
    let mut batched = e.run_to_completion().expect("runs");
    batched.sort_by_key(|f| f.id);
    for (f, a) in batched.iter().zip(&alone) {
        assert_eq!(&f.token_ids, a);
    }

    // Prefill on one emulated engine, decode on another (the disaggregated path).
    let mut p = Engine::emulated(model(EmulatedClock::Virtual), None, EngineConfig::default()).expect("engine");
    let mut d = Engine::emulated(model(EmulatedClock::Virtual), None, EngineConfig::default()).expect("engine");
    let req = GenerationRequest { retain_kv: KvRetention::All, ..request(0, 40, 1) };
    p.add_request(req).expect("valid");
    let mut first = p.run_to_completion().expect("prefill");
    let f = first.remove(0);
    let kv = f.kv.expect("retained");
    let reserved = d.reserve_kv(kv.tokens).expect("room");
    d.kv_mut().copy_blocks_from(p.kv(), &kv.blocks, &reserved.blocks);
    p.release_kv(kv).expect("release");
    let cont = GenerationRequest { generated: f.token_ids.clone(), prefix: Some(reserved), ..request(0, 40, 20) };
    d.add_request(cont).expect("valid");
    let out = d.run_to_completion().expect("decode").remove(0);
    assert_eq!(out.token_ids, alone[0], "the hand-over continues the same tokens");
    assert_eq!(p.available_blocks(), p.config().num_blocks);
    assert_eq!(d.available_blocks(), d.config().num_blocks);

    // EOS only when asked for.
    let eos_model = EmulatedModel { eos_after: Some(3), ..model(EmulatedClock::Virtual) };
    let mut e = Engine::emulated(eos_model, None, EngineConfig::default()).expect("engine");
    e.add_request(request(9, 10, 50)).expect("valid");
    let f = e.run_to_completion().expect("runs").remove(0);
    assert_eq!((f.reason, f.token_ids.len()), (FinishReason::Eos, 3));
}
