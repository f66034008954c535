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
use crate::device::{ComputeDtype, DeviceLimits, StepPack};
use crate::error::{ModelError, Result};
use crate::kernels::rope_inv_freq;
use crate::step::{SeqStep, StepLogits};
use crate::weights::WeightSource;

mod check;
mod compile;
mod ipc;
mod kv;
mod memory;
mod profile;

pub(crate) use check::measure_limits;
pub use check::{KernelCheck, check_kernels};
pub use compile::compile_kernels_for;
use compile::{Kernels, Shape, check_libraries, compile};
pub use ipc::CudaBenchDevice;
pub use kv::CudaKv;
use kv::Graph;
use memory::{DevBuf, HostPinned, Pinned};
use profile::{Profile, Timing};

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
        let cache = Arc::new(DevBuf::new(&self.ctx, (blocks + 1) * g.block_elems() * kv_kind.size())?);
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
