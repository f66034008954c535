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
//!   pinned staging and copied into place by the host. Moving KV between GPUs without the host
//!   is the next step (issue #33).
//! - **Measuring.** `BATON_CUDA_TIMING=1` prints where steps spent their wall time (packing,
//!   enqueueing, waiting, unpacking), `BATON_CUDA_PROFILE=1` the GPU time of every launch by
//!   name (an event after each, graphs off: a launch shorter than the host's time to enqueue
//!   the next one shows the host's time, so short decode kernels read high). `BATON_CUDA_GRAPHS=0`,
//!   `BATON_CUDA_TILED=0|1` and `BATON_CUDA_PIN_ARENA=0` turn the fast paths off one by one to
//!   measure what each buys (`scripts/gpu-profile.sh`).
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
use crate::device::{ComputeDtype, DeviceLimits, StepPack, decode_bucket};
use crate::error::{ModelError, Result};
use crate::kernels::rope_inv_freq;
use crate::model::{SeqStep, StepLogits};
use crate::weights::WeightSource;

/// The kernels' source, compiled at run time.
pub(crate) const KERNELS: &str = include_str!("kernels.cu");

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

/// Which tiled prefill attention a step uses (`BATON_CUDA_TILED`: `0` none, every row one by
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

/// The driver, NVRTC and cuBLAS are loaded at run time (cudarc's dynamic loading), and a missing
/// library is a panic there: look for each first, so `--device cuda` on a machine without them
/// is an error that says what is missing.
fn check_libraries() -> Result<()> {
    // SAFETY: only tries to open shared libraries by name.
    let (driver, nvrtc, cublas) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
            cudarc::cublas::sys::is_culib_present(),
        )
    };
    let missing: Vec<&str> =
        [(driver, "the CUDA driver (libcuda.so)"), (nvrtc, "NVRTC (libnvrtc.so)"), (cublas, "cuBLAS (libcublas.so)")]
            .into_iter()
            .filter(|(present, _)| !present)
            .map(|(_, name)| name)
            .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(err(format!(
            "--device cuda needs {}; none found on the library path (LD_LIBRARY_PATH). Is this a machine with an NVIDIA GPU and its driver?",
            missing.join(", ")
        )))
    }
}

/// The attention kernel's compile-time shape: head size and query heads per KV head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Shape {
    head_dim: usize,
    group: usize,
}

fn options(act: Kind, kv: Kind, shape: Shape, arch: String) -> CompileOptions {
    CompileOptions {
        options: vec![
            format!("-DACT_KIND={}", act as u8),
            format!("-DKV_KIND={}", kv as u8),
            format!("-DHEAD_DIM={}", shape.head_dim),
            format!("-DGROUP={}", shape.group),
            format!("--gpu-architecture={arch}"),
        ],
        ..CompileOptions::default()
    }
}

/// Compiles `kernels.cu` for `ctx`'s device.
fn compile(ctx: &Arc<CudaContext>, act: Kind, kv: Kind, shape: Shape) -> Result<Kernels> {
    let (major, minor) = ctx.compute_capability().map_err(err)?;
    let opts = options(act, kv, shape, format!("compute_{major}{minor}"));
    let ptx =
        cudarc::nvrtc::compile_ptx_with_opts(KERNELS, opts).map_err(|e| err(format!("compiling the kernels: {e}")))?;
    let module = ctx.load_module(ptx).map_err(err)?;
    let f = |name: &str| module.load_function(name).map_err(|e| err(format!("kernel {name}: {e}")));
    // The tensor-core prefill attention: 16-bit activations with KV of the same type, Ampere on,
    // where the device grants the kernel its shared memory.
    let tensor_cores = act != Kind::F32 && kv == act && shape.head_dim.is_multiple_of(16) && major >= 8;
    let attention_tiled = f("attention_tiled")?;
    let attention_tiled_async = f("attention_tiled_async")?;
    let grant = |f: &CudaFunction, async_copies: bool| {
        tensor_cores
            && f.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                tiled_smem(shape.head_dim, async_copies) as i32,
            )
            .is_ok()
    };
    let tiled_sync = grant(&attention_tiled, false);
    let tiled_async = grant(&attention_tiled_async, true);
    Ok(Kernels {
        kv,
        tiled_sync,
        tiled_async,
        attention_tiled,
        attention_tiled_async,
        embed: f("embed")?,
        rms_norm: f("rms_norm")?,
        add_rms_norm: f("add_rms_norm")?,
        add: f("add")?,
        add_bias: f("add_bias")?,
        rope_store_kv: f("rope_store_kv")?,
        gather_new_kv: f("gather_new_kv")?,
        attention: f("attention")?,

        gated_act: f("gated_act")?,
        gather_rows: f("gather_rows")?,
        soft_cap: f("soft_cap")?,
        argmax_partial: f("argmax_partial")?,
        argmax_final: f("argmax_final")?,
        fill_random: f("fill_random")?,
        from_f32: f("from_f32")?,
    })
}

/// Compiles `kernels.cu` with NVRTC for `arch` (say `compute_90`) in every combination of
/// element types, and for the attention shapes of the models Baton runs (head sizes 64, 128
/// and 256, GQA groups of 1 to 8), without a GPU: what CI checks (`tests/cuda_kernels.rs`).
/// Returns the PTX size.
pub fn compile_kernels_for(arch: &str) -> Result<usize> {
    // SAFETY: only tries to open shared libraries by name.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(err("NVRTC (libnvrtc.so) is not on the library path"));
    }
    let mut total = 0;
    let types = [Kind::F32, Kind::Bf16, Kind::F16];
    let shapes = [(16, 2), (64, 4), (64, 7), (128, 4), (128, 8), (256, 4), (256, 1)];
    let cases = types
        .iter()
        .flat_map(|&a| types.iter().map(move |&k| (a, k, Shape { head_dim: 128, group: 4 })))
        .chain(shapes.iter().map(|&(head_dim, group)| (Kind::Bf16, Kind::Bf16, Shape { head_dim, group })));
    for (act, kv, shape) in cases {
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(KERNELS, options(act, kv, shape, arch.to_owned()))
            .map_err(|e| err(format!("compiling the kernels ({act:?}, {kv:?}, {shape:?}): {e}")))?;
        total += ptx.to_src().len();
    }
    Ok(total)
}

#[derive(Debug)]
struct Kernels {
    kv: Kind,
    /// Whether `attention_tiled` and `attention_tiled_async` run for these types on this
    /// device (else each is a stub never launched).
    tiled_sync: bool,
    tiled_async: bool,
    attention_tiled: CudaFunction,
    attention_tiled_async: CudaFunction,
    embed: CudaFunction,
    rms_norm: CudaFunction,
    add_rms_norm: CudaFunction,
    add: CudaFunction,
    add_bias: CudaFunction,
    rope_store_kv: CudaFunction,
    gather_new_kv: CudaFunction,
    attention: CudaFunction,

    gated_act: CudaFunction,
    gather_rows: CudaFunction,
    soft_cap: CudaFunction,
    argmax_partial: CudaFunction,
    argmax_final: CudaFunction,
    fill_random: CudaFunction,
    from_f32: CudaFunction,
}

/// A kernel argument.
#[derive(Clone, Copy)]
enum Arg {
    P(u64),
    I(i32),
    L(i64),
    F(f32),
}

/// Device memory this module allocated, freed on drop.
#[derive(Debug)]
struct DevBuf {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

impl DevBuf {
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        ctx.bind_to_thread().map_err(err)?;
        // SAFETY: a plain allocation; a zero-byte request still gets a valid (unused) pointer.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(bytes.max(256)) }
            .map_err(|e| err(format!("allocating {} MiB of device memory: {e}", bytes >> 20)))?;
        Ok(Self { ctx: ctx.clone(), ptr, bytes })
    }

    fn at(&self, byte_offset: usize) -> u64 {
        debug_assert!(byte_offset <= self.bytes);
        self.ptr + byte_offset as u64
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from `malloc_sync` and is freed once; the owner's stream is
            // synchronised at the end of every step, so no kernel still uses it.
            let _ = unsafe { cudarc::driver::result::free_sync(self.ptr) };
        }
    }
}

/// Page-locked host memory, for the copies every step makes (the batch's indices up, logits
/// and new KV down): a pageable copy goes through the driver's own staging, synchronously and
/// chunk by chunk, which measured milliseconds a step on a virtual machine.
struct Pinned {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    bytes: usize,
}

// SAFETY: the memory is plain host memory owned by this value; the raw pointer is what makes
// the type !Send, not any thread affinity.
unsafe impl Send for Pinned {}

impl Pinned {
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        ctx.bind_to_thread().map_err(err)?;
        // SAFETY: a plain allocation of `bytes` (at least one page).
        let ptr = unsafe { cudarc::driver::result::malloc_host(bytes.max(4096), 0) }
            .map_err(|e| err(format!("allocating {} MiB of pinned host memory: {e}", bytes >> 20)))?;
        Ok(Self { ctx: ctx.clone(), ptr: ptr.cast(), bytes })
    }

    fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
        assert!(len <= self.bytes);
        // SAFETY: `ptr` holds `bytes` bytes owned by `self`, borrowed mutably here.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, len) }
    }

    fn bytes(&self, len: usize) -> &[u8] {
        assert!(len <= self.bytes);
        // SAFETY: as `bytes_mut`, borrowed shared.
        unsafe { std::slice::from_raw_parts(self.ptr, len) }
    }

    fn floats(&self, len: usize) -> &[f32] {
        assert!(len * 4 <= self.bytes);
        // SAFETY: page-aligned memory owned by `self`; any bytes are a valid `f32`.
        unsafe { std::slice::from_raw_parts(self.ptr.cast::<f32>(), len) }
    }

    /// A buffer of at least `bytes`, reallocated (contents lost) when `slot` holds less.
    fn at_least<'a>(slot: &'a mut Option<Pinned>, ctx: &Arc<CudaContext>, bytes: usize) -> Result<&'a mut Pinned> {
        if slot.as_ref().is_none_or(|p| p.bytes < bytes) {
            *slot = None;
            *slot = Some(Pinned::new(ctx, bytes.next_power_of_two())?);
        }
        Ok(slot.as_mut().expect("allocated"))
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: from `malloc_host`, freed once; the owner's copies are synchronised.
            let _ = unsafe { cudarc::driver::result::free_host(self.ptr.cast()) };
        }
    }
}

/// Where a step's time goes (`BATON_CUDA_TIMING=1`), decode steps and the others (prefill
/// and mixed) apart: printed when the engine's state drops.
#[derive(Debug, Default)]
struct Timing {
    /// `[decode, other]`.
    kinds: [StepTimes; 2],
}

#[derive(Debug, Default)]
struct StepTimes {
    steps: u64,
    /// Packing, stale uploads, the index upload.
    prepare: std::time::Duration,
    /// Enqueueing the kernels (or launching the graph).
    enqueue: std::time::Duration,
    /// Waiting for the GPU and the logits' and KV's copies down.
    wait: std::time::Duration,
    /// Copying logits and KV out of pinned memory into the engine's buffers.
    unpack: std::time::Duration,
}

/// Where a step's GPU time goes, launch by launch (`BATON_CUDA_PROFILE=1`, which turns CUDA
/// graphs off): an event after every launch, read back once the step has synchronised, summed by
/// kernel name and step kind, printed when the engine's state drops.
#[derive(Default)]
struct Profile {
    /// This step's events: a start, then one after each named launch.
    marks: std::sync::Mutex<Vec<(&'static str, cudarc::driver::CudaEvent)>>,
    /// `[decode, other]`: steps, and each launch's totals in first-seen order.
    totals: [(u64, Vec<LaunchTotal>); 2],
}

/// A kernel's (or GEMM's) name, total milliseconds and launches, over a profile's steps.
type LaunchTotal = (&'static str, f64, u64);

impl Profile {
    /// Reads the step's events (the stream has synchronised) into the totals.
    fn collect(&mut self, decode: bool) -> Result<()> {
        let marks = std::mem::take(&mut *self.marks.lock().map_err(|_| err("profile lock poisoned"))?);
        let (steps, totals) = &mut self.totals[usize::from(!decode)];
        *steps += 1;
        for pair in marks.windows(2) {
            let ms = f64::from(pair[0].1.elapsed_ms(&pair[1].1).map_err(err)?);
            match totals.iter_mut().find(|t| t.0 == pair[1].0) {
                Some(t) => {
                    t.1 += ms;
                    t.2 += 1;
                }
                None => totals.push((pair[1].0, ms, 1)),
            }
        }
        Ok(())
    }

    fn print(&self) {
        for (kind, (steps, totals)) in ["decode", "prefill/mixed"].iter().zip(&self.totals) {
            if *steps == 0 {
                continue;
            }
            let sum: f64 = totals.iter().map(|t| t.1).sum();
            let mut rows: Vec<_> = totals.iter().collect();
            rows.sort_by(|a, b| b.1.total_cmp(&a.1));
            eprintln!(
                "baton cuda profile: {steps} {kind} steps, {:.3} ms of GPU time a step, by launch:",
                sum / *steps as f64
            );
            for (name, ms, launches) in rows {
                eprintln!(
                    "  {name:<18} {:>9.3} ms a step {:>5.1}%  {:>6.1} launches a step, {:>8.1} us each",
                    ms / *steps as f64,
                    100.0 * ms / sum,
                    *launches as f64 / *steps as f64,
                    1e3 * ms / *launches as f64
                );
            }
        }
    }
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
}

/// Loader state: the context, a stream, the model's kernels and a float32 staging buffer.
struct Loader<'a> {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    k: Arc<Kernels>,
    act: Kind,
    src: &'a dyn WeightSource,
    random: Option<(u64, f32)>,
    bytes: usize,
}

impl Loader<'_> {
    fn launch(&self, f: &CudaFunction, grid: (u32, u32, u32), block: u32, smem: u32, args: &[Arg]) -> Result<()> {
        launch(&self.stream, f, grid, block, smem, args)
    }

    /// Host float32 values of a tensor (dequantized if the source holds it quantized).
    fn host(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let t = match self.src.quantized(name, shape)? {
            Some(q) => q.dequantize(&candle_core::Device::Cpu)?,
            None => self.src.tensor(name, shape)?,
        };
        Ok(t.flatten_all()?.to_vec1()?)
    }

    /// float32 values on the device (norms, biases).
    fn f32s(&mut self, values: &[f32]) -> Result<DevBuf> {
        let buf = DevBuf::new(&self.ctx, values.len() * 4)?;
        // SAFETY: `buf` holds `values.len()` floats.
        unsafe { cudarc::driver::result::memcpy_htod_sync(buf.ptr, values) }.map_err(err)?;
        Ok(buf)
    }

    /// Matrices stacked by rows into one buffer of the compute type.
    fn matrix(&mut self, parts: &[(&str, usize)], cols: usize) -> Result<DevBuf> {
        let rows: usize = parts.iter().map(|p| p.1).sum();
        let size = self.act.size();
        let buf = DevBuf::new(&self.ctx, rows * cols * size)?;
        self.bytes += rows * cols * size;
        let mut row0 = 0;
        for &(name, r) in parts {
            let n = r * cols;
            let dst = buf.at(row0 * cols * size);
            match self.random {
                Some((seed, std)) => {
                    let seed = name
                        .bytes()
                        .fold(seed ^ 0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
                    let k = self.k.clone();
                    self.launch(
                        &k.fill_random,
                        grid_stride(n),
                        256,
                        0,
                        &[Arg::P(dst), Arg::P(n as u64), Arg::P(seed), Arg::F(std)],
                    )?;
                }
                None => {
                    let host = self.host(name, &[r, cols])?;
                    self.upload_converted(&host, dst)?;
                }
            }
            row0 += r;
        }
        Ok(buf)
    }

    /// Uploads float32 values and stores them at `dst` in the compute type.
    fn upload_converted(&mut self, host: &[f32], dst: u64) -> Result<()> {
        if self.act == Kind::F32 {
            // SAFETY: the caller sized `dst` for `host`.
            return unsafe { cudarc::driver::result::memcpy_htod_sync(dst, host) }.map_err(err);
        }
        let staging = DevBuf::new(&self.ctx, host.len() * 4)?;
        // SAFETY: `staging` holds `host.len()` floats.
        unsafe { cudarc::driver::result::memcpy_htod_sync(staging.ptr, host) }.map_err(err)?;
        let k = self.k.clone();
        self.launch(
            &k.from_f32,
            grid_stride(host.len()),
            256,
            0,
            &[Arg::P(staging.ptr), Arg::P(dst), Arg::P(host.len() as u64)],
        )?;
        self.stream.synchronize().map_err(err)
    }

    fn norm(&mut self, name: &str, len: usize, offset: f32) -> Result<DevBuf> {
        let mut w = self.src.tensor(name, &[len])?.to_vec1::<f32>()?;
        if offset != 0.0 {
            w.iter_mut().for_each(|w| *w += offset);
        }
        self.f32s(&w)
    }
}

/// Whether a `BATON_CUDA_*` switch is on: unset or anything but `0`.
fn env_on(name: &str) -> bool {
    std::env::var(name).map_or(true, |v| v != "0")
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

/// What both attention kernels read and write, in one layer of one step: device pointers
/// (`rows` and `tiles` into the step's upload) and the layer's shape.
struct AttentionArgs {
    qkv: u64,
    out: u64,
    partial: u64,
    counters: u64,
    cache: u64,
    tables: u64,
    table_start: u64,
    pos: u64,
    rows: u64,
    tiles: u64,
    /// Elements of a qkv row.
    stride: usize,
    heads: usize,
    kv_heads: usize,
    layer: usize,
    layers: usize,
    block_size: usize,
    /// 0: none.
    window: usize,
    scale: f32,
}

impl AttentionArgs {
    /// The arguments both kernels end with.
    fn shape(&self) -> [Arg; 8] {
        [
            Arg::I(self.stride as i32),
            Arg::I(self.heads as i32),
            Arg::I(self.kv_heads as i32),
            Arg::I(self.layer as i32),
            Arg::I(self.layers as i32),
            Arg::I(self.block_size as i32),
            Arg::I(self.window as i32),
            Arg::F(self.scale),
        ]
    }

    /// `attention_tiled` (or `_async`) over `tiles` tiles.
    fn launch_tiled(&self, s: &CudaStream, k: &Kernels, tiled: Tiled, tiles: usize, head_dim: usize) -> Result<()> {
        let async_copies = tiled == Tiled::Async;
        let ptrs = [self.qkv, self.out, self.cache, self.tables, self.table_start, self.pos, self.tiles].map(Arg::P);
        launch(
            s,
            if async_copies { &k.attention_tiled_async } else { &k.attention_tiled },
            (tiles as u32, self.kv_heads as u32, 1),
            128,
            tiled_smem(head_dim, async_copies) as u32,
            &[&ptrs[..], &self.shape()].concat(),
        )
    }

    /// `attention` over `rows` rows in `splits` splits, `warps` warps a block with `smem` bytes
    /// of shared memory.
    fn launch_rows(
        &self,
        s: &CudaStream,
        k: &Kernels,
        rows: usize,
        splits: usize,
        warps: usize,
        smem: usize,
    ) -> Result<()> {
        let ptrs = [
            self.qkv,
            self.out,
            self.partial,
            self.counters,
            self.cache,
            self.tables,
            self.table_start,
            self.pos,
            self.rows,
        ]
        .map(Arg::P);
        launch(
            s,
            &k.attention,
            (rows as u32, self.kv_heads as u32, splits as u32),
            (warps * 32) as u32,
            smem as u32,
            &[&ptrs[..], &self.shape(), &[Arg::I(splits as i32)]].concat(),
        )
    }
}

impl CudaModel {
    /// Loads `config`'s weights from `src` onto CUDA device `ordinal`.
    pub(crate) fn load(
        config: &ModelConfig,
        src: &dyn WeightSource,
        ordinal: usize,
        dtype: ComputeDtype,
    ) -> Result<Self> {
        check_libraries()?;
        let count = CudaContext::device_count().map_err(err)?;
        if ordinal >= count.max(0) as usize {
            return Err(err(format!("no CUDA device {ordinal}: this machine has {count}")));
        }
        let ctx = CudaContext::new(ordinal).map_err(err)?;
        // One stream per engine, each synchronised at the end of its steps: cudarc's event
        // tracking between streams would only add work to every launch.
        // SAFETY: no buffer of this context is used on two streams at once (weights are only
        // read after the loader synchronised).
        unsafe { ctx.disable_event_tracking() };
        let act = match dtype {
            ComputeDtype::F32 => Kind::F32,
            ComputeDtype::F16 => Kind::F16,
            ComputeDtype::Auto | ComputeDtype::Bf16 => Kind::Bf16,
        };
        let c = config;
        let group = c.num_heads / c.num_kv_heads.max(1);
        if !c.num_heads.is_multiple_of(c.num_kv_heads.max(1))
            || group > MAX_GROUP
            || c.head_dim > MAX_HEAD_DIM
            || !c.head_dim.is_multiple_of(2)
        {
            return Err(err(format!(
                "the CUDA attention kernel takes at most {MAX_GROUP} query heads per KV head and head sizes up to {MAX_HEAD_DIM}; this model has {} heads over {} KV heads of {}",
                c.num_heads, c.num_kv_heads, c.head_dim
            )));
        }
        if c.hidden_size > NORM_PER * 1024 {
            return Err(err(format!(
                "the CUDA norm kernels take rows of at most {} values; this model's hidden size is {}",
                NORM_PER * 1024,
                c.hidden_size
            )));
        }
        let shape = Shape { head_dim: c.head_dim, group };
        let kernels = Arc::new(compile(&ctx, act, act, shape)?);
        let sms = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(err)?.max(1)
            as usize;
        let stream = ctx.new_stream().map_err(err)?;
        let mut ld =
            Loader { ctx: ctx.clone(), stream, k: kernels.clone(), act, src, random: src.device_random(), bytes: 0 };
        let (h, inter, hd) = (c.hidden_size, c.intermediate_size, c.head_dim);
        let (q_out, kv_out) = (c.num_heads * hd, c.num_kv_heads * hd);
        let off = c.norm_weight_offset;
        let embed = ld.matrix(&[("model.embed_tokens.weight", c.vocab_size)], h)?;
        let mut ropes = Vec::new();
        let mut inv_freqs = Vec::new();
        let mut layers = Vec::with_capacity(c.num_layers);
        for (l, attention) in c.layer_attention.iter().enumerate() {
            let p = format!("model.layers.{l}");
            let (q, k, v) = (
                format!("{p}.self_attn.q_proj.weight"),
                format!("{p}.self_attn.k_proj.weight"),
                format!("{p}.self_attn.v_proj.weight"),
            );
            let qkv = ld.matrix(&[(&q, q_out), (&k, kv_out), (&v, kv_out)], h)?;
            let qkv_bias = if c.attention_bias {
                let mut b = Vec::with_capacity(q_out + 2 * kv_out);
                for (name, n) in [("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)] {
                    let name = format!("{p}.self_attn.{name}.bias");
                    if src.contains(&name) {
                        b.extend(src.tensor(&name, &[n])?.to_vec1::<f32>()?);
                    } else {
                        b.extend(std::iter::repeat_n(0.0, n));
                    }
                }
                Some(ld.f32s(&b)?)
            } else {
                None
            };
            if c.mlp_bias {
                return Err(err("the CUDA backend does not run MLP biases yet"));
            }
            let qk_norm = if c.qk_norm {
                Some((
                    ld.norm(&format!("{p}.self_attn.q_norm.weight"), hd, off)?,
                    ld.norm(&format!("{p}.self_attn.k_norm.weight"), hd, off)?,
                ))
            } else {
                None
            };
            let (post_attn_norm, mlp_norm, post_mlp_norm) = if c.post_norms {
                (
                    Some(ld.norm(&format!("{p}.post_attention_layernorm.weight"), h, off)?),
                    ld.norm(&format!("{p}.pre_feedforward_layernorm.weight"), h, off)?,
                    Some(ld.norm(&format!("{p}.post_feedforward_layernorm.weight"), h, off)?),
                )
            } else {
                (None, ld.norm(&format!("{p}.post_attention_layernorm.weight"), h, off)?, None)
            };
            let rope = match ropes.iter().position(|r| *r == attention.rope) {
                Some(r) => r,
                None => {
                    ropes.push(attention.rope);
                    inv_freqs.push(ld.f32s(&rope_inv_freq(&attention.rope, hd))?);
                    ropes.len() - 1
                }
            };
            let (gate, up, down) = (
                format!("{p}.mlp.gate_proj.weight"),
                format!("{p}.mlp.up_proj.weight"),
                format!("{p}.mlp.down_proj.weight"),
            );
            layers.push(Layer {
                input_norm: ld.norm(&format!("{p}.input_layernorm.weight"), h, off)?,
                qkv,
                qkv_bias,
                qk_norm,
                o: ld.matrix(&[(&format!("{p}.self_attn.o_proj.weight"), h)], q_out)?,
                post_attn_norm,
                mlp_norm,
                gate_up: ld.matrix(&[(&gate, inter), (&up, inter)], h)?,
                down: ld.matrix(&[(&down, h)], inter)?,
                post_mlp_norm,
                window: attention.window,
                rope,
            });
        }
        let lm_head = if c.tie_word_embeddings || !src.contains("lm_head.weight") {
            None
        } else {
            Some(ld.matrix(&[("lm_head.weight", c.vocab_size)], h)?)
        };
        let norm = ld.norm("model.norm.weight", h, off)?;
        ld.stream.synchronize().map_err(err)?;
        let lm_bytes = if lm_head.is_some() { 0 } else { c.vocab_size * h * act.size() };
        let weight_bytes = ld.bytes + lm_bytes - c.vocab_size * h * act.size();
        Ok(Self {
            ctx,
            ordinal,
            act,
            config: c.clone(),
            embed,
            lm_head,
            norm,
            layers,
            inv_freqs,
            kernels: Mutex::new(vec![kernels]),
            weight_bytes,
            shape,
            sms,
        })
    }

    /// Bytes of weights a step reads: every matrix once (the embedding only as the tied head).
    pub(crate) fn weight_bytes_per_step(&self) -> usize {
        self.weight_bytes
    }

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
    pub(crate) fn new_kv(&self, arena: &KvArena, fresh: bool) -> Result<CudaKv> {
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
        let cache = DevBuf::new(&self.ctx, (blocks + 1) * g.block_elems() * kv_kind.size())?;
        let blas_workspace = DevBuf::new(&self.ctx, 32 << 20)?;
        // SAFETY: the workspace outlives the handle (both are the CudaKv's; fields drop in
        // declaration order, the handle first).
        unsafe {
            cublas_sys::cublasSetWorkspace_v2(*blas.handle(), blas_workspace.ptr as *mut c_void, blas_workspace.bytes)
        }
        .result()
        .map_err(err)?;
        let tiled = match std::env::var("BATON_CUDA_TILED").as_deref() {
            Ok("0") => None,
            Ok("1") => k.tiled_sync.then_some(Tiled::Sync),
            _ if k.tiled_async => Some(Tiled::Async),
            _ => k.tiled_sync.then_some(Tiled::Sync),
        }
        .map(|t| (t, TILE_Q / self.shape.group));
        // An engine's arena (`fresh`) is page-locked once, so that whole blocks go down by DMA;
        // a one-off forward's is not (registering costs time in proportion to its size).
        let block_major = arena.descriptor().dims == KvLayout::BlockMajor.dims();
        let host_pinned = if fresh && block_major && env_on("BATON_CUDA_PIN_ARENA") {
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
        let profile = std::env::var("BATON_CUDA_PROFILE").is_ok_and(|v| v == "1").then(Profile::default);
        // The profiler's events need the launches one by one.
        let graphs_enabled = env_on("BATON_CUDA_GRAPHS") && profile.is_none();
        Ok(CudaKv {
            k,
            stream,
            blas,
            cache,
            stale: vec![!fresh; blocks],
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
            timing: std::env::var("BATON_CUDA_TIMING").is_ok_and(|v| v == "1").then(Timing::default),
            profile,
            host_pinned,
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
            pack.pad(decode_bucket(pack.rows()), kv.scratch_block);
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

    /// Enqueues a step's kernels and GEMMs on `kv`'s stream, from the embedding to the logits
    /// and the new tokens' KV gathered for the host; nothing synchronises (a graph can capture
    /// it).
    fn record(
        &self,
        kv: &CudaKv,
        g: &baton_kv::KvGeometry,
        n: usize,
        m: usize,
        off: &crate::device::PackOffsets,
    ) -> Result<()> {
        let c = &self.config;
        let bs = g.block_size;
        let ws = kv.ws.as_ref().expect("reserved");
        let wbuf = kv.words.as_ref().expect("reserved");
        let w = |o: usize| wbuf.at(o * 4);
        let s = &kv.stream;
        let k = &kv.k;
        let a = self.act.size();
        let (h, hd, inter) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (q_w, kv_w) = (c.num_heads * hd, c.num_kv_heads * hd);
        let qkv_w = q_w + 2 * kv_w;
        let eps = c.rms_norm_eps;
        let scale = c.embedding_scale.unwrap_or(1.0);
        kv.mark_start()?;
        // Every launch goes through `step`, which marks it for the profiler (a no-op without).
        let step = |name: &'static str, f: &CudaFunction, grid, block, smem, args: &[Arg]| {
            launch(s, f, grid, block, smem, args)?;
            kv.mark(name)
        };
        step(
            "embed",
            &k.embed,
            (n as u32, 1, 1),
            row_threads(h).min(256),
            0,
            &[Arg::P(self.embed.ptr), Arg::P(w(off.ids)), Arg::P(ws.x.ptr), Arg::I(h as i32), Arg::F(scale)],
        )?;
        let gemm = |name: &'static str, x: u64, wt: u64, y: u64, rows: usize, out: usize, inp: usize, y_kind: Kind| {
            gemm(&kv.blas, self.act, x, wt, y, rows, out, inp, y_kind)?;
            kv.mark(name)
        };
        let norm_rows =
            |x: u64, wt: u64, out: u64, rows: usize, heads: usize, width: usize, x_stride: usize, o_stride: usize| {
                step(
                    "rms_norm",
                    &k.rms_norm,
                    (rows as u32, heads as u32, 1),
                    norm_threads(width),
                    0,
                    &[
                        Arg::P(x),
                        Arg::P(wt),
                        Arg::P(out),
                        Arg::I(width as i32),
                        Arg::L(x_stride as i64),
                        Arg::L(o_stride as i64),
                        Arg::F(eps),
                    ],
                )
            };
        let add_norm = |x: u64, d: u64, wt: u64, out: u64| {
            step(
                "add_rms_norm",
                &k.add_rms_norm,
                (n as u32, 1, 1),
                norm_threads(h),
                0,
                &[Arg::P(x), Arg::P(d), Arg::P(wt), Arg::P(out), Arg::I(h as i32), Arg::F(eps)],
            )
        };
        let group = c.num_heads / c.num_kv_heads;
        // Eight warps a block where their partials fit the default 48 KiB of shared memory.
        let warps: usize = if 8 * group * (hd + 2) * 4 <= 48 << 10 { 8 } else { ATTENTION_WARPS as usize };
        let smem = warps * group * (hd + 2) * 4;
        // Split-K: enough blocks for two waves over the multiprocessors (decode of a small
        // batch), no more partials than the workspace holds.
        let nr = off.attn_rows_len;
        let blocks = nr.max(1) * c.num_kv_heads;
        let splits = if blocks >= 2 * self.sms {
            1
        } else {
            (2 * self.sms).div_ceil(blocks).min(32).min(PARTIAL_ROWS / nr.max(1)).max(1)
        };
        for (l, layer) in self.layers.iter().enumerate() {
            if l == 0 {
                norm_rows(ws.x.ptr, layer.input_norm.ptr, ws.h.ptr, n, 1, h, h, h)?;
            } else {
                add_norm(ws.x.ptr, ws.o.ptr, layer.input_norm.ptr, ws.h.ptr)?;
            }
            gemm("gemm qkv", ws.h.ptr, layer.qkv.ptr, ws.qkv.ptr, n, qkv_w, h, self.act)?;
            if let Some(b) = &layer.qkv_bias {
                step(
                    "add_bias",
                    &k.add_bias,
                    grid_stride(n * qkv_w),
                    256,
                    0,
                    &[Arg::P(ws.qkv.ptr), Arg::P(b.ptr), Arg::I(qkv_w as i32), Arg::P((n * qkv_w) as u64)],
                )?;
            }
            if let Some((qn, kn)) = &layer.qk_norm {
                norm_rows(ws.qkv.ptr, qn.ptr, ws.qkv.ptr, n, c.num_heads, hd, qkv_w, qkv_w)?;
                let kp = ws.qkv.at(q_w * a);
                norm_rows(kp, kn.ptr, kp, n, c.num_kv_heads, hd, qkv_w, qkv_w)?;
            }
            step(
                "rope_store_kv",
                &k.rope_store_kv,
                (n as u32, (c.num_heads + 2 * c.num_kv_heads) as u32, 1),
                row_threads(hd / 2).min(128),
                0,
                &[
                    Arg::P(ws.qkv.ptr),
                    Arg::P(w(off.pos)),
                    Arg::P(self.inv_freqs[layer.rope].ptr),
                    Arg::I(qkv_w as i32),
                    Arg::I(hd as i32),
                    Arg::I(c.num_heads as i32),
                    Arg::I(c.num_kv_heads as i32),
                    Arg::P(kv.cache.ptr),
                    Arg::P(w(off.block)),
                    Arg::P(w(off.slot)),
                    Arg::I(l as i32),
                    Arg::I(g.layers as i32),
                    Arg::I(bs as i32),
                ],
            )?;
            // Prefill chunks in tiles on the tensor cores, every other row one by one.
            let attn = AttentionArgs {
                qkv: ws.qkv.ptr,
                out: ws.attn.ptr,
                partial: ws.partial.ptr,
                counters: ws.counters.ptr,
                cache: kv.cache.ptr,
                tables: w(off.tables),
                table_start: w(off.table_start),
                pos: w(off.pos),
                rows: w(off.attn_rows),
                tiles: w(off.tiles),
                stride: qkv_w,
                heads: c.num_heads,
                kv_heads: c.num_kv_heads,
                layer: l,
                layers: g.layers,
                block_size: bs,
                window: layer.window.unwrap_or(0),
                scale: c.attention_scale(),
            };
            if let Some((tiled, _)) = kv.tiled
                && off.tiles_len > 0
            {
                attn.launch_tiled(s, k, tiled, off.tiles_len, hd)?;
                kv.mark("attention_tiled")?;
            }
            if nr > 0 {
                attn.launch_rows(s, k, nr, splits, warps, smem)?;
                kv.mark("attention")?;
            }
            gemm("gemm o", ws.attn.ptr, layer.o.ptr, ws.o.ptr, n, h, q_w, self.act)?;
            if let Some(pn) = &layer.post_attn_norm {
                norm_rows(ws.o.ptr, pn.ptr, ws.o.ptr, n, 1, h, h, h)?;
            }
            add_norm(ws.x.ptr, ws.o.ptr, layer.mlp_norm.ptr, ws.h.ptr)?;
            gemm("gemm gate_up", ws.h.ptr, layer.gate_up.ptr, ws.gu.ptr, n, 2 * inter, h, self.act)?;
            let kind = match c.activation {
                Activation::Silu => 0,
                Activation::GeluTanh => 1,
            };
            step(
                "gated_act",
                &k.gated_act,
                grid_stride(n * inter),
                256,
                0,
                &[
                    Arg::P(ws.gu.ptr),
                    Arg::P(ws.act.ptr),
                    Arg::I(inter as i32),
                    Arg::P((n * inter) as u64),
                    Arg::I(kind),
                ],
            )?;
            gemm("gemm down", ws.act.ptr, layer.down.ptr, ws.o.ptr, n, h, inter, self.act)?;
            if let Some(pn) = &layer.post_mlp_norm {
                norm_rows(ws.o.ptr, pn.ptr, ws.o.ptr, n, 1, h, h, h)?;
            }
        }
        step("add", &k.add, grid_stride(n * h), 256, 0, &[Arg::P(ws.x.ptr), Arg::P(ws.o.ptr), Arg::P((n * h) as u64)])?;
        if m > 0 {
            step(
                "gather_rows",
                &k.gather_rows,
                (m as u32, 1, 1),
                row_threads(h).min(256),
                0,
                &[Arg::P(ws.x.ptr), Arg::P(w(off.logit_rows)), Arg::P(ws.h.ptr), Arg::I(h as i32)],
            )?;
            norm_rows(ws.h.ptr, self.norm.ptr, ws.h.ptr, m, 1, h, h, h)?;
            let head = self.lm_head.as_ref().unwrap_or(&self.embed);
            gemm("gemm lm_head", ws.h.ptr, head.ptr, ws.logits.ptr, m, c.vocab_size, h, Kind::F32)?;
            if let Some(cap) = c.final_logit_softcapping {
                step(
                    "soft_cap",
                    &k.soft_cap,
                    grid_stride(m * c.vocab_size),
                    256,
                    0,
                    &[Arg::P(ws.logits.ptr), Arg::F(cap), Arg::P((m * c.vocab_size) as u64)],
                )?;
            }
            step(
                "argmax_partial",
                &k.argmax_partial,
                (m as u32, ARGMAX_PARTS as u32, 1),
                256,
                0,
                &[Arg::P(ws.logits.ptr), Arg::P(ws.argmax_partial.ptr), Arg::I(c.vocab_size as i32)],
            )?;
            step(
                "argmax_final",
                &k.argmax_final,
                (m as u32, 1, 1),
                ARGMAX_PARTS as u32,
                0,
                &[Arg::P(ws.argmax_partial.ptr), Arg::P(ws.argmax.ptr)],
            )?;
        }
        let width = g.kv_heads * g.head_dim;
        if off.stage_rows_len == 0 {
            return Ok(());
        }
        step(
            "gather_new_kv",
            &k.gather_new_kv,
            (off.stage_rows_len as u32, (g.layers * 2) as u32, 1),
            row_threads(width).min(256),
            0,
            &[
                Arg::P(kv.cache.ptr),
                Arg::P(ws.kv_stage.ptr),
                Arg::P(w(off.block)),
                Arg::P(w(off.slot)),
                Arg::P(w(off.stage_rows)),
                Arg::I(width as i32),
                Arg::I(g.layers as i32),
                Arg::I(bs as i32),
            ],
        )
    }
}

/// `y[rows][out] = x[rows][inp] · wᵀ`, `w` row-major `[out][inp]` (the checkpoint's layout).
#[allow(clippy::too_many_arguments)]
fn gemm(
    blas: &CudaBlas,
    act: Kind,
    x: u64,
    w: u64,
    y: u64,
    rows: usize,
    out: usize,
    inp: usize,
    y_kind: Kind,
) -> Result<()> {
    // Column-major view: yᵀ (out × rows) = w (as inp × out, transposed) · xᵀ (inp × rows).
    let (alpha, beta) = (1f32, 0f32);
    // SAFETY: the buffers hold the matrices the dimensions describe (the caller's workspace and
    // this model's weights), all on the handle's stream.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            cublas_sys::cublasOperation_t::CUBLAS_OP_T,
            cublas_sys::cublasOperation_t::CUBLAS_OP_N,
            out as i32,
            rows as i32,
            inp as i32,
            &alpha as *const f32 as *const c_void,
            w as *const c_void,
            act.cuda_type(),
            inp as i32,
            x as *const c_void,
            act.cuda_type(),
            inp as i32,
            &beta as *const f32 as *const c_void,
            y as *mut c_void,
            y_kind.cuda_type(),
            out as i32,
            cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(err)
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

/// A step's activations, sized for `rows` new tokens.
#[derive(Debug)]
struct Workspace {
    rows: usize,
    x: DevBuf,
    h: DevBuf,
    qkv: DevBuf,
    attn: DevBuf,
    o: DevBuf,
    gu: DevBuf,
    act: DevBuf,
    logits: DevBuf,
    kv_stage: DevBuf,
    /// Each logits row's argmax.
    argmax: DevBuf,
    /// Its first pass: `ARGMAX_PARTS` (value, index) pairs a row.
    argmax_partial: DevBuf,
    /// Split-K attention's count of splits done per (row, KV head), zero between launches.
    counters: DevBuf,
    /// Split-K partials of attention: [`PARTIAL_ROWS`] (row, split) pairs of every head.
    partial: DevBuf,
}

/// A captured decode step. cudarc's graph is not `Send` (it holds raw driver handles); an
/// engine, and its [`CudaKv`] with it, moves to its own thread once.
struct Graph(cudarc::driver::CudaGraph);

// SAFETY: a graph's handles are the context's, valid on any thread that binds it (every use
// does); the graph is launched and destroyed only by its `CudaKv`'s owner, one thread at a time.
unsafe impl Send for Graph {}

/// One engine's KV arena on the device, with its stream, cuBLAS handle and workspace.
pub struct CudaKv {
    k: Arc<Kernels>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// Block-major `[blocks][layers][2][block_size][kv_heads · head_dim]`.
    cache: DevBuf,
    /// Blocks whose device copy may differ from the host arena's bytes.
    stale: Vec<bool>,
    ws: Option<Workspace>,
    words: Option<DevBuf>,
    kv_kind: Kind,
    /// Captured decode steps by batch-size bucket ([`decode_bucket`]); they hold the
    /// workspace's and `words`' addresses,
    /// so growing either drops them.
    graphs: Vec<(usize, Graph)>,
    /// `BATON_CUDA_GRAPHS=0` turns graphs off (to measure what they save).
    graphs_enabled: bool,
    /// The device arena's block past the pool's, which padded decode rows write to.
    scratch_block: u32,
    /// The tiled prefill attention and the rows of its tiles (`TILE_Q` over the GQA group);
    /// `None` where no tiled kernel takes these types or `BATON_CUDA_TILED=0` turns it off.
    tiled: Option<(Tiled, usize)>,
    /// cuBLAS's workspace, set once, so a captured GEMM allocates nothing.
    _blas_workspace: DevBuf,
    /// Pinned staging of the index upload, and of the logits and new KV coming down.
    pinned_up: Option<Pinned>,
    pinned_down: Option<Pinned>,
    /// `BATON_CUDA_TIMING=1`: where steps spend their time, printed on drop.
    timing: Option<Timing>,
    /// `BATON_CUDA_PROFILE=1`: where the GPU spends a step's time, printed on drop.
    profile: Option<Profile>,
    /// The host arena, page-locked for the device (an engine's, block-major): blocks a step
    /// writes whole go down by DMA straight into it, with no staging and no host copy.
    host_pinned: Option<HostPinned>,
}

/// Host memory registered with the driver (`cuMemHostRegister`), unregistered on drop. The
/// engine drops its device state before its pool, so the memory outlives the registration.
struct HostPinned {
    ctx: Arc<CudaContext>,
    ptr: *mut c_void,
}

// SAFETY: a registration names host memory by address; it has no thread affinity.
unsafe impl Send for HostPinned {}

impl HostPinned {
    /// Registers `bytes`, or says why not.
    fn new(ctx: &Arc<CudaContext>, bytes: &[u8]) -> Result<Self> {
        ctx.bind_to_thread().map_err(err)?;
        let ptr = bytes.as_ptr() as *mut c_void;
        // SAFETY: `bytes` is live host memory of this length; registration only pins it (the
        // driver writes it only through copies this module enqueues).
        unsafe { sys::cuMemHostRegister_v2(ptr, bytes.len(), sys::CU_MEMHOSTREGISTER_PORTABLE) }
            .result()
            .map_err(err)?;
        Ok(Self { ctx: ctx.clone(), ptr })
    }
}

impl Drop for HostPinned {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: registered by `new`, unregistered once; the owner's copies are synchronised.
            let _ = unsafe { sys::cuMemHostUnregister(self.ptr) };
        }
    }
}

impl Drop for CudaKv {
    fn drop(&mut self) {
        if let Some(t) = &self.timing {
            for (kind, t) in ["decode", "prefill/mixed"].iter().zip(&t.kinds) {
                if t.steps == 0 {
                    continue;
                }
                let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3 / t.steps as f64;
                eprintln!(
                    "baton cuda timing: {} {kind} steps, per step: prepare {:.3} ms, enqueue {:.3} ms, GPU and copies {:.3} ms, unpack {:.3} ms",
                    t.steps,
                    ms(t.prepare),
                    ms(t.enqueue),
                    ms(t.wait),
                    ms(t.unpack)
                );
            }
        }
        if let Some(p) = &self.profile {
            p.print();
        }
    }
}

impl std::fmt::Debug for CudaKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaKv")
            .field("cache_bytes", &self.cache.bytes)
            .field("kv", &self.kv_kind)
            .finish_non_exhaustive()
    }
}

impl CudaKv {
    /// Starts a profiled step's events (a no-op unless profiling).
    fn mark_start(&self) -> Result<()> {
        self.mark("start")
    }

    /// Records an event after the launch just enqueued, named for the profiler (a no-op unless
    /// profiling).
    fn mark(&self, name: &'static str) -> Result<()> {
        let Some(p) = &self.profile else { return Ok(()) };
        let event = self.stream.context().new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(err)?;
        event.record(&self.stream).map_err(err)?;
        p.marks.lock().map_err(|_| err("profile lock poisoned"))?.push((name, event));
        Ok(())
    }

    /// Enqueues the copies of `blocks` (written whole by the step just enqueued) from the device
    /// arena into the page-locked host arena, one copy a run of consecutive block ids; the
    /// step's end synchronises. Both arenas are block-major with the same geometry, so a block
    /// is at the same offset in each.
    fn copy_whole_blocks(&self, blocks: &[u32], arena: &mut KvArena) -> Result<()> {
        let block_bytes = arena.geometry().block_elems() * self.kv_kind.size();
        let bytes = arena.as_bytes_mut();
        let mut i = 0;
        while i < blocks.len() {
            let mut j = i + 1;
            while j < blocks.len() && blocks[j] == blocks[j - 1] + 1 {
                j += 1;
            }
            let (start, len) = (blocks[i] as usize * block_bytes, (j - i) * block_bytes);
            // SAFETY: blocks of both arenas; the host bytes are not read (the blocks are not
            // yet published) or freed before the stream synchronises at the step's end.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut bytes[start..start + len],
                    self.cache.at(start),
                    self.stream.cu_stream(),
                )
            }
            .map_err(err)?;
            i = j;
        }
        Ok(())
    }

    /// Marks blocks whose host bytes someone else wrote: they are uploaded before a step reads
    /// them.
    pub(crate) fn invalidate(&mut self, blocks: &[BlockId]) {
        for b in blocks {
            if let Some(s) = self.stale.get_mut(b.0 as usize) {
                *s = true;
            }
        }
    }

    /// Device memory the arena and the workspace take.
    pub(crate) fn device_bytes(&self) -> (usize, usize) {
        let ws = self.ws.as_ref().map_or(0, |w| {
            [
                &w.x,
                &w.h,
                &w.qkv,
                &w.attn,
                &w.o,
                &w.gu,
                &w.act,
                &w.logits,
                &w.kv_stage,
                &w.partial,
                &w.argmax,
                &w.argmax_partial,
                &w.counters,
            ]
            .iter()
            .map(|b| b.bytes)
            .sum()
        });
        (self.cache.bytes, ws + self.words.as_ref().map_or(0, |w| w.bytes))
    }

    /// Uploads the stale blocks this step reads.
    fn upload_stale(&mut self, pack: &StepPack, arena: &KvArena) -> Result<()> {
        let g = *arena.geometry();
        let size = g.dtype.size();
        let desc = arena.descriptor();
        let bytes = arena.as_bytes();
        let slab = g.slab_elems() * size;
        let block_major = desc.dims == KvLayout::BlockMajor.dims();
        let mut uploaded = false;
        for &b in &pack.tables {
            let i = b as usize;
            // (The scratch block, past the pool's, is never stale: nothing reads what it holds.)
            if !self.stale.get_mut(i).is_some_and(std::mem::take) {
                continue;
            }
            uploaded = true;
            if block_major {
                // The host's block is contiguous and laid out as the device's: one copy.
                let (src, len) = (desc.offset(0, KvPart::Key, i, 0, 0) * size, g.block_elems() * size);
                // SAFETY: one block inside each arena.
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(
                        self.cache.at(i * len),
                        &bytes[src..src + len],
                        self.stream.cu_stream(),
                    )
                }
                .map_err(err)?;
                continue;
            }
            for l in 0..g.layers {
                for (pi, part) in [KvPart::Key, KvPart::Value].into_iter().enumerate() {
                    let src = desc.offset(l, part, i, 0, 0) * size;
                    let dst = self.cache.at(((i * g.layers + l) * 2 + pi) * slab);
                    // SAFETY: both ranges are one slab inside their arenas.
                    unsafe {
                        cudarc::driver::result::memcpy_htod_async(dst, &bytes[src..src + slab], self.stream.cu_stream())
                    }
                    .map_err(err)?;
                }
            }
        }
        // The host bytes must stay put until the copies read them.
        if uploaded { self.stream.synchronize().map_err(err) } else { Ok(()) }
    }

    /// Grows the workspace to `rows` rows and the index buffer to `words` words.
    fn reserve(&mut self, ctx: &Arc<CudaContext>, model: &CudaModel, rows: usize, words: usize) -> Result<()> {
        if self.words.as_ref().is_none_or(|w| w.bytes < words * 4) {
            self.graphs.clear();
            self.words = Some(DevBuf::new(ctx, words.next_power_of_two() * 4)?);
        }
        if self.ws.as_ref().is_some_and(|w| w.rows >= rows) {
            return Ok(());
        }
        self.graphs.clear();
        self.ws = None;
        let rows = rows.next_power_of_two().max(16);
        let c = &model.config;
        let a = model.act.size();
        let (q_w, kv_w) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let buf = |elems: usize, size: usize| DevBuf::new(ctx, rows * elems * size);
        self.ws = Some(Workspace {
            rows,
            x: buf(c.hidden_size, a)?,
            h: buf(c.hidden_size, a)?,
            qkv: buf(q_w + 2 * kv_w, a)?,
            attn: buf(q_w, a)?,
            o: buf(c.hidden_size, a)?,
            gu: buf(2 * c.intermediate_size, a)?,
            act: buf(c.intermediate_size, a)?,
            logits: buf(c.vocab_size, 4)?,
            kv_stage: buf(c.num_layers * 2 * kv_w, self.kv_kind.size())?,
            partial: DevBuf::new(ctx, PARTIAL_ROWS * c.num_heads * (c.head_dim + 2) * 4)?,
            argmax: buf(1, 4)?,
            argmax_partial: buf(ARGMAX_PARTS, 8)?,
            counters: {
                let b = DevBuf::new(ctx, PARTIAL_ROWS * c.num_kv_heads * 4)?;
                // SAFETY: `b` holds that many bytes; the memset is synchronous.
                unsafe { cudarc::driver::result::memset_d8_sync(b.ptr, 0, b.bytes) }.map_err(err)?;
                b
            },
        });
        Ok(())
    }
}

/// Measures copy bandwidth (best of 10 copies of 2 GiB) and GEMM peak (one 8192³ bfloat16
/// GEMM through cuBLAS, float32 accumulation, mean of 10) on CUDA device `ordinal`.
pub(crate) fn measure_limits(ordinal: usize) -> Result<DeviceLimits> {
    check_libraries()?;
    let ctx = CudaContext::new(ordinal).map_err(err)?;
    // SAFETY: one stream uses these buffers.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().map_err(err)?;
    let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = ctx.new_event(timing).map_err(err)?;
        let end = ctx.new_event(timing).map_err(err)?;
        start.record(&stream).map_err(err)?;
        f()?;
        end.record(&stream).map_err(err)?;
        end.synchronize().map_err(err)?;
        Ok(f64::from(start.elapsed_ms(&end).map_err(err)?) / 1e3)
    };
    let bytes = 2usize << 30;
    let (src, dst) = (DevBuf::new(&ctx, bytes)?, DevBuf::new(&ctx, bytes)?);
    let mut best = f64::INFINITY;
    for i in 0..13 {
        let s = time(&mut || {
            // SAFETY: both buffers hold `bytes`.
            unsafe { cudarc::driver::result::memcpy_dtod_async(dst.ptr, src.ptr, bytes, stream.cu_stream()) }
                .map_err(err)
        })?;
        if i >= 3 {
            best = best.min(s);
        }
    }
    let copy_gb_s = 2.0 * bytes as f64 / best / 1e9;
    drop((src, dst));
    let n = 8192usize;
    let (a, b, c) = (DevBuf::new(&ctx, n * n * 2)?, DevBuf::new(&ctx, n * n * 2)?, DevBuf::new(&ctx, n * n * 2)?);
    let k = compile(&ctx, Kind::Bf16, Kind::Bf16, Shape { head_dim: 128, group: 4 })?;
    for buf in [&a, &b] {
        launch(
            &stream,
            &k.fill_random,
            grid_stride(n * n),
            256,
            0,
            &[Arg::P(buf.ptr), Arg::P((n * n) as u64), Arg::P(7), Arg::F(0.02)],
        )?;
    }
    let blas = CudaBlas::new(stream.clone()).map_err(err)?;
    for _ in 0..3 {
        gemm(&blas, Kind::Bf16, a.ptr, b.ptr, c.ptr, n, n, n, Kind::Bf16)?;
    }
    let s = time(&mut || {
        for _ in 0..10 {
            gemm(&blas, Kind::Bf16, a.ptr, b.ptr, c.ptr, n, n, n, Kind::Bf16)?;
        }
        Ok(())
    })?;
    let gemm_tflops = 10.0 * 2.0 * (n as f64).powi(3) / s / 1e12;
    Ok(DeviceLimits { copy_gb_s, gemm_tflops })
}

/// One case of [`check_kernels`]: a fast kernel against the plain one on the same random data.
#[derive(Debug, Clone, serde::Serialize)]
pub struct KernelCheck {
    /// What ran.
    pub name: String,
    /// Largest |fast − plain| over the outputs.
    pub max_abs_diff: f32,
    /// Largest |plain| (the scale the difference is read against).
    pub max_abs: f32,
    /// The tolerance the case is held to.
    pub tolerance: f32,
}

impl KernelCheck {
    /// Whether the difference is within the tolerance (NaN never is).
    pub fn passed(&self) -> bool {
        self.max_abs_diff <= self.tolerance
    }
}

/// Downloads `n` elements of a 16-bit (bfloat16) device buffer as float32.
fn download_bf16(stream: &CudaStream, ptr: u64, n: usize) -> Result<Vec<f32>> {
    let mut raw = vec![0u16; n];
    // SAFETY: the caller's buffer holds `n` bfloat16 values.
    unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut raw, ptr, stream.cu_stream()) }.map_err(err)?;
    stream.synchronize().map_err(err)?;
    Ok(raw.into_iter().map(|v| f32::from_bits(u32::from(v) << 16)).collect())
}

fn compare(name: String, plain: &[f32], fast: &[f32], tolerance: f32) -> KernelCheck {
    let max_abs_diff = plain
        .iter()
        .zip(fast)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, |m, d| if d.is_nan() || m.is_nan() { f32::NAN } else { m.max(d) });
    let max_abs = plain.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    KernelCheck { name, max_abs_diff, max_abs, tolerance }
}

/// Checks the fast kernels against the plain ones on random bfloat16 data, on CUDA device
/// `ordinal`: `attention_tiled` (prefill chunks on the tensor cores) against `attention` (row by
/// row, float32 inside, the kernel the float32 checks vouch for) over chunks that span several
/// tiles and key tiles, with and without a sliding window, for several head sizes and GQA groups.
/// What `baton check-device --kernels` prints.
pub fn check_kernels(ordinal: usize) -> Result<Vec<KernelCheck>> {
    check_libraries()?;
    let ctx = CudaContext::new(ordinal).map_err(err)?;
    // SAFETY: one stream uses these buffers.
    unsafe { ctx.disable_event_tracking() };
    let (major, _) = ctx.compute_capability().map_err(err)?;
    let stream = ctx.new_stream().map_err(err)?;
    let fill = |k: &Kernels, buf: &DevBuf, n: usize, seed: u64, std: f32| {
        launch(
            &stream,
            &k.fill_random,
            grid_stride(n),
            256,
            0,
            &[Arg::P(buf.ptr), Arg::P(n as u64), Arg::P(seed), Arg::F(std)],
        )
    };
    let mut checks = Vec::new();
    if major < 8 {
        return Err(err("the tiled attention kernels need compute capability 8.0 or newer"));
    }
    for (head_dim, group) in [(128, 4), (64, 1), (256, 2), (64, 7)] {
        let shape = Shape { head_dim, group };
        let k = compile(&ctx, Kind::Bf16, Kind::Bf16, shape)?;
        let (kv_heads, layers, bs) = (2usize, 2usize, 16usize);
        let heads = kv_heads * group;
        let width = kv_heads * head_dim;
        let stride = (heads + 2 * kv_heads) * head_dim;
        let num_blocks = 64usize;
        // Three prefill chunks (one spanning several tiles and key tiles, one starting at
        // position 0, one short of a tile) and two decode rows.
        let seqs: [(usize, usize); 5] = [(100, 150), (0, 37), (200, 9), (300, 1), (17, 1)];
        let tables: Vec<Vec<BlockId>> = (0..seqs.len())
            .map(|i| (0..24).map(|b| BlockId(((b * 5 + i * 11) % num_blocks) as u32)).collect())
            .collect();
        let tokens: Vec<Vec<u32>> = seqs.iter().map(|&(_, len)| vec![0; len]).collect();
        let batch: Vec<SeqStep<'_>> = seqs
            .iter()
            .zip(&tables)
            .zip(&tokens)
            .map(|((&(start, _), t), toks)| SeqStep {
                start_pos: start,
                tokens: toks,
                blocks: t,
                logits: crate::model::LogitsWanted::None,
            })
            .collect();
        let pack = StepPack::new(&batch, bs, 1)?;
        let n = pack.rows();
        let qkv = DevBuf::new(&ctx, n * stride * 2)?;
        let cache = DevBuf::new(&ctx, num_blocks * layers * 2 * bs * width * 2)?;
        fill(&k, &qkv, n * stride, 11, 1.0)?;
        fill(&k, &cache, num_blocks * layers * 2 * bs * width, 12, 1.0)?;
        for window in [0, 48] {
            let mut outs = Vec::new();
            // (tiled kernel, splits of the row kernel): the plain one first, the reference.
            for (variant, splits) in [(None, 1usize), (None, 8), (Some(Tiled::Sync), 1), (Some(Tiled::Async), 1)] {
                let available = match variant {
                    None => true,
                    Some(Tiled::Sync) => k.tiled_sync,
                    Some(Tiled::Async) => k.tiled_async,
                };
                if !available {
                    continue;
                }
                let partial = DevBuf::new(&ctx, n * heads * splits * (head_dim + 2) * 4)?;
                let counters = DevBuf::new(&ctx, n * kv_heads * 4)?;
                // SAFETY: `counters` holds that many bytes; the memset is synchronous.
                unsafe { cudarc::driver::result::memset_d8_sync(counters.ptr, 0, counters.bytes) }.map_err(err)?;
                let (words, off) = pack.words(variant.map(|_| TILE_Q / group), false);
                let wbuf = DevBuf::new(&ctx, words.len() * 4)?;
                // SAFETY: `wbuf` holds the words.
                unsafe { cudarc::driver::result::memcpy_htod_sync(wbuf.ptr, &words) }.map_err(err)?;
                let w = |o: usize| wbuf.at(o * 4);
                let out = DevBuf::new(&ctx, n * heads * head_dim * 2)?;
                // Poisoned: an output neither kernel writes shows.
                fill(&k, &out, n * heads * head_dim, 99, 100.0)?;
                let attn = AttentionArgs {
                    qkv: qkv.ptr,
                    out: out.ptr,
                    partial: partial.ptr,
                    counters: counters.ptr,
                    cache: cache.ptr,
                    tables: w(off.tables),
                    table_start: w(off.table_start),
                    pos: w(off.pos),
                    rows: w(off.attn_rows),
                    tiles: w(off.tiles),
                    stride,
                    heads,
                    kv_heads,
                    layer: 1,
                    layers,
                    block_size: bs,
                    window,
                    scale: 1.0 / (head_dim as f32).sqrt(),
                };
                if let Some(variant) = variant {
                    attn.launch_tiled(&stream, &k, variant, off.tiles_len, head_dim)?;
                }
                let warps = ATTENTION_WARPS as usize;
                attn.launch_rows(&stream, &k, off.attn_rows_len, splits, warps, warps * group * (head_dim + 2) * 4)?;
                outs.push((variant, splits, download_bf16(&stream, out.ptr, n * heads * head_dim)?));
            }
            // bfloat16 rounding of the output (1/256 of 1) and of the tiled kernel's
            // probabilities before P · V.
            for (variant, splits, fast) in &outs[1..] {
                let name = match variant {
                    Some(Tiled::Async) => "attention_tiled_async".to_owned(),
                    Some(Tiled::Sync) => "attention_tiled".to_owned(),
                    None => format!("attention in {splits} splits"),
                };
                checks.push(compare(
                    format!("{name} vs attention: head_dim {head_dim}, group {group}, window {window}, {n} rows"),
                    &outs[0].2,
                    fast,
                    0.03,
                ));
            }
        }
    }
    Ok(checks)
}
