#!/usr/bin/env bash
# Where a GPU step's time goes, and what each fast path buys: the fast kernels checked against
# the plain ones (`baton check-device --kernels`), then decode and prefill on random-weight
# Llama shapes, kernel by kernel (--device-profile: an event after every launch, graphs off)
# and timed with each fast path switched off in turn (--prefill-attention tiled-sync: the tiled
# prefill attention without asynchronous copies, rows: row by row; --pin-host-kv off: new KV to
# the host through staging only; --enforce-eager: no CUDA graphs).
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
bench() { # name, the device flags under test, flags...
    local name=$1 what=$2; shift 2
    echo "--- $name ($what)"
    # shellcheck disable=SC2086
    timeout 240 "$BIN" bench engine --device cuda $what "$@" 2> >(grep -v '^\[bench engine\]' >&2) \
        | tee "$OUT/bench-${name// /_}-${what//[- ]/_}.txt" | grep -E '^ +[0-9]+ +[0-9]+ ' || FAILED=1
}
section "decode: Llama-1B shape, context 512"
bench "1b 512" "--device-profile" $LLAMA_1B --prompt-len 512 --batches 1,8 --decode-steps 16
bench "1b 512" "--device-timing" $LLAMA_1B --prompt-len 512 --batches 1,8 --decode-steps 32
bench "1b 512" "--enforce-eager" $LLAMA_1B --prompt-len 512 --batches 1,8 --decode-steps 32
section "decode and prefill: Llama-8B shape"
bench "8b 4096" "--device-profile" $LLAMA_8B --prompt-len 4096 --batches 1 --decode-steps 16
bench "8b 4096" "--device-timing" $LLAMA_8B --prompt-len 4096 --batches 1 --decode-steps 32
bench "8b 4096" "--prefill-attention tiled-sync" $LLAMA_8B --prompt-len 4096 --batches 1 --decode-steps 32
bench "8b 4096" "--prefill-attention rows" $LLAMA_8B --prompt-len 4096 --batches 1 --decode-steps 32
bench "8b 4096" "--pin-host-kv off" $LLAMA_8B --prompt-len 4096 --batches 1 --decode-steps 32
bench "8b 512" "--device-timing" $LLAMA_8B --prompt-len 512 --batches 1,8 --decode-steps 32

section "done"
[ "$FAILED" = 0 ] && echo "gpu-profile: done (${SECONDS}s)" || echo "gpu-profile: something FAILED (${SECONDS}s)"
exit $FAILED
