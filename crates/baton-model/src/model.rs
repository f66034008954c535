//! The decoder forward pass (Llama, Qwen2, Gemma 3) over a paged KV cache. One layer loop
//! serves every architecture; what differs (q/k norms, post norms, the MLP's activation,
//! embedding scale, per-layer sliding window and RoPE) is data in [`ModelConfig`].
//!
//! One call computes a *batch step*: any mix of sequences, each contributing a run of new tokens
//! at consecutive positions after what it already has in the cache — a whole prompt, a prefill
//! chunk, or one decode token. All new tokens are flattened into one matrix for the dense
//! layers; attention then reads each sequence's keys and values through its block table.
//! A step's interface ([`SeqStep`] in, [`StepLogits`] out) is `step.rs`'s, which every backend
//! shares.
//!
//! The CPU backend is here (`CpuModel`, and the stand-in device over it), and the one place a
//! [`ComputeDevice`] picks its backend: once a model loads ([`Model::load_on`]), and for what a
//! device is asked without a model ([`ComputeDevice::measure_limits`],
//! [`ComputeDevice::check_kernels`]). The backends implement `backend.rs`'s interface.

use std::sync::Arc;

use baton_kv::{CopyMeter, KvArena, KvGeometry, KvPart};
use candle_core::{Device, Tensor};

use crate::attention::{AttentionShape, RowPos, Widening, paged_attention};
use crate::backend::{Backend, HostKv, KvState, STAND_IN_ARENA_NAME, StandInKv};
use crate::config::{Activation, ModelConfig};
use crate::device::{ComputeDevice, ComputeDtype, DeviceLimits, DeviceOptions, KernelCheck};
use crate::device_kv::DeviceKv;
use crate::error::{ModelError, Result};
use crate::kernels::{apply_rope, gated_activation, rms_norm, rope_inv_freq, rope_tables, soft_cap};
use crate::linear::{Linear, QWeight};
use crate::pool::step_in_pool;
use crate::quant::QuantMatrix;
use crate::step::{LogitsWanted, SeqStep, StepLogits};
use crate::weights::WeightSource;

struct Layer {
    input_norm: Vec<f32>,
    qkv: Linear,
    /// Per-head RMSNorm of q and k (Gemma 3).
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    o: Linear,
    /// RMSNorm of the attention output before the residual add (Gemma 3).
    post_attn_norm: Option<Vec<f32>>,
    mlp_norm: Vec<f32>,
    mlp: Mlp,
    /// RMSNorm of the MLP output before the residual add (Gemma 3).
    post_mlp_norm: Option<Vec<f32>>,
    /// Sliding window, if the layer is local.
    window: Option<usize>,
    /// Index into [`Model::inv_freqs`].
    rope: usize,
}

/// A layer's gated MLP: `down(act(gate(h)) · up(h))`.
enum Mlp {
    /// Gate and up stacked into one layer (`[gate | up]` out), and down.
    Whole { gate_up: Linear, down: Linear },
    /// In two halves of the inner features, each its gate and up rows and down's columns over
    /// them; the halves' outputs sum. A one-row step in a pool of two threads runs each half
    /// whole on one thread ([`Mlp::forward`]).
    Halves(Box<[MlpHalf; 2]>),
}

/// Half of a [`Mlp::Halves`].
struct MlpHalf {
    gate_up: QuantMatrix,
    down: QuantMatrix,
}

impl Mlp {
    /// Halves where `gate_up` (gate rows, then up rows, `2·inner` of them) and `down` are both
    /// matrices [`crate::quant`] decodes, `inner / 2` is whole blocks, and `BATON_SPLIT_MLP`
    /// is not `0`; whole otherwise.
    fn new(gate_up: Linear, down: Linear, inner: usize) -> Self {
        static SPLIT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let split = *SPLIT.get_or_init(|| std::env::var("BATON_SPLIT_MLP").map_or(true, |v| v.trim() != "0"));
        let halves = || {
            let (gu, d) = (gate_up.blocks()?, down.blocks()?);
            let half = inner / 2;
            let one = |t: usize| {
                let f = t * half..(t + 1) * half;
                Some(MlpHalf {
                    gate_up: gu.part(&[f.clone(), inner + f.start..inner + f.end], 0..gu.cols())?,
                    down: d.part(std::slice::from_ref(&(0..d.rows())), f)?,
                })
            };
            Some(Box::new([one(0)?, one(1)?]))
        };
        match split.then(halves).flatten() {
            Some(h) => Self::Halves(h),
            None => Self::Whole { gate_up, down },
        }
    }

    /// Bytes of weights a forward pass reads.
    fn weight_bytes(&self) -> usize {
        match self {
            Self::Whole { gate_up, down } => gate_up.weight_bytes() + down.weight_bytes(),
            Self::Halves(h) => h.iter().map(|h| h.gate_up.byte_len() + h.down.byte_len()).sum(),
        }
    }

    /// The MLP of `n` rows of `h` (`[n][hidden]`).
    fn forward(&self, h: &[f32], n: usize, act: Activation) -> Result<Vec<f32>> {
        let halves = match self {
            Self::Whole { gate_up, down } => {
                let inner = down.in_features();
                return down.forward(&gated_activation(&gate_up.forward(h, n)?, inner, act), n);
            }
            Self::Halves(halves) => halves,
        };
        let hidden = halves[0].down.rows();
        let mut parts = vec![0f32; 2 * n * hidden];
        // Two halves for two threads: a larger pool takes the path below, where every product
        // is parallel inside.
        if n == 1 && crate::pool::threads_awake() && rayon::current_num_threads() == 2 {
            // A thread a half, whole: the other thread hands back `hidden` partial sums, where
            // a product a matrix would hand over half of gate_up's output and half of down's.
            crate::pool::for_each_chunk(
                &mut parts,
                hidden,
                || (),
                |_, t, out| {
                    let half = &halves[t];
                    let a = gated_activation(&half.gate_up.matvec_alone(h), half.down.cols(), act);
                    out.copy_from_slice(&half.down.matvec_alone(&a));
                },
            );
        } else {
            // Both halves at once, each product parallel inside: the pool balances the two.
            let run = |half: &MlpHalf, out: &mut [f32]| -> Result<()> {
                let a = gated_activation(&half.gate_up.matmul_xwt(h, n)?, half.down.cols(), act);
                out.copy_from_slice(&half.down.matmul_xwt(&a, n)?);
                Ok(())
            };
            let (p0, p1) = parts.split_at_mut(n * hidden);
            let (r0, r1) = rayon::join(|| run(&halves[0], p0), || run(&halves[1], p1));
            r0?;
            r1?;
        }
        let (a, b) = parts.split_at(n * hidden);
        Ok(a.iter().zip(b).map(|(a, b)| a + b).collect())
    }
}

/// The token embedding: float rows, or quantized rows decoded as they are gathered.
enum Embedding {
    Dense(Tensor),
    Quantized(QWeight),
}

impl Embedding {
    fn gather(&self, ids: Vec<u32>) -> Result<Vec<f32>> {
        match self {
            Self::Dense(t) => {
                let n = ids.len();
                let ids = Tensor::from_vec(ids, n, &Device::Cpu)?;
                Ok(t.index_select(&ids, 0)?.flatten_all()?.to_vec1()?)
            }
            Self::Quantized(q) => q.gather(&ids),
        }
    }
}

/// A loaded decoder model: its configuration and the backend it computes on, with its weights.
pub struct Model {
    config: ModelConfig,
    backend: Box<dyn Backend>,
}

/// The CPU backend's weights.
pub(crate) struct CpuModel {
    embed: Embedding,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: Linear,
    /// The distinct RoPE frequency tables the layers use.
    inv_freqs: Vec<Vec<f32>>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model").field("config", &self.config).field("device", &self.device()).finish_non_exhaustive()
    }
}

/// Loads `config`'s weights from `src` onto the backend `options` name.
fn load_backend(config: &ModelConfig, src: &dyn WeightSource, options: DeviceOptions) -> Result<Box<dyn Backend>> {
    let cpu_dtype = || match options.dtype {
        ComputeDtype::Auto | ComputeDtype::F32 => Ok(()),
        other => Err(ModelError::Device(format!(
            "the {} backend computes in float32; --dtype {other} needs --device cuda",
            options.device
        ))),
    };
    Ok(match options.device {
        ComputeDevice::Cpu => {
            cpu_dtype()?;
            Box::new(CpuModel::load(config, src)?)
        }
        ComputeDevice::StandIn => {
            cpu_dtype()?;
            Box::new(StandIn(CpuModel::load(config, src)?))
        }
        ComputeDevice::Cuda(n) => crate::cuda::load(config, src, n, options)?,
    })
}

impl ComputeDevice {
    /// Measures the device's copy bandwidth and GEMM peak; `None` for the CPU and the stand-in
    /// (whose benchmark measures the host's memory bandwidth itself). An error where the device
    /// is missing or this build has no support for it.
    pub fn measure_limits(self) -> Result<Option<DeviceLimits>> {
        match self {
            Self::Cpu | Self::StandIn => Ok(None),
            Self::Cuda(n) => crate::cuda::measure_limits(n).map(Some),
        }
    }

    /// Checks the device's fast kernels against its plain ones on random data; the CPU and the
    /// stand-in have none to check.
    pub fn check_kernels(self) -> Result<Vec<KernelCheck>> {
        match self {
            Self::Cpu | Self::StandIn => Ok(Vec::new()),
            Self::Cuda(n) => crate::cuda::check_kernels(n),
        }
    }
}

/// An RMSNorm weight, with the configuration's offset folded in.
fn norm(src: &dyn WeightSource, c: &ModelConfig, name: &str, len: usize) -> Result<Vec<f32>> {
    let mut w: Vec<f32> = src.tensor(name, &[len])?.to_vec1()?;
    if c.norm_weight_offset != 0.0 {
        w.iter_mut().for_each(|w| *w += c.norm_weight_offset);
    }
    Ok(w)
}

impl Model {
    /// Builds the model from a weight source with Hugging Face tensor names (a GGUF file
    /// through [`crate::gguf::GgufWeights`]). The configuration's options pick the
    /// architecture's tensors: q/k norms, post norms, a tied head.
    pub fn load(config: &ModelConfig, src: &dyn WeightSource) -> Result<Self> {
        Self::load_on(config, src, DeviceOptions::default())
    }

    /// [`Model::load`] onto a device: the CPU (and the stand-in device) keeps weights as stored
    /// (float32 or GGUF blocks); a GPU holds them in the compute type (GGUF blocks
    /// dequantized), and fails with [`ModelError::Device`] where there is no such device, or no
    /// `cuda` feature in this build.
    pub fn load_on(config: &ModelConfig, src: &dyn WeightSource, device: DeviceOptions) -> Result<Self> {
        Ok(Self { config: config.clone(), backend: load_backend(config, src, device)? })
    }

    /// The device the model computes on.
    pub fn device(&self) -> ComputeDevice {
        self.backend.device()
    }

    /// The name of the memfd an engine's KV arena for this model is made in
    /// ([`baton_kv::PoolConfig::device_arena_name`]).
    pub fn arena_name(&self) -> &'static str {
        self.backend.arena_name()
    }

    /// An engine's state on the model's device for its KV arena (see [`DeviceKv`]), counting
    /// the copies the device makes on `meter` (the pool's: [`baton_kv::MemPool::copy_meter`]).
    /// The arena must be new (nothing written in it yet) or the caller marks what it holds
    /// ([`DeviceKv::invalidate`]).
    pub fn device_kv(&self, arena: &KvArena, meter: &Arc<CopyMeter>) -> Result<DeviceKv> {
        Ok(DeviceKv::new(self.backend.kv_state(arena, true, Arc::clone(meter))?))
    }

    /// Device memory the weights take (0 on the CPU).
    pub fn device_weight_bytes(&self) -> usize {
        self.backend.device_weight_bytes()
    }
}

impl CpuModel {
    pub(crate) fn load(config: &ModelConfig, src: &dyn WeightSource) -> Result<Self> {
        let c = config;
        if c.layer_attention.len() != c.num_layers {
            return Err(ModelError::InvalidInput(format!(
                "the configuration describes attention for {} layers of {}",
                c.layer_attention.len(),
                c.num_layers
            )));
        }
        let (h, i, hd) = (c.hidden_size, c.intermediate_size, c.head_dim);
        let (q_out, kv_out) = (c.num_heads * hd, c.num_kv_heads * hd);
        let embed_name = "model.embed_tokens.weight";
        let embed = match src.quantized(embed_name, &[c.vocab_size, h])? {
            Some(q) => Embedding::Quantized(QWeight::new(q)?),
            None => Embedding::Dense(src.tensor(embed_name, &[c.vocab_size, h])?),
        };
        let mut inv_freqs: Vec<Vec<f32>> = Vec::new();
        let mut ropes: Vec<crate::config::RopeConfig> = Vec::new();
        let mut layers = Vec::with_capacity(c.num_layers);
        for (l, attention) in c.layer_attention.iter().enumerate() {
            let p = format!("model.layers.{l}");
            let attn =
                |name: &str, out: usize| Linear::load(src, &format!("{p}.self_attn.{name}"), out, h, c.attention_bias);
            let qkv = Linear::fuse(&[attn("q_proj", q_out)?, attn("k_proj", kv_out)?, attn("v_proj", kv_out)?])?;
            let mlp = |name: &str, out: usize, inp: usize| {
                Linear::load(src, &format!("{p}.mlp.{name}"), out, inp, c.mlp_bias)
            };
            let gate_up = Linear::fuse(&[mlp("gate_proj", i, h)?, mlp("up_proj", i, h)?])?;
            let qk_norm = if c.qk_norm {
                Some((
                    norm(src, c, &format!("{p}.self_attn.q_norm.weight"), hd)?,
                    norm(src, c, &format!("{p}.self_attn.k_norm.weight"), hd)?,
                ))
            } else {
                None
            };
            // With post norms (Gemma), `post_attention_layernorm` is the attention output's
            // norm and `pre_feedforward_layernorm` the MLP input's; without (Llama), the
            // former is the MLP input's.
            let (post_attn_norm, mlp_norm, post_mlp_norm) = if c.post_norms {
                (
                    Some(norm(src, c, &format!("{p}.post_attention_layernorm.weight"), h)?),
                    norm(src, c, &format!("{p}.pre_feedforward_layernorm.weight"), h)?,
                    Some(norm(src, c, &format!("{p}.post_feedforward_layernorm.weight"), h)?),
                )
            } else {
                (None, norm(src, c, &format!("{p}.post_attention_layernorm.weight"), h)?, None)
            };
            let rope = match ropes.iter().position(|r| *r == attention.rope) {
                Some(r) => r,
                None => {
                    ropes.push(attention.rope);
                    inv_freqs.push(rope_inv_freq(&attention.rope, hd));
                    ropes.len() - 1
                }
            };
            layers.push(Layer {
                input_norm: norm(src, c, &format!("{p}.input_layernorm.weight"), h)?,
                qkv,
                qk_norm,
                o: Linear::load(src, &format!("{p}.self_attn.o_proj"), h, q_out, false)?,
                post_attn_norm,
                mlp_norm,
                mlp: Mlp::new(gate_up, mlp("down_proj", h, i)?, i),
                post_mlp_norm,
                window: attention.window,
                rope,
            });
        }
        let lm_head = if c.tie_word_embeddings || !src.contains("lm_head.weight") {
            match &embed {
                Embedding::Dense(t) => Linear::new(t.clone(), None)?,
                Embedding::Quantized(q) => Linear::quantized(q, None)?,
            }
        } else {
            Linear::load(src, "lm_head", c.vocab_size, h, false)?
        };
        Ok(Self { embed, layers, norm: norm(src, c, "model.norm.weight", h)?, lm_head, inv_freqs })
    }

    fn weight_bytes_per_step(&self) -> usize {
        let per_layer: usize =
            self.layers.iter().map(|l| l.qkv.weight_bytes() + l.o.weight_bytes() + l.mlp.weight_bytes()).sum();
        per_layer + self.lm_head.weight_bytes()
    }
}

impl Model {
    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// KV geometry this model needs, with `block_size` tokens per block.
    pub fn kv_geometry(&self, block_size: usize) -> KvGeometry {
        KvGeometry::new(self.config.num_layers, self.config.num_kv_heads, self.config.head_dim, block_size)
    }

    /// Bytes of weights one forward pass reads (every matrix once, the embedding row aside).
    pub fn weight_bytes_per_step(&self) -> usize {
        self.backend.weight_bytes_per_step()
    }

    /// Runs one batch step: writes the new tokens' keys and values into `kv` and returns the
    /// logits each sequence asked for. On a GPU this makes a [`DeviceKv`] for the one call
    /// (uploading every block the batch reads): an engine keeps one, [`Model::forward_kv`].
    pub fn forward(&self, batch: &[SeqStep<'_>], kv: &mut KvArena) -> Result<StepLogits> {
        self.forward_layers(batch, kv, &mut |_| {})
    }

    /// [`Model::forward_layers`] with the engine's [`DeviceKv`], which a GPU computes on (the
    /// host arena `kv` receives every new token's keys and values all the same, before
    /// `layer_written` is called for each layer).
    pub fn forward_kv(
        &self,
        batch: &[SeqStep<'_>],
        kv: &mut KvArena,
        device: &mut DeviceKv,
        layer_written: &mut (dyn FnMut(usize) + Send),
    ) -> Result<StepLogits> {
        self.backend.forward(&self.config, batch, kv, device.state_mut(), layer_written)
    }

    /// [`forward`](Self::forward), calling `layer_written(l)` as soon as layer `l`'s keys and
    /// values of the step's tokens are in `kv` (before that layer's attention): from then on the
    /// step writes nothing more into layer `l`, so a caller can start sending it (layer-wise KV
    /// streaming) while the later layers compute.
    pub fn forward_layers(
        &self,
        batch: &[SeqStep<'_>],
        kv: &mut KvArena,
        layer_written: &mut (dyn FnMut(usize) + Send),
    ) -> Result<StepLogits> {
        let mut device = DeviceKv::new(self.backend.kv_state(kv, false, Arc::default())?);
        self.forward_kv(batch, kv, &mut device, layer_written)
    }
}

impl Backend for CpuModel {
    fn device(&self) -> ComputeDevice {
        ComputeDevice::Cpu
    }

    fn weight_bytes_per_step(&self) -> usize {
        CpuModel::weight_bytes_per_step(self)
    }

    fn kv_state(&self, _: &KvArena, _: bool, _: Arc<CopyMeter>) -> Result<Box<dyn KvState>> {
        Ok(Box::new(HostKv))
    }

    fn forward(
        &self,
        config: &ModelConfig,
        batch: &[SeqStep<'_>],
        kv: &mut KvArena,
        _: &mut dyn KvState,
        layer_written: &mut (dyn FnMut(usize) + Send),
    ) -> Result<StepLogits> {
        // The step runs on one of rayon's threads: its hundred-odd parallel products are then
        // forks within the pool, not a caller blocking on a condition variable each time, and
        // the pool's other threads stay awake between them (`pool`).
        step_in_pool(|| self.forward_in_pool(config, batch, kv, layer_written))
    }
}

/// The stand-in device (see [`ComputeDevice::StandIn`]): the CPU backend's weights and
/// kernels, over an arena of its own that it offers as a device arena.
pub(crate) struct StandIn(pub(crate) CpuModel);

impl Backend for StandIn {
    fn device(&self) -> ComputeDevice {
        ComputeDevice::StandIn
    }

    fn weight_bytes_per_step(&self) -> usize {
        self.0.weight_bytes_per_step()
    }

    fn arena_name(&self) -> &'static str {
        STAND_IN_ARENA_NAME
    }

    fn kv_state(&self, _: &KvArena, _: bool, _: Arc<CopyMeter>) -> Result<Box<dyn KvState>> {
        Ok(Box::new(StandInKv))
    }

    fn forward(
        &self,
        config: &ModelConfig,
        batch: &[SeqStep<'_>],
        kv: &mut KvArena,
        state: &mut dyn KvState,
        layer_written: &mut (dyn FnMut(usize) + Send),
    ) -> Result<StepLogits> {
        Backend::forward(&self.0, config, batch, kv, state, layer_written)
    }
}

impl CpuModel {
    fn forward_in_pool(
        &self,
        config: &ModelConfig,
        batch: &[SeqStep<'_>],
        kv: &mut KvArena,
        layer_written: &mut (dyn FnMut(usize) + Send),
    ) -> Result<StepLogits> {
        let c = config;
        let (hidden, head_dim) = (c.hidden_size, c.head_dim);
        let block_size = kv.geometry().block_size;
        let mut ids = Vec::new();
        let mut rows: Vec<RowPos<'_>> = Vec::new();
        for s in batch {
            s.check(block_size, c.vocab_size)?;
            ids.extend_from_slice(s.tokens);
            rows.extend((0..s.tokens.len()).map(|i| RowPos { blocks: s.blocks, pos: s.start_pos + i }));
        }
        let n = ids.len();
        if n == 0 {
            return Err(ModelError::InvalidInput("empty batch".into()));
        }
        let positions: Vec<usize> = rows.iter().map(|r| r.pos).collect();
        let tables: Vec<(Vec<f32>, Vec<f32>)> = self.inv_freqs.iter().map(|f| rope_tables(f, &positions)).collect();
        let widening = Widening::plan(&rows, kv);
        let mut x = self.embed.gather(ids)?;
        if let Some(scale) = c.embedding_scale {
            x.iter_mut().for_each(|v| *v *= scale);
        }

        let (q_width, kv_width) = (c.num_heads * head_dim, c.num_kv_heads * head_dim);
        let eps = c.rms_norm_eps;
        for (l, layer) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &layer.input_norm, eps, 0.0);
            let qkv = layer.qkv.forward(&h, n)?;
            let width = layer.qkv.out_features();
            let mut q = Vec::with_capacity(n * q_width);
            let mut k = Vec::with_capacity(n * kv_width);
            for row in qkv.chunks_exact(width) {
                q.extend_from_slice(&row[..q_width]);
                k.extend_from_slice(&row[q_width..q_width + kv_width]);
            }
            if let Some((q_norm, k_norm)) = &layer.qk_norm {
                q = rms_norm(&q, q_norm, eps, 0.0);
                k = rms_norm(&k, k_norm, eps, 0.0);
            }
            let (cos, sin) = &tables[layer.rope];
            apply_rope(&mut q, c.num_heads, head_dim, cos, sin);
            apply_rope(&mut k, c.num_kv_heads, head_dim, cos, sin);
            for (r, row) in rows.iter().enumerate() {
                let (block, slot) = (row.blocks[row.pos / block_size], row.pos % block_size);
                kv.write_token(l, KvPart::Key, block, slot, &k[r * kv_width..(r + 1) * kv_width]);
                let v = &qkv[r * width + q_width + kv_width..(r + 1) * width];
                kv.write_token(l, KvPart::Value, block, slot, v);
            }
            layer_written(l);
            let shape = AttentionShape {
                num_heads: c.num_heads,
                num_kv_heads: c.num_kv_heads,
                head_dim,
                scale: c.attention_scale(),
                window: layer.window,
            };
            let attn = paged_attention(&q, &rows, kv, l, shape, widening.as_ref());
            let mut o = layer.o.forward(&attn, n)?;
            if let Some(w) = &layer.post_attn_norm {
                o = rms_norm(&o, w, eps, 0.0);
            }
            x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);

            let h = rms_norm(&x, &layer.mlp_norm, eps, 0.0);
            let mut down = layer.mlp.forward(&h, n, c.activation)?;
            if let Some(w) = &layer.post_mlp_norm {
                down = rms_norm(&down, w, eps, 0.0);
            }
            x.iter_mut().zip(&down).for_each(|(x, d)| *x += d);
        }

        // Only the rows someone asked for go through the final norm and the output head.
        let mut picked = Vec::new();
        let mut ranges = Vec::with_capacity(batch.len());
        let mut row0 = 0;
        for s in batch {
            let start = picked.len() / hidden;
            for r in s.logit_rows() {
                picked.extend_from_slice(&x[(row0 + r) * hidden..(row0 + r + 1) * hidden]);
            }
            ranges.push(start..picked.len() / hidden);
            row0 += s.tokens.len();
        }
        let out_rows = picked.len() / hidden;
        let data = if out_rows == 0 {
            Vec::new()
        } else {
            let h = rms_norm(&picked, &self.norm, c.rms_norm_eps, 0.0);
            let mut logits = self.lm_head.forward(&h, out_rows)?;
            if let Some(cap) = c.final_logit_softcapping {
                soft_cap(&mut logits, cap);
            }
            logits
        };
        let argmax = batch
            .iter()
            .zip(&ranges)
            .map(|(s, r)| {
                (s.logits == LogitsWanted::Argmax)
                    .then(|| crate::sampling::argmax(&data[r.start * c.vocab_size..r.end * c.vocab_size]))
            })
            .collect();
        Ok(StepLogits { data, vocab: c.vocab_size, rows: ranges, argmax })
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::{GgmlDType, QTensor};

    use super::*;

    /// A `rows × cols` layer of fixed pseudo-random values quantized to `dtype`.
    fn layer(dtype: GgmlDType, rows: usize, cols: usize, seed: usize) -> Linear {
        let values: Vec<f32> =
            (0..rows * cols).map(|i| (((i + seed) * 7919 % 2003) as f32 - 1001.0) / 1001.0).collect();
        let t = Tensor::from_vec(values, (rows, cols), &Device::Cpu).expect("tensor");
        let q = QTensor::quantize(&t, dtype).expect("quantizes");
        Linear::quantized(&QWeight::new(q).expect("blocks"), None).expect("layer")
    }

    /// The MLP in halves against the whole one, in a pool of two threads and one of three:
    /// one row in a step (with two threads, a half a thread), one row outside a step, and
    /// several rows; SmolLM2's shapes in Q4_1 (the
    /// interleaved groups), Gemma 3's in Q5_0, and a K format. Only the order of down's sums
    /// differs.
    #[test]
    fn mlp_halves_match_the_whole_mlp() {
        let _alone = crate::pool::testing::WAITING_FOR_TEAM.lock().unwrap_or_else(|e| e.into_inner());
        for threads in [2, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool");
            pool.install(check_mlp_halves);
        }
    }

    fn check_mlp_halves() {
        for (dtype, hidden, inner) in
            [(GgmlDType::Q4_1, 576, 1536), (GgmlDType::Q5_0, 640, 2048), (GgmlDType::Q4K, 512, 2048)]
        {
            let gate_up =
                Linear::fuse(&[layer(dtype, inner, hidden, 1), layer(dtype, inner, hidden, 2)]).expect("fused");
            let down = layer(dtype, hidden, inner, 3);
            let whole = Mlp::Whole { gate_up: gate_up.clone(), down: down.clone() };
            let halves = Mlp::new(gate_up, down, inner);
            assert!(matches!(halves, Mlp::Halves(_)), "{dtype:?} split");
            assert_eq!(halves.weight_bytes(), whole.weight_bytes());
            for n in [1, 3] {
                let h: Vec<f32> = (0..n * hidden).map(|i| ((i * 31 % 97) as f32 - 48.0) / 40.0).collect();
                let want = whole.forward(&h, n, Activation::Silu).expect("whole");
                let mut runs = vec![halves.forward(&h, n, Activation::Silu).expect("halves")];
                if n == 1 {
                    // In a step whose other threads came (one of a few tries is, unless other
                    // tests step at the same moment every time).
                    let teamed = (0..20).find_map(|_| {
                        step_in_pool(|| {
                            crate::pool::testing::wait_for_team()
                                .then(|| halves.forward(&h, n, Activation::Silu).expect("halves in a step"))
                        })
                    });
                    runs.extend(teamed);
                }
                let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                for got in runs {
                    assert_eq!(got.len(), want.len());
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!((g - w).abs() <= 1e-4 * scale, "{dtype:?} n={n} [{i}]: {g} vs {w}");
                    }
                }
            }
        }
    }
}
