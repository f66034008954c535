//! The CUDA backend: the same forward pass as the CPU's (`model.rs`), on one GPU.
//!
//! - Weights live on the device in the compute type (bfloat16 by default; float16, or float32
//!   for checking the kernels against the CPU engine token for token). Hugging Face tensors are
//!   read as the CPU reads them and converted on the device; GGUF blocks are dequantized at load.
//!   A [`WeightSource`] that says its weights are random (`device_random`) has its matrices
//!   made on the device, so a benchmark's 8B-shaped model needs no 32 GB of host floats.
//! - GEMMs go to cuBLAS (`cublasGemmEx`, float32 accumulation, tensor cores for 16-bit types);
//!   everything else is a kernel of ours in `kernels.cu`, compiled by NVRTC when the model loads
//!   (for the device's own architecture: no toolkit at build time, no PTX shipped).
//! - **Attention.** Prefill chunks (a sequence with at least `TILE_MIN_ROWS` new tokens) go to
//!   `attention_tiled_async`, flash attention on the tensor cores (mma.sync, an online softmax in
//!   registers, key tiles copied asynchronously into two buffers); decode rows and short chunks
//!   to `attention`, one row a block with split-K when a step has few rows, the last split of a
//!   row merging them. [`StepPack::attention_split`] decides which rows go where, on the host.
//!   `baton check-device --kernels` checks the tiled kernels and the split merge against the
//!   plain row kernel on random data; the float32 checks vouch for the row kernel.
//! - **The KV cache.** Each engine has a [`CudaKv`]: a block-major copy of its pool's arena in
//!   device memory, with the engine's own stream, cuBLAS handle and workspace (engines sharing a
//!   model share its weights, nothing else). The pool's bookkeeping stays on the host, and so do
//!   the host arena's bytes, which every other part of Baton reads and writes (the KV server,
//!   transfers, the tiers' copier): each step writes the new tokens' keys and values through to
//!   the host arena before it returns, and a block whose host bytes were written by someone else
//!   (received KV, a swap-in) is marked stale by the engine and uploaded before a step reads it.
//!   An engine page-locks its host arena once (`cuMemHostRegister`), so the blocks a step writes
//!   whole (a prefill's) go down by DMA straight into it; the other new tokens are gathered into
//!   pinned staging and copied into place by the host. Worker processes on one host copy KV
//!   between their device arenas directly (`ipc.rs`: the arena is a CUDA virtual-memory
//!   allocation a peer imports; `--kv-export ipc` makes it a plain one, legacy CUDA IPC).
//! - **Measuring.** `--device-timing` prints where steps spent their wall time (packing,
//!   enqueueing, waiting, unpacking), `--device-profile` the GPU time of every launch by
//!   name (an event after each, graphs off: a launch shorter than the host's time to enqueue
//!   the next one shows the host's time, so short decode kernels read high). `--enforce-eager`,
//!   `--prefill-attention tiled-sync|rows` and `--pin-host-kv off` turn the fast paths off one
//!   by one to measure what each buys (`scripts/gpu-profile.sh`); [`GpuOptions`] carries them.
//!
//! The module is the one place of the crate where unsafe code is general rather than an item:
//! every kernel launch, cuBLAS call and raw copy is an FFI call on device pointers that this
//! module allocated and sized (`DevBuf`), on the stream of the [`CudaKv`] that owns the buffers.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use baton_kv::{BlockId, KvArena, KvDtype, KvLayout, KvPart};
use cudarc::cublas::{CudaBlas, sys as cublas_sys};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, sys};
use cudarc::nvrtc::CompileOptions;

use crate::config::{Activation, ModelConfig};
use crate::device::{
    ComputeDevice, ComputeDtype, DeviceLimits, DeviceOptions, GpuOptions, KvExport, PrefillAttention, StepPack,
};
use crate::error::{ModelError, Result};
use crate::kernels::rope_inv_freq;
use crate::step::{SeqStep, StepLogits};
use crate::weights::WeightSource;

mod check;
mod compile;
mod ipc;
mod kv;
mod load;
mod memory;
mod profile;
mod record;

pub use crate::device::KernelCheck;
pub use check::check_kernels;
pub(crate) use check::measure_limits;
pub use compile::compile_kernels_for;
use compile::{Kernels, Shape, check_libraries, compile};
pub use ipc::CudaBenchDevice;
pub use kv::CudaKv;
use kv::Graph;
use memory::{DevBuf, HostPinned, Pinned};
use profile::{Profile, Timing};
use record::{AttentionArgs, gemm};

/// Threads per block of the attention kernel, in warps.
const ATTENTION_WARPS: u32 = 4;
/// (row, split) pairs of attention partials the workspace holds.
const PARTIAL_ROWS: usize = 512;
/// Parts of a row the argmax's first pass splits it into (`ARGMAX_PARTS`: one warp reduces them).
const ARGMAX_PARTS: usize = 32;
/// Largest GQA group and head size the attention kernel's registers hold.
const MAX_GROUP: usize = 8;
const MAX_HEAD_DIM: usize = 256;
/// Query vectors (rows × the GQA group) and keys of one block of `attention_tiled`, as
/// `TILE_Q` and `TILE_K` in kernels.cu.
const TILE_Q: usize = 64;
const TILE_K: usize = 64;

/// Dynamic shared memory of `attention_tiled` (`async_copies`: `attention_tiled_async`): the
/// query tile, one key tile (two when the copies are asynchronous), each query's two positions.
fn tiled_smem(head_dim: usize, async_copies: bool) -> usize {
    let qk = head_dim + 8;
    let (bufs, v) = if async_copies { (2, TILE_K * qk) } else { (1, head_dim * (TILE_K + 8)) };
    (TILE_Q * qk + bufs * (TILE_K * qk + v)) * 2 + TILE_Q * 8
}

/// Which tiled prefill attention a step uses (`--prefill-attention`: `rows` none, every row one by
/// one; `1` the kernel that loads through registers; unset, the one with asynchronous copies).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tiled {
    Sync,
    Async,
}

fn err(what: impl std::fmt::Display) -> ModelError {
    ModelError::Device(what.to_string())
}

/// Element type codes of `kernels.cu` (`ACT_KIND`, `KV_KIND`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    F32 = 0,
    Bf16 = 1,
    F16 = 2,
}

impl Kind {
    fn size(self) -> usize {
        if self == Kind::F32 { 4 } else { 2 }
    }

    fn cuda_type(self) -> cublas_sys::cudaDataType {
        match self {
            Kind::F32 => cublas_sys::cudaDataType::CUDA_R_32F,
            Kind::Bf16 => cublas_sys::cudaDataType::CUDA_R_16BF,
            Kind::F16 => cublas_sys::cudaDataType::CUDA_R_16F,
        }
    }

    fn of_kv(d: KvDtype) -> Self {
        match d {
            KvDtype::F32 => Kind::F32,
            KvDtype::Bf16 => Kind::Bf16,
            KvDtype::F16 => Kind::F16,
        }
    }
}

/// A kernel argument.
#[derive(Clone, Copy)]
enum Arg {
    P(u64),
    I(i32),
    L(i64),
    F(f32),
}

/// One layer's weights on the device.
#[derive(Debug)]
struct Layer {
    input_norm: DevBuf,
    qkv: DevBuf,
    qkv_bias: Option<DevBuf>,
    qk_norm: Option<(DevBuf, DevBuf)>,
    o: DevBuf,
    post_attn_norm: Option<DevBuf>,
    mlp_norm: DevBuf,
    gate_up: DevBuf,
    down: DevBuf,
    post_mlp_norm: Option<DevBuf>,
    window: Option<usize>,
    rope: usize,
}

/// A model's weights on one GPU, and its compiled kernels.
#[derive(Debug)]
pub(crate) struct CudaModel {
    ctx: Arc<CudaContext>,
    /// The device's ordinal (`cuda:N`).
    pub(crate) ordinal: usize,
    act: Kind,
    config: ModelConfig,
    embed: DevBuf,
    /// `None`: tied to the embedding.
    lm_head: Option<DevBuf>,
    norm: DevBuf,
    layers: Vec<Layer>,
    inv_freqs: Vec<DevBuf>,
    /// Compiled kernels by KV element type (the activation type is the model's).
    kernels: Mutex<Vec<Arc<Kernels>>>,
    weight_bytes: usize,
    shape: Shape,
    /// The device's multiprocessors: how many blocks fill it.
    sms: usize,
    /// Its fast paths and measurements (`--enforce-eager`, `--prefill-attention`, ...).
    pub(crate) gpu: GpuOptions,
}

fn grid_stride(n: usize) -> (u32, u32, u32) {
    (n.div_ceil(256).clamp(1, 8192) as u32, 1, 1)
}

/// Values of a row each thread of a norm kernel holds (`NORM_PER` in kernels.cu).
const NORM_PER: usize = 16;

/// Threads for a norm of rows of `width` (at most `NORM_PER` · 1024): about eight values
/// each, so that a one-row norm (a decode step's) is many loads in flight, not a loop of them.
fn norm_threads(width: usize) -> u32 {
    debug_assert!(width <= NORM_PER * 1024);
    row_threads(width.div_ceil(8))
}

/// Threads for a kernel that walks a row of `width` values.
fn row_threads(width: usize) -> u32 {
    (width.div_ceil(32) * 32).clamp(32, 1024) as u32
}

fn launch(
    stream: &CudaStream,
    f: &CudaFunction,
    grid: (u32, u32, u32),
    block: u32,
    smem: u32,
    args: &[Arg],
) -> Result<()> {
    let mut params: Vec<*mut c_void> = args
        .iter()
        .map(|a| match a {
            Arg::P(v) => v as *const u64 as *mut c_void,
            Arg::I(v) => v as *const i32 as *mut c_void,
            Arg::L(v) => v as *const i64 as *mut c_void,
            Arg::F(v) => v as *const f32 as *mut c_void,
        })
        .collect();
    // SAFETY: `params` points into `args`, alive for the call; the arguments match the kernel's
    // parameters in kernels.cu (each call site mirrors its kernel's signature), and every
    // pointer is a live `DevBuf` of this context sized for the launch.
    unsafe {
        cudarc::driver::result::launch_kernel(
            f.cu_function(),
            grid,
            (block, 1, 1),
            smem,
            stream.cu_stream(),
            &mut params,
        )
    }
    .map_err(err)
}

/// Loads `config`'s weights from `src` onto CUDA device `ordinal`, in `dtype`.
pub(crate) fn load(
    config: &ModelConfig,
    src: &dyn WeightSource,
    ordinal: usize,
    options: DeviceOptions,
) -> Result<Box<dyn crate::backend::Backend>> {
    let mut model = CudaModel::load(config, src, ordinal, options.dtype)?;
    model.gpu = options.gpu;
    Ok(Box::new(model))
}

/// The GPU with this ordinal as `baton bench transfer` moves KV on it, its arenas exported as
/// `export` says.
pub fn bench_device(ordinal: usize, export: KvExport) -> Result<Arc<dyn baton_transfer::bench::BenchDevice>> {
    Ok(Arc::new(CudaBenchDevice::new(ordinal, export)?))
}

impl crate::backend::Backend for CudaModel {
    fn device(&self) -> ComputeDevice {
        ComputeDevice::Cuda(self.ordinal)
    }

    fn weight_bytes_per_step(&self) -> usize {
        self.weight_bytes
    }

    fn device_weight_bytes(&self) -> usize {
        self.weight_bytes_resident()
    }

    fn kv_state(
        &self,
        arena: &KvArena,
        fresh: bool,
        meter: Arc<baton_kv::CopyMeter>,
    ) -> Result<Box<dyn crate::backend::KvState>> {
        Ok(Box::new(self.new_kv(arena, fresh, meter)?))
    }

    fn forward(
        &self,
        _: &ModelConfig,
        batch: &[SeqStep<'_>],
        kv: &mut KvArena,
        state: &mut dyn crate::backend::KvState,
        layer_written: &mut (dyn FnMut(usize) + Send),
    ) -> Result<StepLogits> {
        let state = state
            .as_any_mut()
            .downcast_mut::<CudaKv>()
            .ok_or_else(|| ModelError::Device("this KV state was not made by the model's device".into()))?;
        CudaModel::forward(self, batch, kv, state, layer_written)
    }
}

impl CudaModel {
    /// Bytes of weights a step reads: every matrix once (the embedding only as the tied head).
    /// Device memory the weights take.
    pub(crate) fn weight_bytes_resident(&self) -> usize {
        let mut b = self.embed.bytes + self.norm.bytes + self.lm_head.as_ref().map_or(0, |l| l.bytes);
        for l in &self.layers {
            b += l.qkv.bytes + l.o.bytes + l.gate_up.bytes + l.down.bytes + l.input_norm.bytes + l.mlp_norm.bytes;
        }
        b
    }

    /// The kernels for a KV cache of `kv`'s type, compiled on first use.
    fn kernels_for(&self, kv: Kind) -> Result<Arc<Kernels>> {
        let mut all = self.kernels.lock().map_err(|_| err("a thread panicked while compiling kernels"))?;
        if let Some(k) = all.iter().find(|k| k.kv == kv) {
            return Ok(k.clone());
        }
        let k = Arc::new(compile(&self.ctx, self.act, kv, self.shape)?);
        all.push(k.clone());
        Ok(k)
    }

    /// An engine's device state for a host arena of this model's geometry. With `fresh`, no
    /// block is stale to begin with: every byte a step reads is then one the forward pass wrote
    /// or one the engine marked (an engine's arena starts with nothing in it); without, every
    /// block is read from the host on first use (a one-off [`crate::Model::forward`]).
    pub(crate) fn new_kv(&self, arena: &KvArena, fresh: bool, meter: Arc<baton_kv::CopyMeter>) -> Result<CudaKv> {
        let g = arena.geometry();
        if g.layers != self.config.num_layers
            || g.kv_heads != self.config.num_kv_heads
            || g.head_dim != self.config.head_dim
        {
            return Err(err("the KV arena's geometry is not this model's"));
        }
        let kv_kind = Kind::of_kv(g.dtype);
        let k = self.kernels_for(kv_kind)?;
        let stream = self.ctx.new_stream().map_err(err)?;
        let blas = CudaBlas::new(stream.clone()).map_err(err)?;
        let blocks = arena.num_blocks();
        // One block more than the pool's: the scratch block padded decode rows write to.
        // Exportable, so that peers on this host can copy to and from it device to device.
        let arena_bytes = (blocks + 1) * g.block_elems() * kv_kind.size();
        let cache = Arc::new(DevBuf::for_sharing(&self.ctx, arena_bytes, self.gpu.kv_export)?);
        let blas_workspace = DevBuf::new(&self.ctx, 32 << 20)?;
        // SAFETY: the workspace outlives the handle (both are the CudaKv's; fields drop in
        // declaration order, the handle first).
        unsafe {
            cublas_sys::cublasSetWorkspace_v2(*blas.handle(), blas_workspace.ptr as *mut c_void, blas_workspace.bytes)
        }
        .result()
        .map_err(err)?;
        let tiled = match self.gpu.prefill_attention {
            PrefillAttention::Rows => None,
            PrefillAttention::TiledSync => k.tiled_sync.then_some(Tiled::Sync),
            PrefillAttention::Auto if k.tiled_async => Some(Tiled::Async),
            PrefillAttention::Auto => k.tiled_sync.then_some(Tiled::Sync),
        }
        .map(|t| (t, TILE_Q / self.shape.group));
        // An engine's arena (`fresh`) is page-locked once, so that whole blocks go down by DMA;
        // a one-off forward's is not (registering costs time in proportion to its size).
        let block_major = arena.descriptor().dims == KvLayout::BlockMajor.dims();
        let host_pinned = if fresh && block_major && self.gpu.pin_host_kv {
            let t = std::time::Instant::now();
            match HostPinned::new(&self.ctx, arena.as_bytes()) {
                Ok(p) => {
                    tracing::debug!(
                        mib = arena.as_bytes().len() >> 20,
                        ms = t.elapsed().as_secs_f64() * 1e3,
                        "host KV arena page-locked"
                    );
                    Some(p)
                }
                Err(e) => {
                    tracing::warn!(
                        "could not page-lock the host KV arena ({e}): new KV goes to the host through staging"
                    );
                    None
                }
            }
        } else {
            None
        };
        let profile = self.gpu.profile.then(Profile::default);
        // The profiler's events need the launches one by one.
        let graphs_enabled = self.gpu.graphs && profile.is_none();
        Ok(CudaKv {
            k,
            stream,
            blas,
            cache,
            stale: vec![!fresh; blocks],
            host_stale: vec![false; blocks],
            ws: None,
            words: None,
            kv_kind,
            graphs: Vec::new(),
            graphs_enabled,
            tiled,
            scratch_block: blocks as u32,
            _blas_workspace: blas_workspace,
            pinned_up: None,
            pinned_down: None,
            timing: self.gpu.timing.then(Timing::default),
            profile,
            host_pinned,
            meter,
        })
    }

    /// One batch step: see [`crate::Model::forward_kv`].
    pub(crate) fn forward(
        &self,
        batch: &[SeqStep<'_>],
        arena: &mut KvArena,
        kv: &mut CudaKv,
        layer_written: &mut (dyn FnMut(usize) + Send),
    ) -> Result<StepLogits> {
        let started = std::time::Instant::now();
        let c = &self.config;
        let g = *arena.geometry();
        let mut pack = StepPack::new(batch, g.block_size, c.vocab_size)?;
        // A decode step (one new token and its logits per sequence) is the same launches for
        // the same batch size, reading everything that changes (ids, positions, block tables)
        // from the buffers uploaded below: it is replayed as a CUDA graph captured on its first
        // run, one launch instead of ~10 per layer, for the batch size's bucket (padded).
        let decode = pack.logit_rows.len() == pack.rows() && batch.len() == pack.rows();
        if decode && kv.graphs_enabled {
            pack.pad(StepPack::decode_bucket(pack.rows()), kv.scratch_block);
        }
        self.ctx.bind_to_thread().map_err(err)?;
        kv.upload_stale(&pack, arena)?;
        let n = pack.rows();
        let m = pack.logit_rows.len();
        let direct = kv.host_pinned.is_some();
        let (words, off) = pack.words(kv.tiled.map(|t| t.1), direct);
        kv.reserve(&self.ctx, self, n, words.len())?;
        let wptr = kv.words.as_ref().expect("reserved").ptr;
        let up = Pinned::at_least(&mut kv.pinned_up, &self.ctx, words.len() * 4)?;
        let up = up.bytes_mut(words.len() * 4);
        up.copy_from_slice(bytemuck_words(&words));
        // SAFETY: `words` fits the buffer `reserve` sized; the pinned source is not written
        // again before the step's end synchronises the stream.
        unsafe { cudarc::driver::result::memcpy_htod_async(wptr, &*up, kv.stream.cu_stream()) }.map_err(err)?;
        let t_prepare = std::time::Instant::now();
        if decode && kv.graphs_enabled {
            if let Some(graph) = kv.graphs.iter().find(|(rows, _)| *rows == n).map(|(_, g)| &g.0) {
                graph.launch().map_err(err)?;
            } else {
                kv.stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).map_err(err)?;
                let recorded = self.record(kv, &g, n, m, &off);
                let graph = kv.stream.end_capture(sys::CUgraphInstantiate_flags(0)).map_err(err);
                recorded?;
                let graph = graph?.ok_or_else(|| err("capturing a decode step produced no graph"))?;
                graph.launch().map_err(err)?;
                kv.graphs.push((n, Graph(graph)));
            }
        } else {
            self.record(kv, &g, n, m, &off)?;
        }
        let t_enqueue = std::time::Instant::now();
        // The copies down into pinned memory, one wait: each logits row's argmax, the logits
        // themselves only when a sequence wants more than its argmax, the new KV.
        let all_argmax = pack.argmax.iter().zip(&pack.ranges).all(|(&a, r)| a || r.is_empty());
        let logit_bytes = if all_argmax { 0 } else { m * c.vocab_size * 4 };
        let argmax_bytes = (m * 4).next_multiple_of(64);
        let kv_bytes = off.stage_rows_len * g.layers * 2 * g.kv_heads * g.head_dim * g.dtype.size();
        let total = logit_bytes + argmax_bytes + kv_bytes;
        let down = Pinned::at_least(&mut kv.pinned_down, &self.ctx, total)?;
        let ws = kv.ws.as_ref().expect("reserved");
        {
            let buf = down.bytes_mut(total);
            let (logits, rest) = buf.split_at_mut(logit_bytes);
            let (argmax, stage) = rest.split_at_mut(argmax_bytes);
            // SAFETY: the device buffers hold `m · vocab` floats, `m` argmaxes and `n` tokens
            // of KV of every layer; the pinned destination is read only after the
            // synchronisation below.
            unsafe {
                if logit_bytes > 0 {
                    cudarc::driver::result::memcpy_dtoh_async(logits, ws.logits.ptr, kv.stream.cu_stream())
                        .map_err(err)?;
                }
                if m > 0 {
                    cudarc::driver::result::memcpy_dtoh_async(
                        &mut argmax[..m * 4],
                        ws.argmax.ptr,
                        kv.stream.cu_stream(),
                    )
                    .map_err(err)?;
                }
                if kv_bytes > 0 {
                    kv.meter.add(baton_kv::CopyDirection::DeviceToHost, kv_bytes as u64);
                    cudarc::driver::result::memcpy_dtoh_async(stage, ws.kv_stage.ptr, kv.stream.cu_stream())
                        .map_err(err)?;
                }
            }
        }
        if direct {
            kv.copy_whole_blocks(&pack.whole_blocks, arena)?;
        }
        kv.stream.synchronize().map_err(err)?;
        let t_wait = std::time::Instant::now();
        let down = kv.pinned_down.as_ref().expect("allocated");
        let data = down.floats(logit_bytes / 4).to_vec();
        let picked = &down.bytes(logit_bytes + m * 4)[logit_bytes..];
        let argmax = pack
            .argmax
            .iter()
            .zip(&pack.ranges)
            .map(|(&a, r)| {
                (a && !r.is_empty()).then(|| {
                    let b = &picked[(r.end - 1) * 4..r.end * 4];
                    // The device's u32s, little-endian as every CUDA host is.
                    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
                })
            })
            .collect();
        let mut rows = pack.ranges.clone();
        if all_argmax {
            rows.iter_mut().for_each(|r| *r = 0..0);
        }
        write_through(&pack, &pack.staged_rows(direct), arena, &down.bytes(total)[logit_bytes + argmax_bytes..]);
        for l in 0..g.layers {
            layer_written(l);
        }
        if let Some(t) = &mut kv.timing {
            let done = std::time::Instant::now();
            let t = &mut t.kinds[usize::from(!decode)];
            t.steps += 1;
            t.prepare += t_prepare - started;
            t.enqueue += t_enqueue - t_prepare;
            t.wait += t_wait - t_enqueue;
            t.unpack += done - t_wait;
        }
        if let Some(p) = &mut kv.profile {
            p.collect(decode)?;
        }
        Ok(StepLogits { data, vocab: c.vocab_size, rows, argmax })
    }
}

/// Copies the staged rows' new keys and values, `[i][layer][K, V][kv_heads · head_dim]` in
/// `stage` for row `staged[i]`, into their slots of the host arena.
fn write_through(pack: &StepPack, staged: &[i32], arena: &mut KvArena, stage: &[u8]) {
    let g = *arena.geometry();
    let size = g.dtype.size();
    let token = g.kv_heads * g.head_dim * size;
    let desc = arena.descriptor().clone();
    let bytes = arena.as_bytes_mut();
    for (r, &row) in staged.iter().enumerate() {
        if row as usize >= pack.real_rows {
            continue; // padding: its KV went to the device's scratch block
        }
        let (b, sl) = (pack.block[row as usize] as usize, pack.slot[row as usize] as usize);
        for l in 0..g.layers {
            for (pi, part) in [KvPart::Key, KvPart::Value].into_iter().enumerate() {
                let dst = desc.offset(l, part, b, sl, 0) * size;
                let src = ((r * g.layers + l) * 2 + pi) * token;
                bytes[dst..dst + token].copy_from_slice(&stage[src..src + token]);
            }
        }
    }
}

/// The words of a step's index arrays as bytes.
fn bytemuck_words(words: &[u32]) -> &[u8] {
    // SAFETY: any `u32` slice is a valid byte slice of four times its length, same lifetime.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast(), std::mem::size_of_val(words)) }
}
