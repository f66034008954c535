//! Scheduling must never change what a request generates: under memory pressure (preemption
//! and recomputation), chunked prefill, continuous batching with requests arriving mid-run and
//! prefix caching, every request's greedy tokens equal those it gets alone, and the pool's
//! accounting holds after every step.

use std::path::Path;
use std::sync::Arc;

use baton_engine::{Engine, EngineConfig, GenerationRequest, RequestId, StopParams};
use baton_kv::KvLayout;
use baton_model::Checkpoint;

/// A small deterministic generator, so the workload is the same on every run.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

fn workload() -> Vec<GenerationRequest> {
    let mut rng = Lcg(7);
    let prefixes: Vec<Vec<u32>> =
        (0..3).map(|_| std::iter::once(0).chain((0..12).map(|_| 6 + rng.next(500) as u32)).collect()).collect();
    (0..24)
        .map(|i| {
            let mut prompt = prefixes[rng.next(3) as usize].clone();
            prompt.extend((0..1 + rng.next(20)).map(|_| 6 + rng.next(500) as u32));
            GenerationRequest {
                stop: StopParams { max_tokens: 1 + rng.next(16) as usize, ignore_eos: true, stop_strings: vec![] },
                ..GenerationRequest::new(RequestId(i), prompt)
            }
        })
        .collect()
}

fn clone(r: &GenerationRequest) -> GenerationRequest {
    GenerationRequest { stop: r.stop.clone(), ..GenerationRequest::new(r.id, r.prompt.clone()) }
}

#[test]
fn outputs_do_not_depend_on_scheduling() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-llama");
    let model = Arc::new(Checkpoint::open(&dir).expect("fixture loads").model);
    let requests = workload();

    let mut alone = Vec::new();
    for r in &requests {
        let config = EngineConfig { num_blocks: 64, prefix_caching: false, ..EngineConfig::default() };
        let mut e = Engine::new(model.clone(), None, config).expect("engine");
        e.add_request(clone(r)).expect("valid");
        alone.push(e.run_to_completion().expect("runs").remove(0).token_ids);
    }

    for (layout, chunk) in [(KvLayout::BlockMajor, 5), (KvLayout::LayerMajor, 64)] {
        let config = EngineConfig {
            block_size: 4,
            num_blocks: 20,
            layout,
            max_num_seqs: 8,
            max_batch_tokens: 24,
            prefill_chunk: chunk,
            ..EngineConfig::default()
        };
        let mut e = Engine::new(model.clone(), None, config).expect("engine");
        let mut pending = requests.iter().map(clone).collect::<Vec<_>>().into_iter();
        let (mut preempted, mut cached, mut steps) = (0, 0, 0);
        let mut outputs = vec![None; requests.len()];
        while outputs.iter().any(Option::is_none) {
            // Two new requests every third step: arrivals while others run.
            if steps % 3 == 0 {
                for r in pending.by_ref().take(2) {
                    e.add_request(r).expect("valid");
                }
            }
            let out = e.step().expect("step");
            preempted += out.preempted;
            for f in out.finished {
                cached += f.cached_tokens;
                outputs[f.id.0 as usize] = Some(f.token_ids);
            }
            e.pool().check_invariants().expect("pool accounting holds after every step");
            steps += 1;
            assert!(steps < 10_000, "no progress");
        }
        for (i, out) in outputs.into_iter().enumerate() {
            assert_eq!(out.as_ref(), Some(&alone[i]), "request {i} under {layout:?}, chunk {chunk}");
        }
        assert!(preempted > 0, "the arena is small enough to force preemption");
        assert!(cached > 0, "shared prefixes hit the cache");
        assert_eq!(e.available_blocks(), 20, "nothing stays held");
    }
}
