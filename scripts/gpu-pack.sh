#!/usr/bin/env bash
# Builds the release binary with CUDA support (no CUDA toolkit needed: the driver, NVRTC and
# cuBLAS are loaded at run time) and puts a stripped copy in .gpu/baton (git-ignored, ~25 MB),
# which scripts/gpu-check.sh runs on a GPU machine that has no Rust toolchain.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --features cuda -p baton
mkdir -p .gpu
cp target/release/baton .gpu/baton
strip .gpu/baton
ls -l .gpu/baton
