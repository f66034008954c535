#!/usr/bin/env bash
# Elastic prefill/decode, live (`--elastic`): three workers whose roles the conductor switches
# against two fixed splits, 1 prefill + 2 decode and 2 prefill + 1 decode, on the same rate sweep
# of two workloads: long prompts with short outputs (prefill-heavy: 2P+1D is the better split),
# and short prompts with long outputs (decode-heavy: 1P+2D is). The elastic cluster starts with
# the split that is wrong for the workload, and must find the right one by itself. Per rate:
# TTFT, TBT and JCT p90 and goodput, from `baton bench serve`, elastic beside each fixed split
# (`baton bench compare`, with a plot), and the switches the conductor made.
#
# Emulated workers (`--emulate h100`: a LLaMA-2-70B-class model on 8×H100 per instance; the
# engine loop, KV pool and transfers real, step times from the cost profile, time real).
#
# Why three workers and not the headline's two: FlowKV's switch moves a worker from the idle
# pool to the busy one and keeps at least one worker per role (--elastic-min-per-role 1), so
# 1 prefill + 1 decode has nothing to move.
#
# Usage: scripts/elastic.sh
# Environment:
#   OUT          output directory (default: .bench/elastic)
#   PORT         server port (default: 8140)
#   BATON_BIN    a baton binary to use instead of building one (release)
#   DURATION_S   seconds each rate sends for (default: 20)
#   HOLD_S       the elastic hysteresis, --elastic-hold-s (default: the flag's own)
#   QUICK=1      two rates per sweep and 8 s runs
#   WORKLOADS    which workloads (default: "long-prompt short-prompt")
#   MODEL        the model file whose tokenizer and context length the emulated workers use
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$repo_root/.bench/elastic}"
port="${PORT:-8140}"
url="http://127.0.0.1:$port"
model="${MODEL:-${BATON_MODELS_DIR:-$repo_root/.models}/gemma-3-270m-q4_k_m.gguf}"
quick="${QUICK:-0}"
hold="${HOLD_S:-}"
workloads="${WORKLOADS:-long-prompt short-prompt}"

info() { echo "elastic: $*" >&2; }
die() { echo "elastic: error: $*" >&2; exit 1; }

[[ -f "$model" ]] || die "$model is missing: run scripts/fetch-model.sh gemma3-270m"

# shellcheck source=lib/serve-common.sh
source "$repo_root/scripts/lib/serve-common.sh"
find_baton

# The emulated workers of the headline experiment, and the conductor's elastic controller on
# its defaults: the emulated profile, the benchmark's SLOs (a pool's load is its queued prefill
# time over 1 s, or its decode step above the step's floor over 15 ms above it), FlowKV's
# watermarks and a hold scaled by how far over its watermark the busy pool is.
elastic_args="--elastic --slo-ttft-ms 1000 --slo-tbt-ms 15"
[[ -n "$hold" ]] && elastic_args+=" --elastic-hold-s $hold"

# experiment WORKLOAD ISL OSL RATES SLO_TTFT_MS SLO_TBT_MS DURATION_S START
# START is the elastic cluster's first split, as "--prefill N --decode M".
experiment() {
  local workload="$1" isl="$2" osl="$3" rates="$4" ttft="$5" tbt="$6" duration="$7" start="$8"
  local dir="$out/$workload"
  [[ " $workloads " == *" $workload "* ]] || return 0
  mkdir -p "$dir"
  local requests
  requests="$(python3 -c 'import sys; print(int(max(map(float, sys.argv[1].split(","))) * float(sys.argv[2]) * 1.25) + 8)' "$rates" "$duration")"
  for mode in 1p2d 2p1d elastic; do
    local topology extra=""
    case "$mode" in
      1p2d) topology="--prefill 1 --decode 2" ;;
      2p1d) topology="--prefill 2 --decode 1" ;;
      elastic) topology="$start" extra="$elastic_args" ;;
    esac
    info "$workload / $mode: ISL $isl, OSL $osl, rates $rates, $duration s each"
    # shellcheck disable=SC2086 # the argument lists are meant to split
    start_server "$dir/$mode.serve.log" $em_args $topology $extra
    "$baton" bench serve --url "$url" --rates "$rates" --num-requests "$requests" --duration-s "$duration" \
      --input-len "$isl" --output-len "$osl" --ignore-eos --slo-ttft-ms "$ttft" --slo-tbt-ms "$tbt" \
      --request-timeout-s 600 --seed 0 --no-progress --out-dir "$dir/$mode" >"$dir/$mode.txt"
    curl -sf "$url/metrics" | grep -E '^baton_role_switches_total' >"$dir/$mode.switches" || true
    curl -sf "$url/health" >"$dir/$mode.roles.json" || true
    stop_server
  done
  "$baton" bench compare "$dir/1p2d/report.json" "$dir/elastic/report.json" --names 1p2d,elastic \
    --plot "$dir/vs-1p2d" >"$dir/vs-1p2d.txt"
  "$baton" bench compare "$dir/2p1d/report.json" "$dir/elastic/report.json" --names 2p1d,elastic \
    --plot "$dir/vs-2p1d" >"$dir/vs-2p1d.txt"
  {
    echo "## $workload: ISL $isl, OSL $osl; SLOs TTFT $ttft ms, TBT $tbt ms; elastic starts $start, hold ${hold:-default}"
    echo
    echo "elastic's switches: $(tr '\n' ' ' <"$dir/elastic.switches")"
    echo "elastic's roles at the end: $(cat "$dir/elastic.roles.json")"
    echo
    echo "### 1P+2D (A) vs elastic (B)"
    sed -n '/^By rate$/,$p' "$dir/vs-1p2d.txt" | tail -n +2
    echo
    echo "### 2P+1D (A) vs elastic (B)"
    sed -n '/^By rate$/,$p' "$dir/vs-2p1d.txt" | tail -n +2
  } >"$dir/summary.txt"
  cat "$dir/summary.txt"
}

if [[ "$quick" == 1 ]]; then
  long_rates="8,16" short_rates="16,48" duration="${DURATION_S:-8}"
else
  long_rates="8,16,24" short_rates="16,32,48" duration="${DURATION_S:-20}"
fi

mkdir -p "$out"
experiment long-prompt 2048 32 "$long_rates" 1000 15 "$duration" "--prefill 1 --decode 2"
experiment short-prompt 256 256 "$short_rates" 1000 15 "$duration" "--prefill 2 --decode 1"
cat "$out"/*/summary.txt >"$out/summary.txt" 2>/dev/null || true
info "tables: $out/summary.txt; plots: $out/*/vs-*/versus.png (and .svg); reports: $out/*/*/report.json"
