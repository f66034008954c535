#!/usr/bin/env bash
# Issue 7's simulator experiments: prints three markdown tables and writes plots.
#   (1) prefill scheduling on the Mooncake trace, 8P+8D: random / least-load / prompt-tree / kv-centric
#   (2) the same trace at 2x speed: no admission / Mooncake baseline / early rejection / predictive
#   (3) a decode-heavy (imbalanced) workload: fixed roles vs load-aware role switching
# Usage: scripts/sim-experiments.sh [TRACE [PLOT_DIR]]
#   TRACE    default fixtures/traces/synthetic_trace.jsonl
#   PLOT_DIR default target/sim-plots: expN.json (reports), expN_ttft_cdf, expN_jct_cdf and
#            expN_summary as .png and .svg
# Cost profile: LLaMA-2-70B on 8xA800 per instance (roofline; see baton-sched CostProfile docs).
set -euo pipefail
cd "$(dirname "$0")/.."
TRACE=${1:-fixtures/traces/synthetic_trace.jsonl}
PLOTS=${2:-${CARGO_TARGET_DIR:-target}/sim-plots}
if [[ ! -f "$TRACE" ]]; then
  echo "trace not found: $TRACE (the Mooncake FAST'25 synthetic trace, see fixtures/traces/README.md)" >&2
  exit 1
fi
# BATON=path/to/baton skips the build (any build gives the same figures: time is virtual).
if [[ -z "${BATON:-}" ]]; then
  cargo build --release -q -p baton
  BATON=${CARGO_TARGET_DIR:-target}/release/baton
fi
SIM() { SIM_ROW_HEADER=1 "$BATON" sim --row --plot "$PLOTS" "$@" 2>/dev/null; }

echo "## (1) Prefill scheduling, $TRACE, 8P+8D, 1x speed, TTFT SLO 30 s"
SIM --name exp1 --title "(1) Mooncake trace, 8P+8D, TTFT SLO 30 s" --trace "$TRACE" --prefill 8 --decode 8 \
    --policy random,least-load,prompt-tree,kv-centric --admission none --seed 0
echo
echo "## (1b) Same, TTFT SLO 10 s"
SIM --name exp1b --title "(1b) Mooncake trace, 8P+8D, TTFT SLO 10 s" --trace "$TRACE" --prefill 8 --decode 8 \
    --policy random,least-load,prompt-tree,kv-centric --admission none --ttft-slo-ms 10000 --seed 0
echo
# Mooncake's admission has no headroom under the TBT target: without it, early rejection still
# lets the decode side refuse after some prefills, and the comparison of wasted prefill is Table 2's.
echo "## (2) Overload: 2x speed, kv-centric, 8P+8D, TTFT SLO 30 s, TBT SLO 12 ms, t_d 3 s"
SIM --name exp2 --title "(2) Mooncake trace at 2x, kv-centric, 8P+8D" --trace "$TRACE" --prefill 8 --decode 8 \
    --policy kv-centric --admission none,baseline,early,predictive --time-scale 2 \
    --tbt-slo-ms 12 --decode-time-ms 3000 --admission-tbt-headroom 0 --seed 0
echo
echo "## (3) Imbalanced (decode-heavy) workload: 12,000 Poisson requests at 120/s, prompts 200-600, outputs 300-900, 8P+8D"
SIM --name exp3 --title "(3) decode-heavy Poisson workload, 8P+8D" --poisson 12000 --rate 120 --input 200:600 \
    --output 300:900 --prefill 8 --decode 8 --policy least-load,load-aware --persist-ms 5000 --seed 0
echo
echo "Plots and JSON reports: $PLOTS"
echo
echo "## Replay time of the full trace on 16 instances ($BATON)"
/usr/bin/time -f "%e s wall, %M KiB max RSS" "$BATON" sim --trace "$TRACE" --prefill 8 --decode 8 --policy kv-centric >/dev/null
