//! Compiling `kernels.cu` with NVRTC for a device, and the compiled kernels.

use super::*;

/// The kernels' source, compiled at run time.
pub(crate) const KERNELS: &str = include_str!("kernels.cu");

/// The driver, NVRTC and cuBLAS are loaded at run time (cudarc's dynamic loading), and a missing
/// library is a panic there: look for each first, so `--device cuda` on a machine without them
/// is an error that says what is missing.
pub(super) fn check_libraries() -> Result<()> {
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
pub(super) struct Shape {
    pub(super) head_dim: usize,
    pub(super) group: usize,
}

pub(super) fn options(act: Kind, kv: Kind, shape: Shape, arch: String) -> CompileOptions {
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
pub(super) fn compile(ctx: &Arc<CudaContext>, act: Kind, kv: Kind, shape: Shape) -> Result<Kernels> {
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
pub(super) struct Kernels {
    pub(super) kv: Kind,
    /// Whether `attention_tiled` and `attention_tiled_async` run for these types on this
    /// device (else each is a stub never launched).
    pub(super) tiled_sync: bool,
    pub(super) tiled_async: bool,
    pub(super) attention_tiled: CudaFunction,
    pub(super) attention_tiled_async: CudaFunction,
    pub(super) embed: CudaFunction,
    pub(super) rms_norm: CudaFunction,
    pub(super) add_rms_norm: CudaFunction,
    pub(super) add: CudaFunction,
    pub(super) add_bias: CudaFunction,
    pub(super) rope_store_kv: CudaFunction,
    pub(super) gather_new_kv: CudaFunction,
    pub(super) attention: CudaFunction,

    pub(super) gated_act: CudaFunction,
    pub(super) gather_rows: CudaFunction,
    pub(super) soft_cap: CudaFunction,
    pub(super) argmax_partial: CudaFunction,
    pub(super) argmax_final: CudaFunction,
    pub(super) fill_random: CudaFunction,
    pub(super) from_f32: CudaFunction,
}
