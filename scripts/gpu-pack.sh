#!/usr/bin/env bash
# Builds the release binary with CUDA support (no CUDA toolkit needed: the driver, NVRTC and
# cuBLAS are loaded at run time) and puts a stripped copy in .gpu/baton (git-ignored, ~25 MB),
# which scripts/gpu-check.sh runs on a GPU machine that has no Rust toolchain. With fault
# injection too (read from BATON_FAULT_* variables, which only the checks set): the serving
# check kills a worker while a pull of its device memory is open.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --features cuda,fault-injection -p baton
mkdir -p .gpu
cp target/release/baton .gpu/baton
strip .gpu/baton
ls -l .gpu/baton
