//! The CUDA backend's kernels compile, for Hopper and for the oldest architecture NVRTC 13
//! targets, in every combination of activation and KV types: checked with NVRTC alone, no GPU.
//! `scripts/test.sh` installs NVRTC from PyPI (`nvidia-cuda-nvrtc`, in `.venv`) and sets
//! `BATON_REQUIRE_NVRTC=1`; elsewhere the test says it skipped when NVRTC is not on the library
//! path. Whether the kernels compute the right thing is `scripts/gpu-check.sh`'s, on a GPU.
#![cfg(feature = "cuda")]

#[test]
fn every_kernel_compiles_with_nvrtc() {
    for arch in ["compute_90", "compute_75"] {
        match baton_model::cuda::compile_kernels_for(arch) {
            Ok(bytes) => assert!(bytes > 10_000, "{arch}: {bytes} bytes of PTX is too little for every kernel"),
            Err(e)
                if std::env::var_os("BATON_REQUIRE_NVRTC").is_none()
                    && e.to_string().contains("not on the library path") =>
            {
                eprintln!("skipped: {e} (scripts/test.sh installs it)");
                return;
            }
            Err(e) => panic!("{arch}: {e}"),
        }
    }
}
