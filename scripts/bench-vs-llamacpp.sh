#!/usr/bin/env bash
# Baton against llama.cpp on the same GGUF file and the same threads: prompt processing of a
# 512-token prompt (pp512, tokens/s, best of 3) and generation at batch 1 from a one-token
# context (tg, tokens/s, best of 2), both measured the same way on both sides.
#
# llama.cpp comes from PyPI: llama-cpp-python builds it from source into a virtual environment
# under .bench/ (git-ignored) on the first run, which takes a while on 2 cores; later runs reuse
# it. Baton runs `baton bench engine --model ... --json` from a release build.
#
# Usage: scripts/bench-vs-llamacpp.sh [MODEL.gguf]
# Environment:
#   THREADS        threads for both (default: all cores, as `nproc` says)
#   TG_TOKENS      tokens generated for tg (default: 64)
#   BATON_MODELS_DIR  where the default model is (default: <repo>/.models)
#   BATON_BIN      a baton binary to use instead of building one (into $CARGO_TARGET_DIR, or
#                  target/, as cargo does)
#   LLAMA_CPP_CPU  native (default: llama.cpp built for this CPU, GGML_NATIVE=ON), avx2 (a
#                  second build into .bench/venv-avx2 with AVX2, FMA and F16C and no AVX-512:
#                  to compare AVX2 kernels on an AVX-512 machine, with BATON_DOT_KERNEL=avx2)
#                  or noamx (into .bench/venv-noamx: AVX-512 and VNNI as native has them, AMX
#                  off; for VMs that advertise AMX but fault on it, see llama_crashed below)
#   CPUINFO        the file read for the CPU's flags (default: /proc/cpuinfo; the tests set it)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
model="${1:-${BATON_MODELS_DIR:-$repo_root/.models}/gemma-3-270m-q4_k_m.gguf}"
threads="${THREADS:-$(nproc)}"
tg_tokens="${TG_TOKENS:-64}"
case "${LLAMA_CPP_CPU:-native}" in
  native) venv="$repo_root/.bench/venv" cmake_args="-DGGML_NATIVE=ON" ;;
  avx2) venv="$repo_root/.bench/venv-avx2"
    cmake_args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
    cmake_args+=" -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF" ;;
  noamx) venv="$repo_root/.bench/venv-noamx"
    cmake_args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
    cmake_args+=" -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
    cmake_args+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" ;;
  *) echo "bench-vs-llamacpp: error: LLAMA_CPP_CPU is native, avx2 or noamx, not $LLAMA_CPP_CPU" >&2; exit 1 ;;
esac
llama_cpp_python_version="0.3.36"

info() { echo "bench-vs-llamacpp: $*" >&2; }
die() { echo "bench-vs-llamacpp: error: $*" >&2; exit 1; }

# llama.cpp died before printing its figures (status $1): say how, and why it may have. The
# case seen: a Xeon VM that advertises AMX, where the native build's first prefill dies with a
# general-protection fault in libggml-cpu.so (its AMX tile code; the hypervisor advertises the
# feature without giving the guest the tiles' state), and nothing was printed.
llama_crashed() {
  local status=$1 how
  if (( status > 128 )); then
    how="was killed by SIG$(kill -l $(( status - 128 )) 2>/dev/null || echo $(( status - 128 ))) (exit status $status)"
  else
    how="exited with status $status"
  fi
  info "error: llama.cpp $how before printing its figures; there is nothing to compare Baton with."
  local seen
  seen="$(dmesg 2>/dev/null | grep -E 'libggml|general protection' | tail -n 2 || true)"
  [[ -z "$seen" ]] || info "the kernel's log says: $seen"
  if [[ "${LLAMA_CPP_CPU:-native}" == native ]] && grep -qw amx_tile "${CPUINFO:-/proc/cpuinfo}" 2>/dev/null; then
    info "this CPU advertises AMX (amx_tile in /proc/cpuinfo), which llama.cpp's native build uses"
    info "  for prefill in libggml-cpu.so; on a VM that advertises AMX without enabling its tile state"
    info "  the first tile instruction faults (a general-protection fault, as seen on Xeon VMs)."
    info "  Build llama.cpp without AMX (AVX-512 kept) and run again:"
    info "    LLAMA_CPP_CPU=noamx $0 $model"
    info "  or without AVX-512 too: LLAMA_CPP_CPU=avx2 (with BATON_DOT_KERNEL=avx2 for a like-for-like row)."
  elif (( status > 128 )); then
    info "a crash in llama.cpp's build for this CPU: LLAMA_CPP_CPU=avx2 builds a portable one."
  fi
  exit 1
}

[[ -f "$model" ]] || die "$model is missing: run scripts/fetch-model.sh gemma3-270m"

if ! "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
  info "building llama-cpp-python $llama_cpp_python_version with $cmake_args (compiles llama.cpp; several minutes on 2 cores)"
  # No cached wheel: pip keys it on the version, not on CMAKE_ARGS, so the second build would
  # install the first.
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" CMAKE_ARGS="$cmake_args" \
    "$venv/bin/pip" install --no-cache-dir --progress-bar on --verbose "llama-cpp-python==$llama_cpp_python_version" 2>&1 |
    grep --line-buffered -E '^\s*\[ *[0-9]+%\]|Successfully|error' >&2 || true
  "$venv/bin/python" -c "import llama_cpp" || die "llama-cpp-python did not install"
fi

info "llama.cpp ($venv): pp512 and tg$tg_tokens with $threads threads, BATON_DOT_KERNEL=${BATON_DOT_KERNEL:-}"
llama_status=0
llama_json="$("$venv/bin/python" - "$model" "$threads" "$tg_tokens" <<'EOF'
import json, sys, time
import llama_cpp

model, threads, tg = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = llama_cpp.Llama(model_path=model, n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=threads,
                      n_threads_batch=threads, verbose=False)
prompt = [(t * 31 + 1000) % llm.n_vocab() for t in range(512)]

def pp():
    llm.reset()  # the next eval drops the KV cells past position 0
    t = time.perf_counter()
    llm.eval(prompt)
    return 512 / (time.perf_counter() - t)

def tgen():
    llm.reset()  # the next eval drops the KV cells past position 0
    llm.eval(prompt[:1])
    t = time.perf_counter()
    tok = prompt[1]
    for _ in range(tg):
        llm.eval([tok])
        tok = (tok * 7 + 3) % llm.n_vocab()
    return tg / (time.perf_counter() - t)

pp()  # warm-up
print(json.dumps({"pp512": max(pp() for _ in range(3)), "tg": max(tgen() for _ in range(2))}))
EOF
)" || llama_status=$?
if (( llama_status != 0 )) || [[ -z "$llama_json" ]]; then
  llama_crashed "$llama_status"
fi

baton_bin="${BATON_BIN:-}"
if [[ -z "$baton_bin" ]]; then
  info "baton: building (release)"
  (cd "$repo_root" && cargo build --release -q -p baton)
  target_dir="${CARGO_TARGET_DIR:-target}"
  [[ "$target_dir" == /* ]] || target_dir="$repo_root/$target_dir"  # cargo ran in $repo_root
  baton_bin="$target_dir/release/baton"
fi
# Measured as llama.cpp is above: pp512 the best of 3, tg the best of 2, generating from a
# one-token context (as llama-bench's tg does), each run in a fresh process.
info "baton: bench engine with $threads threads"
baton_run() { RAYON_NUM_THREADS="$threads" "$baton_bin" bench engine --model "$model" --batches 1 --json "$@"; }
baton_pp=() baton_tg=()
for _ in 1 2 3; do baton_pp+=("$(baton_run --prompt-len 512 --decode-steps 1)"); done
for _ in 1 2; do baton_tg+=("$(baton_run --prompt-len 1 --decode-steps "$tg_tokens")"); done

python3 - "$llama_json" "$threads" "${#baton_pp[@]}" "${baton_pp[@]}" "${baton_tg[@]}" <<'EOF'
import json, sys
llama, threads, n_pp = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
runs = [json.loads(a)["results"][0] for a in sys.argv[4:]]
pp = max(r["prefill_tokens_per_s"] for r in runs[:n_pp])
tg = max(r["decode_tokens_per_s"] for r in runs[n_pp:])
# Issue #38's targets: 1.2x llama.cpp on both.
rows = [("pp512 (tokens/s)", pp, llama["pp512"], 1.2),
        ("tg (tokens/s)", tg, llama["tg"], 1.2)]
print(f"same GGUF, {threads} threads")
print(f"{'':18} {'baton':>10} {'llama.cpp':>10} {'ratio':>7} {'target':>7}")
for name, b, l, target in rows:
    print(f"{name:18} {b:10.1f} {l:10.1f} {b / l:6.2f}x {target:6.1f}x")
EOF
