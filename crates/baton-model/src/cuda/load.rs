//! Loading a model onto the device: each tensor read from its `WeightSource` (dequantized
//! on the host if quantized), stored in the compute type, matrices stacked as the step reads
//! them (q, k and v as one; gate and up as one), or made on the device when the source is
//! random (`device_random`).

use super::*;

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
            gpu: GpuOptions::default(),
        })
    }
}
