//! `baton bench engine`: prefill and decode throughput of the engine on a random-weight model
//! of realistic shape (or a real checkpoint, `--model`), next to the machine's memory bandwidth
//! measured in the same run.
//!
//! Decode at small batch is bound by reading the weights once per step, so the figure of merit
//! is the weight bytes read per second as a fraction of the bandwidth a plain parallel read of
//! memory achieves on the same machine, in the same run: on a CPU, measured again next to
//! each batch (a shared machine's bandwidth moves within minutes).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use baton_kv::{KvDtype, KvLayout};
use baton_model::config::{Architecture, ModelConfig, RopeConfig, RopeScaling, WeightDtype};
use baton_model::{Checkpoint, ComputeDevice, DeviceLimits, DeviceOptions, DeviceRandomWeights, Model, RandomWeights};
use serde::Serialize;

use crate::{Engine, EngineConfig, EngineError, GenerationRequest, RequestId, StopParams};

fn dtype_name<S: serde::Serializer>(d: &KvDtype, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{d:?}").to_lowercase())
}

/// Shape of the benchmark model and workload.
#[derive(Debug, Clone, Serialize)]
pub struct EngineBenchConfig {
    /// Width of the residual stream.
    pub hidden: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// MLP width.
    pub intermediate: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// Prompt tokens per sequence.
    pub prompt_len: usize,
    /// Decode steps timed per batch.
    pub decode_steps: usize,
    /// Batch sizes to run.
    pub batches: Vec<usize>,
    /// KV layout.
    #[serde(skip)]
    pub layout: KvLayout,
    /// Element type of the KV cache.
    #[serde(serialize_with = "dtype_name")]
    pub kv_dtype: KvDtype,
    /// A real checkpoint (HF directory or `.gguf` file) to run instead of random weights; the
    /// shape fields above are then ignored.
    pub model: Option<PathBuf>,
    /// Where the model computes.
    #[serde(skip)]
    pub device: DeviceOptions,
}

impl Default for EngineBenchConfig {
    fn default() -> Self {
        Self {
            hidden: 1024,
            layers: 16,
            heads: 16,
            kv_heads: 4,
            intermediate: 2816,
            vocab: 32_000,
            prompt_len: 512,
            decode_steps: 32,
            batches: vec![1, 16],
            layout: KvLayout::BlockMajor,
            kv_dtype: KvDtype::F32,
            model: None,
            device: DeviceOptions::default(),
        }
    }
}

impl EngineBenchConfig {
    /// The model configuration the benchmark builds.
    pub fn model_config(&self) -> ModelConfig {
        let rope = RopeConfig { theta: 10_000.0, scaling: RopeScaling::None };
        ModelConfig {
            architecture: Architecture::Llama,
            vocab_size: self.vocab,
            hidden_size: self.hidden,
            intermediate_size: self.intermediate,
            num_layers: self.layers,
            num_heads: self.heads,
            num_kv_heads: self.kv_heads,
            head_dim: self.hidden / self.heads,
            rms_norm_eps: 1e-5,
            rope,
            max_position_embeddings: 8192,
            tie_word_embeddings: false,
            attention_bias: false,
            mlp_bias: false,
            dtype: WeightDtype::F32,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
            ..ModelConfig::plain_decoder(self.layers, rope)
        }
    }
}

/// What was benchmarked.
#[derive(Debug, Clone, Serialize)]
pub struct ModelSummary {
    /// `Llama`, `Qwen2`, `Gemma3`.
    pub architecture: String,
    /// Decoder layers.
    pub layers: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Query heads / KV heads.
    pub heads: (usize, usize),
    /// Vocabulary.
    pub vocab: usize,
    /// Where the weights came from: a path, or `random`.
    pub source: String,
}

/// Bandwidth of this machine, measured with all threads.
#[derive(Debug, Clone, Serialize)]
pub struct MemoryBandwidth {
    /// Threads used (rayon's pool).
    pub threads: usize,
    /// GB/s reading a 1 GiB buffer (sum of floats), best of three, at the run's start (on a
    /// CPU each batch has its own, [`BatchResult::read_gb_s`]).
    pub read_gb_s: f64,
    /// GB/s copying 512 MiB (bytes read + bytes written counted once: bytes copied / time).
    pub memcpy_gb_s: f64,
}

/// One batch size's figures.
#[derive(Debug, Clone, Serialize)]
pub struct BatchResult {
    /// Sequences in the batch.
    pub batch: usize,
    /// Prompt tokens per second over the whole batch's prefill.
    pub prefill_tokens_per_s: f64,
    /// Generated tokens per second over all sequences during decode.
    pub decode_tokens_per_s: f64,
    /// Decode steps per second.
    pub decode_steps_per_s: f64,
    /// Weight bytes read per second during decode (one read of every matrix per step).
    pub decode_weight_gb_s: f64,
    /// The machine's read bandwidth this batch's decode is set beside, GB/s: on a CPU the
    /// higher of two probes, just before and just after the batch; elsewhere the run's.
    pub read_gb_s: f64,
    /// `decode_weight_gb_s / read_gb_s`.
    pub decode_fraction_of_read_bw: f64,
    /// On a CPU: the threads' hand-off round trip just after the batch, ns
    /// ([`handoff_round_trip_ns`]).
    pub handoff_ns: Option<f64>,
    /// Mean decode step, ms.
    pub decode_step_ms: f64,
    /// On a GPU: the step's memory roofline, ms: the weights plus the KV the step reads (every
    /// sequence's context, all layers) over the device's measured copy bandwidth.
    pub decode_roofline_ms: Option<f64>,
    /// On a GPU: prefill's dense TFLOP/s (2 · parameters · tokens / time; attention not
    /// counted).
    pub prefill_tflops: Option<f64>,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct EngineBenchReport {
    /// The workload.
    pub config: EngineBenchConfig,
    /// The model's architecture and shape as loaded.
    pub model: ModelSummary,
    /// Parameters of the model.
    pub params: usize,
    /// Bytes of weights one forward step reads.
    pub weight_bytes_per_step: usize,
    /// The machine's bandwidth, same run.
    pub memory: MemoryBandwidth,
    /// Per batch size.
    pub results: Vec<BatchResult>,
    /// Decode tokens/s of the largest batch over batch 1's, when both ran.
    pub batch_speedup: Option<f64>,
    /// On a GPU: its measured limits, same run.
    pub device_limits: Option<DeviceLimits>,
    /// On a GPU: device memory of the largest batch's engine: weights, KV arena, workspace
    /// (bytes).
    pub device_memory: Option<[usize; 3]>,
}

/// The round trip of one cache line between two threads, ns: two threads flip a shared
/// counter in turn, 20,000 times, the median of three runs (`None` with fewer than two CPUs).
///
/// A VM's host places its vCPUs as it likes: on one core complex (one memory link, a shared L3)
/// at times, on two at others. On the 2-vCPU Zen 4 this was written on, the round trip was
/// 70–160 ns while two threads read memory at 22–30 GB/s, and 330–340 ns while they read at
/// 34–39: the second placement reads faster and hands work between threads at half the speed,
/// which a small model's decode step (a hundred-odd hand-offs) feels more. The bench prints it
/// beside each batch so that a run says which placement its figures had.
pub fn handoff_round_trip_ns() -> Option<f64> {
    use std::sync::atomic::{AtomicU64, Ordering};
    if std::thread::available_parallelism().map_or(true, |n| n.get() < 2) {
        return None;
    }
    const TRIPS: u64 = 20_000;
    // Waits for `counter` to reach `want`; yields the CPU now and then, so that a host that
    // runs both threads on one CPU still finishes (slowly: the figure then says so).
    fn wait(counter: &AtomicU64, want: u64) {
        let mut spins = 0u32;
        while counter.load(Ordering::Acquire) != want {
            spins += 1;
            if spins.is_multiple_of(1 << 14) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
    let mut runs: Vec<f64> = (0..3)
        .map(|_| {
            let counter = AtomicU64::new(0);
            std::thread::scope(|s| {
                s.spawn(|| {
                    for i in 0..TRIPS {
                        wait(&counter, 2 * i + 1);
                        counter.store(2 * i + 2, Ordering::Release);
                    }
                });
                let t = Instant::now();
                for i in 0..TRIPS {
                    counter.store(2 * i + 1, Ordering::Release);
                    wait(&counter, 2 * i + 2);
                }
                t.elapsed().as_nanos() as f64 / TRIPS as f64
            })
        })
        .collect();
    runs.sort_by(f64::total_cmp);
    Some(runs[1])
}

/// A 1 GiB buffer of floats read with all of rayon's threads: the machine's read bandwidth,
/// measurable again next to each batch (a shared machine's bandwidth moves by half within
/// minutes: a figure from the start of a long run is not the one its last batch had).
struct ReadProbe {
    buf: Vec<f32>,
}

impl ReadProbe {
    fn new() -> Self {
        use rayon::prelude::*;
        Self { buf: (0..(1usize << 30) / 4).into_par_iter().map(|i| (i % 7) as f32).collect() }
    }

    fn chunk(&self) -> usize {
        self.buf.len().div_ceil(rayon::current_num_threads() * 4)
    }

    /// GB/s summing the buffer, best of three.
    fn read_gb_s(&self) -> f64 {
        use rayon::prelude::*;
        best_of_three_gb_s(self.buf.len() * 4, || {
            let s: f32 = self.buf.par_chunks(self.chunk()).map(baton_model::gemv::sum).sum();
            std::hint::black_box(s);
        })
    }

    /// GB/s copying half the buffer into a new one (bytes copied / time), best of three.
    fn memcpy_gb_s(&self) -> f64 {
        use rayon::prelude::*;
        let (half, chunk) = (self.buf.len() / 2, self.chunk());
        let mut dst = vec![0f32; half];
        best_of_three_gb_s(half * 4, || {
            dst.par_chunks_mut(chunk).zip(self.buf[..half].par_chunks(chunk)).for_each(|(d, s)| d.copy_from_slice(s));
            std::hint::black_box(&dst);
        })
    }
}

/// `bytes` over the shortest of three runs of `run`, in GB/s.
fn best_of_three_gb_s(bytes: usize, mut run: impl FnMut()) -> f64 {
    (0..3)
        .map(|_| {
            let t = Instant::now();
            run();
            bytes as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

/// Runs the benchmark; `progress` is told what is happening.
pub fn run(config: EngineBenchConfig, progress: &mut dyn FnMut(&str)) -> Result<EngineBenchReport, EngineError> {
    progress("measuring memory bandwidth");
    let probe = ReadProbe::new();
    let memory = MemoryBandwidth {
        threads: rayon::current_num_threads(),
        read_gb_s: probe.read_gb_s(),
        memcpy_gb_s: probe.memcpy_gb_s(),
    };
    let cpu = matches!(config.device.device, ComputeDevice::Cpu | ComputeDevice::StandIn);
    // A GPU's figures are set beside its own limits: its run frees the buffer now.
    let probe = cpu.then_some(probe);
    if !cpu {
        progress("measuring the device's copy bandwidth and GEMM peak");
    }
    let device_limits = config.device.device.measure_limits()?;
    let (model, source) = match &config.model {
        Some(path) => {
            progress(&format!("loading {}", path.display()));
            (Arc::new(Checkpoint::open_on(path, config.device)?.model), path.display().to_string())
        }
        None => {
            progress("building the random-weight model");
            let random = DeviceRandomWeights(RandomWeights { seed: 7, std: 0.02 });
            (Arc::new(Model::load_on(&config.model_config(), &random, config.device)?), "random".into())
        }
    };
    let mc = model.config().clone();
    let summary = ModelSummary {
        architecture: format!("{:?}", mc.architecture),
        layers: mc.num_layers,
        hidden: mc.hidden_size,
        heads: (mc.num_heads, mc.num_kv_heads),
        vocab: mc.vocab_size,
        source,
    };
    // Parameters of the matrices (the embedding counted once, tied or not) and the norms aside.
    let per_layer = mc.hidden_size * (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim
        + mc.num_heads * mc.head_dim * mc.hidden_size
        + 3 * mc.hidden_size * mc.intermediate_size;
    let params =
        mc.num_layers * per_layer + mc.vocab_size * mc.hidden_size * (1 + usize::from(!mc.tie_word_embeddings));
    let weight_bytes = model.weight_bytes_per_step();
    let mut results = Vec::new();
    let mut device_memory = None;
    for &batch in &config.batches {
        progress(&format!(
            "batch {batch}: prefill {} tokens each, then {} decode steps",
            config.prompt_len, config.decode_steps
        ));
        // On a CPU, each batch's decode is set beside the read bandwidth measured just before
        // and just after it (the higher of the two), not the one of the run's start.
        let before = probe.as_ref().map_or(memory.read_gb_s, ReadProbe::read_gb_s);
        let limits = Limits { read_gb_s: before, device: device_limits, params };
        let (mut result, engine_memory) = run_batch(&model, &config, batch, weight_bytes, limits)?;
        if let Some(probe) = &probe {
            let read = before.max(probe.read_gb_s());
            result.read_gb_s = read;
            result.decode_fraction_of_read_bw = result.decode_weight_gb_s / read;
            result.handoff_ns = handoff_round_trip_ns();
        }
        results.push(result);
        if device_limits.is_some() {
            device_memory = Some([model.device_weight_bytes(), engine_memory.0, engine_memory.1]);
        }
    }
    let batch_speedup = match (results.first(), results.last()) {
        (Some(a), Some(b)) if results.len() > 1 && a.batch == 1 => Some(b.decode_tokens_per_s / a.decode_tokens_per_s),
        _ => None,
    };
    Ok(EngineBenchReport {
        config,
        model: summary,
        params,
        weight_bytes_per_step: weight_bytes,
        memory,
        results,
        batch_speedup,
        device_limits,
        device_memory,
    })
}

/// What a batch's figures are set beside.
#[derive(Clone, Copy)]
struct Limits {
    read_gb_s: f64,
    device: Option<DeviceLimits>,
    params: usize,
}

/// Decode steps run before the timed ones.
const WARMUP_STEPS: usize = 3;

fn run_batch(
    model: &Arc<Model>,
    config: &EngineBenchConfig,
    batch: usize,
    weight_bytes: usize,
    limits: Limits,
) -> Result<(BatchResult, (usize, usize)), EngineError> {
    let read_gb_s = limits.read_gb_s;
    let block_size = 16;
    let per_seq = (config.prompt_len + config.decode_steps + 2 * batch + 3 + WARMUP_STEPS).div_ceil(block_size);
    let engine_config = EngineConfig {
        block_size,
        num_blocks: per_seq * batch + 8,
        layout: config.layout,
        max_num_seqs: batch,
        max_batch_tokens: config.prompt_len.max(512),
        prefill_chunk: config.prompt_len.max(512),
        prefix_caching: false,
        kv_dtype: config.kv_dtype,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(model.clone(), None, engine_config)?;
    // One untimed prefill of a prompt as long first: one-off costs of a step that size (a GPU
    // sizes its workspace and pinned staging) are not the prefill's.
    let vocab = model.config().vocab_size;
    let warm = (0..config.prompt_len).map(|t| ((t * 7 + 3) % vocab) as u32).collect();
    engine.add_request(GenerationRequest {
        stop: StopParams { max_tokens: 1, ignore_eos: true, stop_strings: vec![] },
        ..GenerationRequest::new(RequestId(u64::MAX), warm)
    })?;
    while engine.has_work() {
        engine.step()?;
    }
    for i in 0..batch {
        let prompt = (0..config.prompt_len).map(|t| ((t * 31 + i * 17 + 1000) % vocab) as u32).collect();
        engine.add_request(GenerationRequest {
            // Early sequences decode while later ones prefill: leave room so none finishes
            // before the timed decode steps are over.
            stop: StopParams {
                max_tokens: config.decode_steps + 2 * batch + 2 + WARMUP_STEPS,
                ignore_eos: true,
                stop_strings: vec![],
            },
            ..GenerationRequest::new(RequestId(i as u64), prompt)
        })?;
    }
    // Prefill: until every sequence has its first token.
    let t = Instant::now();
    let mut started = std::collections::HashSet::new();
    while started.len() < batch {
        started.extend(engine.step()?.tokens.iter().map(|t| t.id));
    }
    let prefill_s = t.elapsed().as_secs_f64();
    // Untimed decode steps first: one-off costs of the batch size (a GPU captures its decode
    // step as a graph) are not per-step costs.
    for _ in 0..WARMUP_STEPS {
        engine.step()?;
    }
    // Decode: every step now computes one token of every sequence.
    let t = Instant::now();
    let mut generated = 0;
    for _ in 0..config.decode_steps {
        let out = engine.step()?;
        if out.tokens.len() != batch || out.computed_tokens != batch {
            return Err(EngineError::Internal(format!(
                "a decode step computed {} tokens, not {batch}",
                out.computed_tokens
            )));
        }
        generated += out.tokens.len();
    }
    let decode_s = t.elapsed().as_secs_f64();
    let steps_per_s = config.decode_steps as f64 / decode_s;
    let weight_gb_s = weight_bytes as f64 * steps_per_s / 1e9;
    // The KV a decode step reads: every sequence's context at the middle of the timed steps.
    let context = config.prompt_len + batch + config.decode_steps / 2;
    let kv_bytes = batch * context * engine.kv_geometry().bytes_per_token();
    let prefill_tokens = batch * config.prompt_len;
    let result = BatchResult {
        batch,
        prefill_tokens_per_s: prefill_tokens as f64 / prefill_s,
        decode_tokens_per_s: generated as f64 / decode_s,
        decode_steps_per_s: steps_per_s,
        decode_weight_gb_s: weight_gb_s,
        read_gb_s,
        decode_fraction_of_read_bw: weight_gb_s / read_gb_s,
        handoff_ns: None,
        decode_step_ms: 1e3 / steps_per_s,
        decode_roofline_ms: limits.device.map(|d| (weight_bytes + kv_bytes) as f64 / (d.copy_gb_s * 1e9) * 1e3),
        prefill_tflops: limits.device.map(|_| 2.0 * limits.params as f64 * prefill_tokens as f64 / prefill_s / 1e12),
    };
    Ok((result, engine.device_memory()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hand-off probe finishes, even beside the suite's other tests on two cores, and
    /// measures a time.
    #[test]
    fn the_hand_off_round_trip_is_a_positive_time_where_there_are_two_cpus() {
        let two = std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2);
        match handoff_round_trip_ns() {
            Some(ns) => assert!(two && ns.is_finite() && ns > 0.0, "{ns} ns"),
            None => assert!(!two),
        }
    }
}
