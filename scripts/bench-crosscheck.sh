#!/usr/bin/env bash
# Cross-check of `baton bench serve` against an independent client: NVIDIA's aiperf (from PyPI)
# runs the same workload against the same `baton serve`, and the two tables are printed side by
# side with their ratios. Agreement within 15% on TTFT (mean, p50, p90) and output throughput is
# the target; the script exits non-zero when a figure is further apart.
#
# The server must run at the same speed under both clients, or the comparison measures the
# clients' CPU appetite instead of their measurements: on a 2-core machine aiperf's Python
# processes slowed a real-model server 2.5x against baton bench's. So by default the server runs
# the emulated backend (`--emulate h100`: step times from a cost profile, slept, not computed;
# the HTTP path, engine loop, KV pool and transfers stay real), and it is pinned to core 0 and
# the clients to the other cores (taskset, where there are 2+ cores). BACKEND=model serves the
# real model instead (pinned the same way).
#
# The workload: REQUESTS requests, closed loop at CONCURRENCY, ISL prompt tokens, exactly OSL
# output tokens (ignore_eos), streaming completions. aiperf builds its prompts with a tokenizer
# (tiny-llama's, a local path, so nothing is fetched from a hub) and counts tokens from the server's
# usage; baton bench's prompts are words, so its prompt length is calibrated on the server's
# reported prompt tokens to match aiperf's.
#
# aiperf goes into a virtual environment under .bench/ (git-ignored) on the first run.
#
# Usage: scripts/bench-crosscheck.sh [MODEL]   (default: Gemma 3 270M from .models/ if fetched,
#                                               else fixtures/models/tiny-llama)
# Environment:
#   BACKEND      emulated (default) or model
#   EMULATE      the cost profile of the emulated backend (default: h100)
#   PIN          1 (default): pin the server to core 0 and the clients to the rest; 0: don't
#   PORT (8123), REQUESTS (96), CONCURRENCY (4), ISL (aiperf's tiny-llama tokens: 4096 emulated
#   with Gemma, 512 with tiny-llama, 128 model), OSL (32),
#   TOLERANCE (0.15)
#   BATON_BIN   a baton binary to use instead of building one (release)
#   SERVE_BIN   a baton binary for the server only (default: BATON_BIN)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
backend="${BACKEND:-emulated}"
serve_extra=()
case "$backend" in
  emulated)
    # The model gives the tokenizer and the context length only: Gemma 3 (32K) when fetched,
    # else tiny-llama (1K context, so shorter prompts).
    default_model="${BATON_MODELS_DIR:-$repo_root/.models}/gemma-3-270m-q4_k_m.gguf"
    # aiperf counts ISL in tiny-llama tokens; 4096 of them are about 1,590 Gemma tokens, a
    # ~100 ms prefill on the emulated 8xH100: long enough that a millisecond of client jitter
    # does not decide the comparison.
    default_isl=4096
    if [[ ! -f "$default_model" ]]; then
      default_model="$repo_root/fixtures/models/tiny-llama"
      default_isl=512
    fi
    serve_extra=(--emulate "${EMULATE:-h100}")
    ;;
  model)
    default_model="${BATON_MODELS_DIR:-$repo_root/.models}/gemma-3-270m-q4_k_m.gguf"
    [[ -f "$default_model" ]] || default_model="$repo_root/fixtures/models/tiny-llama"
    default_isl=128
    ;;
  *) echo "bench-crosscheck: error: BACKEND is emulated or model, not '$backend'" >&2; exit 2 ;;
esac
model="${1:-$default_model}"
port="${PORT:-8123}"
requests="${REQUESTS:-96}"
concurrency="${CONCURRENCY:-4}"
isl="${ISL:-$default_isl}"
osl="${OSL:-32}"
tolerance="${TOLERANCE:-0.15}"
tokenizer="$repo_root/fixtures/models/tiny-llama"
venv="$repo_root/.bench/venv-aiperf"
aiperf_version="0.13.0"
out="$repo_root/.bench/crosscheck"
url="http://127.0.0.1:$port"

info() { echo "bench-crosscheck: $*" >&2; }
die() { echo "bench-crosscheck: error: $*" >&2; exit 1; }

[[ -e "$model" ]] || die "$model is missing (scripts/fetch-model.sh gemma3-270m fetches it)"

if ! "$venv/bin/aiperf" --version >/dev/null 2>&1; then
  info "installing aiperf $aiperf_version into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
  "$venv/bin/pip" install --quiet "aiperf==$aiperf_version"
fi

baton_bin="${BATON_BIN:-}"
if [[ -z "$baton_bin" ]]; then
  info "building baton (release)"
  (cd "$repo_root" && cargo build --release -q -p baton)
  target_dir="${CARGO_TARGET_DIR:-target}"
  [[ "$target_dir" == /* ]] || target_dir="$repo_root/$target_dir"
  baton_bin="$target_dir/release/baton"
fi

# Pinning: the server on core 0, every client on the others.
server_cpus=() client_cpus=()
if [[ "${PIN:-1}" == 1 ]] && command -v taskset >/dev/null && (($(nproc) >= 2)); then
  server_cpus=(taskset -c 0)
  client_cpus=(taskset -c "1-$(($(nproc) - 1))")
  info "server pinned to core 0, clients to cores 1-$(($(nproc) - 1))"
fi

rm -rf "$out" && mkdir -p "$out"
info "serving $model on $url ($backend backend)"
"${server_cpus[@]}" "${SERVE_BIN:-$baton_bin}" serve --model "$model" --port "$port" "${serve_extra[@]}" \
  >"$out/serve.log" 2>&1 &
server_pid=$!
trap 'kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
  curl -sf "$url/health" >/dev/null 2>&1 && break
  kill -0 "$server_pid" 2>/dev/null || die "the server exited: $(tail -5 "$out/serve.log")"
  sleep 1
done
curl -sf "$url/health" >/dev/null || die "the server did not come up in 300 s"
model_id="$(curl -sf "$url/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')"

bench() { # bench DIR INPUT_LEN N
  "${client_cpus[@]}" "$baton_bin" bench serve --url "$url" --model "$model_id" --num-requests "$3" --input-len "$2" \
    --output-len "$osl" --ignore-eos --concurrency "$concurrency" --seed 0 --no-progress --no-plots \
    --out-dir "$1" >/dev/null
}
# The server's own TTFT (sum and count of its histogram), to tell a client's error from a server
# that a heavier client slowed down (on a small CPU machine the two share the cores).
server_ttft() { curl -sf "$url/metrics" | awk '/^baton_time_to_first_token_seconds_sum/ {s=$2} /^baton_time_to_first_token_seconds_count/ {c=$2} END {print s+0, c+0}'; }
mean_input() { python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["runs"][0]; print(r["summary"]["input_tokens"]/max(1,r["summary"]["completed"]))' "$1/report.json"; }

info "warm-up (baton bench, 8 requests)"
bench "$out/warmup" "$isl" 8

a0="$(server_ttft)"
info "aiperf: $requests requests, concurrency $concurrency, ISL $isl, OSL $osl"
"${client_cpus[@]}" "$venv/bin/aiperf" profile \
  --model "$model_id" --url "$url" --endpoint-type completions --streaming \
  --tokenizer "$tokenizer" --use-server-token-count --use-legacy-max-tokens \
  --synthetic-input-tokens-mean "$isl" --synthetic-input-tokens-stddev 0 \
  --output-tokens-mean "$osl" --output-tokens-stddev 0 --extra-inputs ignore_eos:true \
  --concurrency "$concurrency" --request-count "$requests" --random-seed 0 \
  --ui-type none --artifact-dir "$out/aiperf" >"$out/aiperf.log" 2>&1 ||
  die "aiperf failed: $(tail -20 "$out/aiperf.log")"
a1="$(server_ttft)"
aiperf_json="$(find "$out/aiperf" -name 'profile_export_aiperf.json' | head -1)"
[[ -n "$aiperf_json" ]] || die "aiperf wrote no profile_export_aiperf.json (see $out/aiperf.log)"

# Match aiperf's prompt length as the server counts it: one probe, then scale the word count.
target="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["input_sequence_length"]["avg"])' "$aiperf_json")"
bench "$out/probe" "$isl" 4
measured="$(mean_input "$out/probe")"
input_len="$(python3 -c 'import sys; t,m,i=map(float,sys.argv[1:]); print(max(1, round(i*t/m)))' "$target" "$measured" "$isl")"
info "baton bench: $requests requests, concurrency $concurrency, $input_len words (aiperf's prompts: $target tokens)"
b0="$(server_ttft)"
bench "$out/baton" "$input_len" "$requests"
b1="$(server_ttft)"

python3 - "$out/baton/report.json" "$aiperf_json" "$tolerance" "$a0 $a1" "$b0 $b1" <<'PY'
import json, sys
b = json.load(open(sys.argv[1]))["runs"][0]["summary"]
a = json.load(open(sys.argv[2]))
tol = float(sys.argv[3])
def window(s):
    s0, c0, s1, c1 = map(float, s.split())
    return 1000 * (s1 - s0) / (c1 - c0) if c1 > c0 else None
server_a, server_b = window(sys.argv[4]), window(sys.argv[5])
def am(name, stat):
    m = a.get(name) or {}
    return m.get(stat)
rows = [
    # name, baton, aiperf, checked
    ("requests completed", b["completed"], am("request_count", "avg"), False),
    ("input tokens / request (server)", b["input_tokens"] / max(1, b["completed"]), am("input_sequence_length", "avg"), False),
    ("output tokens / request (server)", b["output_tokens"] / max(1, b["completed"]), am("output_sequence_length", "avg"), False),
    ("TTFT mean (ms)", b["ttft_ms"]["mean"], am("time_to_first_token", "avg"), True),
    ("  server's own TTFT mean (ms)", server_b, server_a, False),
    ("TTFT p50 (ms)", b["ttft_ms"]["p50"], am("time_to_first_token", "p50"), True),
    ("TTFT p90 (ms)", b["ttft_ms"]["p90"], am("time_to_first_token", "p90"), True),
    ("ITL mean (ms)", b["tpot_ms"]["mean"], am("inter_token_latency", "avg"), False),
    ("JCT mean (ms)", b["jct_ms"]["mean"], am("request_latency", "avg"), False),
    ("output throughput (tok/s)", b["output_throughput"], am("output_token_throughput", "avg"), True),
    ("request throughput (req/s)", b["request_throughput"], am("request_throughput", "avg"), False),
]
print(f"{'metric':34} {'baton bench':>12} {'aiperf':>12} {'baton/aiperf':>13}")
bad = []
for name, x, y, checked in rows:
    ratio = (x / y) if (x is not None and y) else None
    flag = ""
    if checked and ratio is not None and abs(ratio - 1) > tol:
        flag = "  <- outside {:.0f}%".format(tol * 100)
        bad.append(name)
    fx = "-" if x is None else f"{x:.2f}"
    fy = "-" if y is None else f"{y:.2f}"
    fr = "-" if ratio is None else f"{ratio:.3f}"
    print(f"{name:34} {fx:>12} {fy:>12} {fr:>13}{flag}")
for name, client, server in (("baton bench", b["ttft_ms"]["mean"], server_b), ("aiperf", am("time_to_first_token", "avg"), server_a)):
    if client and server:
        print(f"{name}: client TTFT mean / server's TTFT mean in its window = {client / server:.3f}")
print("(ITL: baton's TPOT mean, (JCT - TTFT) / (tokens - 1), which is aiperf's inter_token_latency)")
if bad:
    print("disagreement beyond tolerance: " + ", ".join(bad))
    sys.exit(1)
print(f"TTFT and output throughput agree within {tol:.0%}")
PY
