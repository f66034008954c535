//! A step's launches: [`CudaModel::record`] enqueues the kernels and GEMMs of one batch step,
//! in order, from the embedding to the logits and the new KV staged for the host, with the
//! arguments of the two attention kernels ([`AttentionArgs`]) and the GEMM through cuBLAS.
//! Nothing here synchronises, so a decode step's launches can be captured as a graph.

use super::*;

/// What both attention kernels read and write, in one layer of one step: device pointers
/// (`rows` and `tiles` into the step's upload) and the layer's shape.
pub(super) struct AttentionArgs {
    pub(super) qkv: u64,
    pub(super) out: u64,
    pub(super) partial: u64,
    pub(super) counters: u64,
    pub(super) cache: u64,
    pub(super) tables: u64,
    pub(super) table_start: u64,
    pub(super) pos: u64,
    pub(super) rows: u64,
    pub(super) tiles: u64,
    /// Elements of a qkv row.
    pub(super) stride: usize,
    pub(super) heads: usize,
    pub(super) kv_heads: usize,
    pub(super) layer: usize,
    pub(super) layers: usize,
    pub(super) block_size: usize,
    /// 0: none.
    pub(super) window: usize,
    pub(super) scale: f32,
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
    pub(super) fn launch_tiled(
        &self,
        s: &CudaStream,
        k: &Kernels,
        tiled: Tiled,
        tiles: usize,
        head_dim: usize,
    ) -> Result<()> {
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
    pub(super) fn launch_rows(
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
    /// Enqueues a step's kernels and GEMMs on `kv`'s stream, from the embedding to the logits
    /// and the new tokens' KV gathered for the host; nothing synchronises (a graph can capture
    /// it).
    pub(super) fn record(
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
pub(super) fn gemm(
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
