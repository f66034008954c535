//! The CUDA backend's stand-in in a build without the `cuda` feature: the same functions as
//! `cuda/`, each failing with the error that says how to get CUDA support, so that the rest of
//! the crate (and its callers) name no feature: `lib.rs` picks this module or the real one.

use std::sync::Arc;

use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::device::{DeviceLimits, DeviceOptions, KernelCheck, KvExport};
use crate::error::{ModelError, Result};
use crate::weights::WeightSource;

/// The error of a CUDA request to a build without the `cuda` feature.
const NO_CUDA: &str = "this baton was built without CUDA support: rebuild with `cargo build --release --features cuda`";

fn no_cuda<T>() -> Result<T> {
    Err(ModelError::Device(NO_CUDA.into()))
}

/// Fails: no CUDA in this build.
pub(crate) fn load(_: &ModelConfig, _: &dyn WeightSource, _: usize, _: DeviceOptions) -> Result<Box<dyn Backend>> {
    no_cuda()
}

/// Fails: no CUDA in this build.
pub(crate) fn measure_limits(_: usize) -> Result<DeviceLimits> {
    no_cuda()
}

/// Fails: no CUDA in this build.
pub fn check_kernels(_: usize) -> Result<Vec<KernelCheck>> {
    no_cuda()
}

/// Fails: no CUDA in this build (`baton bench transfer --device cuda`'s device).
pub fn bench_device(_: usize, _: KvExport) -> Result<Arc<dyn baton_transfer::bench::BenchDevice>> {
    no_cuda()
}
