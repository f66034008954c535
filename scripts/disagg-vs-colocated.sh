#!/usr/bin/env bash
# The headline experiment: disaggregated serving (1 prefill + 1 decode worker) against colocated
# serving (2 colocated workers, prefill and decode in one engine, as vLLM runs) and against an
# elastic pair (`--elastic`, starting 1 prefill + 1 decode: under a persistent imbalance the idle
# worker becomes colocated, issue #18), on the same number of instances, at a sweep of Poisson request rates, with two workloads: long prompts with
# short outputs, and short prompts with long outputs. Per rate: TTFT, TBT (a request's mean gap
# between tokens) and JCT at p90 and goodput (requests/s that met both SLOs), printed side by side
# and plotted (versus.png / versus.svg) per backend and workload. KVDirect's Figure 13 is the
# shape to compare with: under disaggregation TBT stays flat as load grows, colocated TBT climbs.
#
# Backends:
#   emulated  `baton serve --emulate h100`: a LLaMA-2-70B-class model on 8×H100 per instance
#             (step times from the cost profile, the engine loop, KV pool and transfers real);
#             time is real, so each run takes as long as it would on GPUs.
#   cpu       the real Gemma 3 270M on this machine's cores (all workers share them, so P and D
#             interfere through the CPU even when disaggregated; see the note printed at the end).
#
# Every figure comes from `baton bench serve`; the tables from `baton bench compare`.
#
# Usage: scripts/disagg-vs-colocated.sh [emulated|cpu|all]   (default: all)
# Environment:
#   OUT          output directory (default: .bench/headline)
#   PORT         server port (default: 8130)
#   BATON_BIN    a baton binary to use instead of building one (release)
#   QUICK=1      two rates per sweep and 8 s runs: a smoke run of the whole pipeline
#   DURATION_S   seconds each rate sends for (default: 20 emulated, 30 cpu)
#   EMULATE      cost profile of the emulated backend (default: h100; or a800, or a JSON file)
#   WORKLOADS    which workloads (default: "long-prompt short-prompt")
#   MODEL        the model (default: Gemma 3 270M from .models/; scripts/fetch-model.sh gemma3-270m fetches it):
#                computed by the cpu backend; its tokenizer and context length serve the emulated one
#   MODES        which configurations (default: "colocated disaggregated elastic")
#   HOLD_S       the elastic pair's hysteresis, --elastic-hold-s (default: the flag's own)
#   RATES        the rates of every sweep run, comma-separated (default: each workload's own)
#   POLICY       --policy for every configuration (default: baton serve's, simple)
#
# The elastic conductor weighs load with a cost profile: the emulated one's, or for the cpu
# backend one `baton profile` fits on this machine (written once to OUT/cpu/profile.json).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
which="${1:-all}"
out="${OUT:-$repo_root/.bench/headline}"
port="${PORT:-8130}"
url="http://127.0.0.1:$port"
emulate="${EMULATE:-h100}"
model="${MODEL:-${BATON_MODELS_DIR:-$repo_root/.models}/gemma-3-270m-q4_k_m.gguf}"
quick="${QUICK:-0}"
workloads="${WORKLOADS:-long-prompt short-prompt}"
modes="${MODES:-colocated disaggregated elastic}"
policy_args=()
[[ -n "${POLICY:-}" ]] && policy_args=(--policy "$POLICY")
hold="${HOLD_S:-}"

info() { echo "disagg-vs-colocated: $*" >&2; }
die() { echo "disagg-vs-colocated: error: $*" >&2; exit 1; }

case "$which" in emulated | cpu | all) ;; *) die "unknown backend '$which' (emulated, cpu or all)" ;; esac
[[ -f "$model" ]] || die "$model is missing: run scripts/fetch-model.sh gemma3-270m"

# shellcheck source=lib/serve-common.sh
source "$repo_root/scripts/lib/serve-common.sh"
find_baton

# experiment BACKEND WORKLOAD "SERVE ARGS" ISL OSL RATES SLO_TTFT_MS SLO_TBT_MS DURATION_S COST_PROFILE
experiment() {
  local backend="$1" workload="$2" serve_args="$3" isl="$4" osl="$5" rates="$6" ttft="$7" tbt="$8" duration="$9"
  local profile="${10}"
  rates="${RATES:-$rates}"
  local dir="$out/$backend/$workload"
  [[ " $workloads " == *" $workload "* ]] || return 0
  mkdir -p "$dir"
  # Enough requests for the highest rate to send for the whole duration (the workload is built
  # up front, so not more).
  local requests
  requests="$(python3 -c 'import sys; print(int(max(map(float, sys.argv[1].split(","))) * float(sys.argv[2]) * 1.25) + 8)' "$rates" "$duration")"
  # The elastic pair runs on `--elastic`'s defaults, weighing its pools on the conductor's SLOs
  # (the benchmark's) and the emulated profile (the cpu backend's fitted one, by --cost-profile).
  local elastic="--elastic --slo-ttft-ms $ttft --slo-tbt-ms $tbt"
  [[ "$profile" == "$emulate" && "$backend" == emulated ]] || elastic+=" --cost-profile $profile"
  [[ -n "$hold" ]] && elastic+=" --elastic-hold-s $hold"
  for mode in $modes; do
    local topology
    case "$mode" in
      colocated) topology="--colocated 2" ;;
      disaggregated) topology="--prefill 1 --decode 1" ;;
      elastic) topology="--prefill 1 --decode 1 $elastic" ;;
      *) die "unknown mode '$mode' (colocated, disaggregated or elastic)" ;;
    esac
    info "$backend / $workload / $mode: ISL $isl, OSL $osl, rates $rates, $duration s each"
    # shellcheck disable=SC2086 # the argument lists are meant to split
    start_server "$dir/$mode.serve.log" $serve_args $topology "${policy_args[@]}"
    "$baton" bench serve --url "$url" --rates "$rates" --num-requests "$requests" --duration-s "$duration" \
      --input-len "$isl" --output-len "$osl" --ignore-eos --slo-ttft-ms "$ttft" --slo-tbt-ms "$tbt" \
      --request-timeout-s 600 --seed 0 --no-progress --out-dir "$dir/$mode" >"$dir/$mode.txt"
    if [[ "$mode" == elastic ]]; then
      curl -sf "$url/metrics" | grep -E '^baton_role_switches_total' >"$dir/$mode.switches" || true
      curl -sf "$url/health" >"$dir/$mode.roles.json" || true
    fi
    stop_server
  done
  # Every configuration with a report here, this run's or an earlier one's (MODES=elastic
  # re-runs one beside the others).
  local names=() reports=()
  for mode in colocated disaggregated elastic; do
    if [[ -f "$dir/$mode/report.json" ]]; then names+=("$mode") reports+=("$dir/$mode/report.json"); fi
  done
  local joined
  joined="$(IFS=,; echo "${names[*]}")"
  local plot=()
  [[ "$rates" == *,* ]] && plot=(--plot "$dir")
  "$baton" bench compare "${reports[@]}" --names "$joined" "${plot[@]}" >"$dir/compare.txt"
  {
    echo "## $backend, $workload: ISL $isl, OSL $osl; SLOs TTFT $ttft ms, TBT $tbt ms; serve $serve_args"
    if [[ -f "$dir/elastic.switches" ]]; then
      echo
      echo "elastic (start 1P+1D, hold ${hold:-default}): switches $(tr '\n' ' ' <"$dir/elastic.switches")"
      echo "elastic's roles at the end: $(cat "$dir/elastic.roles.json")"
    fi
    echo
    sed -n '/^By rate$/,$p' "$dir/compare.txt" | tail -n +2
  } >"$dir/summary.txt"
  cat "$dir/summary.txt"
}

if [[ "$quick" == 1 ]]; then
  em_long_rates="4,12" em_short_rates="8,24" cpu_long_rates="0.25,1" cpu_short_rates="0.5,2"
  em_duration="${DURATION_S:-8}" cpu_duration="${DURATION_S:-8}"
else
  em_long_rates="2,4,8,12,16,20" em_short_rates="8,16,32,48,64"
  cpu_long_rates="0.25,0.5,0.75,1" cpu_short_rates="0.25,0.5,1,2"
  em_duration="${DURATION_S:-20}" cpu_duration="${DURATION_S:-30}"
fi

mkdir -p "$out"
if [[ "$which" == emulated || "$which" == all ]]; then
  # The model file gives the tokenizer and the context length (Gemma 3: 32K tokens, about a token
  # a word, as the load generator's prompts assume); its weights are not used. The emulated arena
  # is tiny, so the KV capacity can be a GPU instance's (1M tokens); whole 2048-token prompts in
  # one step (vLLM's default token budget on H100s).
  em_args="--model $model --emulate $emulate --num-blocks 65536 --max-num-seqs 128 --max-batch-tokens 2048 --prefill-chunk 2048"
  experiment emulated long-prompt "$em_args" 2048 32 "$em_long_rates" 1000 15 "$em_duration" "$emulate"
  experiment emulated short-prompt "$em_args" 256 256 "$em_short_rates" 1000 15 "$em_duration" "$emulate"
fi
if [[ "$which" == cpu || "$which" == all ]]; then
  cpu_args="--model $model"
  cpu_profile="$out/cpu/profile.json"
  if [[ " $modes " == *" elastic "* && ! -f "$cpu_profile" ]]; then
    mkdir -p "$out/cpu"
    info "fitting the cpu cost profile for the elastic conductor: $cpu_profile"
    "$baton" profile --model "$model" --out "$cpu_profile" >"$out/cpu/profile.txt"
  fi
  experiment cpu long-prompt "$cpu_args" 512 16 "$cpu_long_rates" 3000 100 "$cpu_duration" "$cpu_profile"
  experiment cpu short-prompt "$cpu_args" 32 128 "$cpu_short_rates" 3000 100 "$cpu_duration" "$cpu_profile"
fi

cat "$out"/*/*/summary.txt >"$out/summary.txt" 2>/dev/null || true
info "tables: $out/summary.txt; plots: $out/*/*/versus.png (and .svg); reports: $out/*/*/*/report.json"
if [[ "$which" != emulated ]]; then
  info "note: on the cpu backend both workers share this machine's $(nproc) cores, so a prefill worker slows the decode worker down even when disaggregated"
fi
