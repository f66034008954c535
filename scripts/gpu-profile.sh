#!/usr/bin/env bash
# Where a GPU step's time goes, and what each fast path buys: the fast kernels checked against
# the plain ones (`baton check-device --kernels`), then decode and prefill on random-weight
# Llama shapes, kernel by kernel (BATON_CUDA_PROFILE=1: an event after every launch, graphs
# off) and timed with each fast path switched off in turn (BATON_CUDA_TILED=1: the tiled
# prefill attention without asynchronous copies, =0: row by row; BATON_CUDA_PIN_ARENA=0: new
# KV to the host through staging only; BATON_CUDA_GRAPHS=0).
# A shorter companion to scripts/gpu-check.sh, same setup:
#
#   BATON_BIN=target/release/baton scripts/gpu-profile.sh [--out DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BATON_BIN:-.gpu/baton}
[ -x "$BIN" ] || BIN=target/release/baton
OUT=/tmp/baton-gpu-profile
[ "${1:-}" = --out ] && OUT=$2
mkdir -p "$OUT"
PY=${PYTHON:-python3}
# The CUDA libraries cudarc loads at run time.
# shellcheck source=scripts/lib/cuda-libs.sh
source scripts/lib/cuda-libs.sh
FAILED=0
section() { printf '\n=== %s (%ds)\n' "$1" "$SECONDS"; }

section "fast kernels against plain ones"
"$BIN" check-device --kernels 2>&1 | tee "$OUT/kernels.txt" || FAILED=1

section "16-bit engines against the CPU's on tiny-llama (greedy tokens; 16-bit may part where margins are thin)"
for dt in float16 bfloat16; do
    "$BIN" check-device --model fixtures/models/tiny-llama --dtype $dt --skip-bos --max-tokens 16 2>&1 | tail -1
done

LLAMA_1B="--hidden 2048 --layers 16 --heads 32 --kv-heads 8 --intermediate 8192 --vocab 128256"
LLAMA_8B="--hidden 4096 --layers 32 --heads 32 --kv-heads 8 --intermediate 14336 --vocab 128256"
bench() { # name, env, flags...
    local name=$1 env=$2; shift 2
    echo "--- $name ($env)"
    # shellcheck disable=SC2086
    env $env timeout 240 "$BIN" bench engine --device cuda "$@" 2> >(grep -v '^\[bench engine\]' >&2) \
        | tee "$OUT/bench-${name// /_}-${env//[= ]/_}.txt" | grep -E '^ +[0-9]+ +[0-9]+ ' || FAILED=1
}
section "decode: Llama-1B shape, context 512"
bench "1b 512" "BATON_CUDA_PROFILE=1" $LLAMA_1B --prompt-len 512 --batches 1,8 --decode-steps 16
bench "1b 512" "BATON_CUDA_TIMING=1" $LLAMA_1B --prompt-len 512 --batches 1,8 --decode-steps 32
bench "1b 512" "BATON_CUDA_GRAPHS=0" $LLAMA_1B --prompt-len 512 --batches 1,8 --decode-steps 32
section "decode and prefill: Llama-8B shape"
bench "8b 4096" "BATON_CUDA_PROFILE=1" $LLAMA_8B --prompt-len 4096 --batches 1 --decode-steps 16
bench "8b 4096" "BATON_CUDA_TIMING=1" $LLAMA_8B --prompt-len 4096 --batches 1 --decode-steps 32
bench "8b 4096" "BATON_CUDA_TILED=1" $LLAMA_8B --prompt-len 4096 --batches 1 --decode-steps 32
bench "8b 4096" "BATON_CUDA_TILED=0" $LLAMA_8B --prompt-len 4096 --batches 1 --decode-steps 32
bench "8b 4096" "BATON_CUDA_PIN_ARENA=0" $LLAMA_8B --prompt-len 4096 --batches 1 --decode-steps 32
bench "8b 512" "BATON_CUDA_TIMING=1" $LLAMA_8B --prompt-len 512 --batches 1,8 --decode-steps 32

section "done"
[ "$FAILED" = 0 ] && echo "gpu-profile: done (${SECONDS}s)" || echo "gpu-profile: something FAILED (${SECONDS}s)"
exit $FAILED
