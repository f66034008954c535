//! Measuring the device (copy bandwidth, GEMM peak) and checking the fast kernels against the
//! plain ones on random data.

use super::*;
use crate::device::KernelCheck;

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

/// Downloads `n` elements of a 16-bit (bfloat16) device buffer as float32.
pub(super) fn download_bf16(stream: &CudaStream, ptr: u64, n: usize) -> Result<Vec<f32>> {
    let mut raw = vec![0u16; n];
    // SAFETY: the caller's buffer holds `n` bfloat16 values.
    unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut raw, ptr, stream.cu_stream()) }.map_err(err)?;
    stream.synchronize().map_err(err)?;
    Ok(raw.into_iter().map(|v| f32::from_bits(u32::from(v) << 16)).collect())
}

pub(super) fn compare(name: String, plain: &[f32], fast: &[f32], tolerance: f32) -> KernelCheck {
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
                logits: crate::step::LogitsWanted::None,
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
