//! The stand-in device (`--device stand-in`) at the engine level: the CPU's tokens, its KV in an
//! arena of its own (the memfd `baton-device-arena`) that it offers as a device arena, and no
//! byte copied out of that arena by the steps themselves — what a device backend that owns its
//! KV must show (issue #58), checked where there is no GPU.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use baton_engine::{Engine, EngineConfig, GenerationRequest, RequestId, StopParams};
use baton_kv::CopyBytes;
use baton_model::{Checkpoint, ComputeDevice, DeviceOptions};

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn open(path: &Path, device: ComputeDevice) -> Checkpoint {
    Checkpoint::open_on(path, DeviceOptions { device, ..DeviceOptions::default() }).expect("the checkpoint loads")
}

/// The memfds this process maps whose name is `name`, by inode.
fn memfds(name: &str) -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("maps");
    let pattern = format!("/memfd:{name} ");
    let mut inodes: Vec<&str> = maps
        .lines()
        .filter(|l| l.contains(&pattern) || l.ends_with(&format!("/memfd:{name}")))
        .filter_map(|l| l.split_whitespace().nth(4))
        .collect();
    inodes.sort_unstable();
    inodes.dedup();
    inodes.len()
}

fn run(engine: &mut Engine, prompt: Vec<u32>, max_tokens: usize) -> Vec<u32> {
    let stop = StopParams { max_tokens, ignore_eos: true, stop_strings: vec![] };
    engine.add_request(GenerationRequest { stop, ..GenerationRequest::new(RequestId(1), prompt) }).expect("valid");
    engine.run_to_completion().expect("runs").remove(0).token_ids
}

#[test]
fn the_stand_in_gives_the_cpus_tokens_from_an_arena_of_its_own_offered_as_a_device_arena() {
    let dir = repo_root().join("fixtures/models/tiny-llama");
    let config = || EngineConfig { block_size: 4, num_blocks: 64, ..EngineConfig::default() };
    let cpu = open(&dir, ComputeDevice::Cpu);
    let prompt = cpu.tokenizer.encode("Disaggregated inference separates prefill and decode.", true).expect("ids");
    let mut on_cpu = Engine::new(Arc::new(cpu.model), None, config()).expect("engine");
    assert!(on_cpu.device_arena().is_none(), "the CPU offers no device arena");
    let want = run(&mut on_cpu, prompt.clone(), 16);

    let before = memfds(baton_model::STAND_IN_ARENA_NAME);
    let stand_in = open(&dir, ComputeDevice::StandIn);
    assert_eq!(stand_in.model.device(), ComputeDevice::StandIn);
    let mut engine = Engine::new(Arc::new(stand_in.model), None, config()).expect("engine");
    assert_eq!(memfds(baton_model::STAND_IN_ARENA_NAME), before + 1, "the stand-in's arena is its own memfd");
    let device = engine.device_arena().expect("the stand-in offers a device arena").expect("it opens");
    assert!(matches!(device.location(), baton_transfer::Location::Device { .. }));
    assert_eq!(run(&mut engine, prompt, 16), want, "the stand-in computes the CPU's tokens");
    assert_eq!(engine.copy_meter().snapshot(), CopyBytes::default(), "steps copy nothing out of the arena");
    drop((engine, device));
    assert_eq!(memfds(baton_model::STAND_IN_ARENA_NAME), before, "the arena goes with its engine");
}

/// Issue #58's figure: on the stand-in, a 4,096-token prefill and 64 decode steps move 0 bytes
/// between the device arena and the host (no tier, no transfer, no export asked for any).
#[test]
fn a_long_prefill_and_its_decode_on_the_stand_in_copy_no_byte_to_the_host() {
    let path = baton_model::known_model_path(&repo_root(), "smollm2-135m-instruct").expect("a known model");
    assert!(path.is_file(), "{} is missing: run `scripts/fetch-model.sh` first", path.display());
    let ckpt = open(&path, ComputeDevice::StandIn);
    let vocab = ckpt.model.config().vocab_size as u32;
    let config = EngineConfig { block_size: 16, num_blocks: 4096 / 16 + 8, ..EngineConfig::default() };
    let mut engine = Engine::new(Arc::new(ckpt.model), None, config).expect("engine");
    // Ordinary tokens, not a repeated one: 4,096 of them.
    let prompt: Vec<u32> = (0..4096u32).map(|i| 1000 + (i * 7919) % (vocab - 2000)).collect();
    let out = run(&mut engine, prompt, 64);
    assert_eq!(out.len(), 64);
    assert_eq!(engine.copy_meter().snapshot(), CopyBytes::default(), "bytes moved between the device and host");
}
