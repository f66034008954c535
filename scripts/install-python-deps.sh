#!/usr/bin/env bash
# Python packages the tests and reference scripts use, in a virtual environment at <repo>/.venv
# (git-ignored):
#   openai  the official client, driven against `baton serve` by crates/baton-conductor/tests/openai.rs
#   gguf    llama.cpp's GGUF reader and dequantiser, for scripts/reference-smollm2.py
#   numpy   the float32 forward pass of scripts/reference-smollm2.py
#   regex   \p{L}-style classes for its tokeniser; jinja2 renders the chat template (as transformers)
#   nvidia-cuda-nvrtc  NVRTC, with which crates/baton-model/tests/cuda_kernels.rs compiles the CUDA
#           kernels without a GPU (CUDA 13.0's, the PTX a 580 driver loads)
#   kubernetes-validate  Kubernetes' schemas, shipped in the package (so it validates offline), for
#           crates/baton/tests/deploy.rs's check of deploy/k8s
# Idempotent: nothing is installed when the pinned versions are already there.
set -euo pipefail
cd "$(dirname "$0")/.."
readonly PINS=("openai==3.54.0" "gguf==0.19.0" "numpy==2.4.6" "regex==2026.11.15" "jinja2==3.1.6" "nvidia-cuda-nvrtc==13.0.88" "kubernetes-validate==1.37.0")
PYTHON=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
    echo "install-python-deps: creating .venv"
    "$PYTHON" -m venv .venv
fi
missing=()
for pin in "${PINS[@]}"; do
    name="${pin%%==*}"
    version="${pin##*==}"
    if .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('$name') != '$version')" 2>/dev/null; then
        echo "install-python-deps: $name $version already installed"
    else
        missing+=("$pin")
    fi
done
if [ "${#missing[@]}" -gt 0 ]; then
    echo "install-python-deps: pip install ${missing[*]}"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check "${missing[@]}"
fi
