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
//! - **The KV cache.** Each engine has a [`CudaKv`]: a block-major copy of its pool's arena in
//!   device memory, with the engine's own stream, cuBLAS handle and workspace (engines sharing a
//!   model share its weights, nothing else). The pool's bookkeeping stays on the host, and so do
//!   the host arena's bytes, which every other part of Baton reads and writes (the KV server,
//!   transfers, the tiers' copier): each step writes the new tokens' keys and values through to
//!   the host arena, and a block whose host bytes were written by someone else (received KV, a
//!   swap-in) is marked stale by the engine and uploaded before a step reads it. Moving KV
//!   between GPUs without the host is the next step (issue #33).
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
use crate::device::{ComputeDtype, DeviceLimits, StepPack};
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
/// Largest GQA group and head size the attention kernel's registers hold.
const MAX_GROUP: usize = 8;
const MAX_HEAD_DIM: usize = 256;

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
    Ok(Kernels {
        kv,
        embed: f("embed")?,
        rms_norm: f("rms_norm")?,
        add_rms_norm: f("add_rms_norm")?,
        add: f("add")?,
        add_bias: f("add_bias")?,
        rope: f("rope")?,
        store_kv: f("store_kv")?,
        gather_new_kv: f("gather_new_kv")?,
        attention: f("attention")?,
        attention_combine: f("attention_combine")?,
        gated_act: f("gated_act")?,
        gather_rows: f("gather_rows")?,
        soft_cap: f("soft_cap")?,
        argmax_rows: f("argmax_rows")?,
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
    embed: CudaFunction,
    rms_norm: CudaFunction,
    add_rms_norm: CudaFunction,
    add: CudaFunction,
    add_bias: CudaFunction,
    rope: CudaFunction,
    store_kv: CudaFunction,
    gather_new_kv: CudaFunction,
    attention: CudaFunction,
    attention_combine: CudaFunction,
    gated_act: CudaFunction,
    gather_rows: CudaFunction,
    soft_cap: CudaFunction,
    argmax_rows: CudaFunction,
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

/// Where a step's time goes (`BATON_CUDA_TIMING=1`): printed when the engine's state drops.
#[derive(Debug, Default)]
struct Timing {
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

fn grid_stride(n: usize) -> (u32, u32, u32) {
    (n.div_ceil(256).clamp(1, 8192) as u32, 1, 1)
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
        let cache = DevBuf::new(&self.ctx, blocks * g.block_elems() * kv_kind.size())?;
        let blas_workspace = DevBuf::new(&self.ctx, 32 << 20)?;
        // SAFETY: the workspace outlives the handle (both are the CudaKv's; fields drop in
        // declaration order, the handle first).
        unsafe {
            cublas_sys::cublasSetWorkspace_v2(*blas.handle(), blas_workspace.ptr as *mut c_void, blas_workspace.bytes)
        }
        .result()
        .map_err(err)?;
        let graphs_enabled = std::env::var("BATON_CUDA_GRAPHS").map_or(true, |v| v != "0");
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
            _blas_workspace: blas_workspace,
            pinned_up: None,
            pinned_down: None,
            timing: std::env::var("BATON_CUDA_TIMING").is_ok_and(|v| v == "1").then(Timing::default),
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
        let pack = StepPack::new(batch, g.block_size, c.vocab_size)?;
        self.ctx.bind_to_thread().map_err(err)?;
        kv.upload_stale(&pack, arena)?;
        let n = pack.rows();
        let m = pack.logit_rows.len();
        let (words, off) = pack.words();
        kv.reserve(&self.ctx, self, n, words.len())?;
        let wptr = kv.words.as_ref().expect("reserved").ptr;
        let up = Pinned::at_least(&mut kv.pinned_up, &self.ctx, words.len() * 4)?;
        let up = up.bytes_mut(words.len() * 4);
        up.copy_from_slice(bytemuck_words(&words));
        // SAFETY: `words` fits the buffer `reserve` sized; the pinned source is not written
        // again before the step's end synchronises the stream.
        unsafe { cudarc::driver::result::memcpy_htod_async(wptr, &*up, kv.stream.cu_stream()) }.map_err(err)?;
        let t_prepare = std::time::Instant::now();
        // A decode step (one new token and its logits per sequence) is the same launches for
        // the same batch size, reading everything that changes (ids, positions, block tables)
        // from the buffers just uploaded: replay it as a CUDA graph captured on its first run,
        // one launch instead of ~10 per layer.
        let decode = m == n && batch.len() == n;
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
        let kv_bytes = n * g.layers * 2 * g.kv_heads * g.head_dim * g.dtype.size();
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
                cudarc::driver::result::memcpy_dtoh_async(stage, ws.kv_stage.ptr, kv.stream.cu_stream())
                    .map_err(err)?;
            }
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
        write_through(&pack, arena, &down.bytes(total)[logit_bytes + argmax_bytes..]);
        for l in 0..g.layers {
            layer_written(l);
        }
        if let Some(t) = &mut kv.timing {
            let done = std::time::Instant::now();
            t.steps += 1;
            t.prepare += t_prepare - started;
            t.enqueue += t_enqueue - t_prepare;
            t.wait += t_wait - t_enqueue;
            t.unpack += done - t_wait;
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
        launch(
            s,
            &k.embed,
            (n as u32, 1, 1),
            row_threads(h).min(256),
            0,
            &[Arg::P(self.embed.ptr), Arg::P(w(off.ids)), Arg::P(ws.x.ptr), Arg::I(h as i32), Arg::F(scale)],
        )?;
        let gemm = |x: u64, wt: u64, y: u64, rows: usize, out: usize, inp: usize, y_kind: Kind| {
            gemm(&kv.blas, self.act, x, wt, y, rows, out, inp, y_kind)
        };
        let norm_rows =
            |x: u64, wt: u64, out: u64, rows: usize, heads: usize, width: usize, x_stride: usize, o_stride: usize| {
                launch(
                    s,
                    &k.rms_norm,
                    (rows as u32, heads as u32, 1),
                    row_threads(width).min(256),
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
            launch(
                s,
                &k.add_rms_norm,
                (n as u32, 1, 1),
                row_threads(h).min(256),
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
        let blocks = n * c.num_kv_heads;
        let splits = if blocks >= 2 * self.sms {
            1
        } else {
            (2 * self.sms).div_ceil(blocks).min(32).min(PARTIAL_ROWS / n).max(1)
        };
        for (l, layer) in self.layers.iter().enumerate() {
            if l == 0 {
                norm_rows(ws.x.ptr, layer.input_norm.ptr, ws.h.ptr, n, 1, h, h, h)?;
            } else {
                add_norm(ws.x.ptr, ws.o.ptr, layer.input_norm.ptr, ws.h.ptr)?;
            }
            gemm(ws.h.ptr, layer.qkv.ptr, ws.qkv.ptr, n, qkv_w, h, self.act)?;
            if let Some(b) = &layer.qkv_bias {
                launch(
                    s,
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
            launch(
                s,
                &k.rope,
                (n as u32, (c.num_heads + c.num_kv_heads) as u32, 1),
                row_threads(hd / 2).min(128),
                0,
                &[
                    Arg::P(ws.qkv.ptr),
                    Arg::P(w(off.pos)),
                    Arg::P(self.inv_freqs[layer.rope].ptr),
                    Arg::I(qkv_w as i32),
                    Arg::I(hd as i32),
                ],
            )?;
            launch(
                s,
                &k.store_kv,
                (n as u32, 2, 1),
                row_threads(kv_w).min(256),
                0,
                &[
                    Arg::P(ws.qkv.ptr),
                    Arg::P(kv.cache.ptr),
                    Arg::P(w(off.block)),
                    Arg::P(w(off.slot)),
                    Arg::I(qkv_w as i32),
                    Arg::I(q_w as i32),
                    Arg::I(kv_w as i32),
                    Arg::I(l as i32),
                    Arg::I(g.layers as i32),
                    Arg::I(bs as i32),
                ],
            )?;
            launch(
                s,
                &k.attention,
                (n as u32, c.num_kv_heads as u32, splits as u32),
                (warps * 32) as u32,
                smem as u32,
                &[
                    Arg::P(ws.qkv.ptr),
                    Arg::P(ws.attn.ptr),
                    Arg::P(ws.partial.ptr),
                    Arg::P(kv.cache.ptr),
                    Arg::P(w(off.tables)),
                    Arg::P(w(off.table_start)),
                    Arg::P(w(off.pos)),
                    Arg::I(qkv_w as i32),
                    Arg::I(c.num_heads as i32),
                    Arg::I(c.num_kv_heads as i32),
                    Arg::I(l as i32),
                    Arg::I(g.layers as i32),
                    Arg::I(bs as i32),
                    Arg::I(layer.window.map_or(0, |w| w as i32)),
                    Arg::F(c.attention_scale()),
                    Arg::I(splits as i32),
                ],
            )?;
            if splits > 1 {
                launch(
                    s,
                    &k.attention_combine,
                    (n as u32, c.num_heads as u32, 1),
                    row_threads(hd),
                    0,
                    &[Arg::P(ws.partial.ptr), Arg::P(ws.attn.ptr), Arg::I(c.num_heads as i32), Arg::I(splits as i32)],
                )?;
            }
            gemm(ws.attn.ptr, layer.o.ptr, ws.o.ptr, n, h, q_w, self.act)?;
            if let Some(pn) = &layer.post_attn_norm {
                norm_rows(ws.o.ptr, pn.ptr, ws.o.ptr, n, 1, h, h, h)?;
            }
            add_norm(ws.x.ptr, ws.o.ptr, layer.mlp_norm.ptr, ws.h.ptr)?;
            gemm(ws.h.ptr, layer.gate_up.ptr, ws.gu.ptr, n, 2 * inter, h, self.act)?;
            let kind = match c.activation {
                Activation::Silu => 0,
                Activation::GeluTanh => 1,
            };
            launch(
                s,
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
            gemm(ws.act.ptr, layer.down.ptr, ws.o.ptr, n, h, inter, self.act)?;
            if let Some(pn) = &layer.post_mlp_norm {
                norm_rows(ws.o.ptr, pn.ptr, ws.o.ptr, n, 1, h, h, h)?;
            }
        }
        launch(s, &k.add, grid_stride(n * h), 256, 0, &[Arg::P(ws.x.ptr), Arg::P(ws.o.ptr), Arg::P((n * h) as u64)])?;
        if m > 0 {
            launch(
                s,
                &k.gather_rows,
                (m as u32, 1, 1),
                row_threads(h).min(256),
                0,
                &[Arg::P(ws.x.ptr), Arg::P(w(off.logit_rows)), Arg::P(ws.h.ptr), Arg::I(h as i32)],
            )?;
            norm_rows(ws.h.ptr, self.norm.ptr, ws.h.ptr, m, 1, h, h, h)?;
            let head = self.lm_head.as_ref().unwrap_or(&self.embed);
            gemm(ws.h.ptr, head.ptr, ws.logits.ptr, m, c.vocab_size, h, Kind::F32)?;
            if let Some(cap) = c.final_logit_softcapping {
                launch(
                    s,
                    &k.soft_cap,
                    grid_stride(m * c.vocab_size),
                    256,
                    0,
                    &[Arg::P(ws.logits.ptr), Arg::F(cap), Arg::P((m * c.vocab_size) as u64)],
                )?;
            }
            launch(
                s,
                &k.argmax_rows,
                (m as u32, 1, 1),
                1024,
                0,
                &[Arg::P(ws.logits.ptr), Arg::P(ws.argmax.ptr), Arg::I(c.vocab_size as i32)],
            )?;
        }
        let width = g.kv_heads * g.head_dim;
        launch(
            s,
            &k.gather_new_kv,
            (n as u32, (g.layers * 2) as u32, 1),
            row_threads(width).min(256),
            0,
            &[
                Arg::P(kv.cache.ptr),
                Arg::P(ws.kv_stage.ptr),
                Arg::P(w(off.block)),
                Arg::P(w(off.slot)),
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

/// Copies the step's new keys and values, `[row][layer][K, V][kv_heads · head_dim]` in
/// `stage`, into their slots of the host arena.
fn write_through(pack: &StepPack, arena: &mut KvArena, stage: &[u8]) {
    let g = *arena.geometry();
    let size = g.dtype.size();
    let token = g.kv_heads * g.head_dim * size;
    let desc = arena.descriptor().clone();
    let bytes = arena.as_bytes_mut();
    for r in 0..pack.rows() {
        let (b, sl) = (pack.block[r] as usize, pack.slot[r] as usize);
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
    /// Captured decode steps by batch size; they hold the workspace's and `words`' addresses,
    /// so growing either drops them.
    graphs: Vec<(usize, Graph)>,
    /// `BATON_CUDA_GRAPHS=0` turns graphs off (to measure what they save).
    graphs_enabled: bool,
    /// cuBLAS's workspace, set once, so a captured GEMM allocates nothing.
    _blas_workspace: DevBuf,
    /// Pinned staging of the index upload, and of the logits and new KV coming down.
    pinned_up: Option<Pinned>,
    pinned_down: Option<Pinned>,
    /// `BATON_CUDA_TIMING=1`: where steps spend their time, printed on drop.
    timing: Option<Timing>,
}

impl Drop for CudaKv {
    fn drop(&mut self) {
        if let Some(t) = &self.timing
            && t.steps > 0
        {
            let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3 / t.steps as f64;
            eprintln!(
                "baton cuda timing: {} steps, per step: prepare {:.3} ms, enqueue {:.3} ms, GPU and copies {:.3} ms, unpack {:.3} ms",
                t.steps,
                ms(t.prepare),
                ms(t.enqueue),
                ms(t.wait),
                ms(t.unpack)
            );
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
            [&w.x, &w.h, &w.qkv, &w.attn, &w.o, &w.gu, &w.act, &w.logits, &w.kv_stage, &w.partial, &w.argmax]
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
            if !std::mem::take(&mut self.stale[i]) {
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
