#!/usr/bin/env bash
# Issue #35: early rejection against predictive admission on the Mooncake trace at 2x (8P+8D,
# kv-centric, SLOs TTFT 30 s / TBT 12 ms, the default TBT headroom), with the decode and
# prefill pools' load over time (Mooncake §6.3-6.4, Figures 7-8) and the per-instance CSVs.
# Usage: scripts/sim-admission-plot.sh [TRACE [OUT_DIR]]
#   TRACE    default fixtures/traces/synthetic_trace.jsonl
#   OUT_DIR  default target/sim-admission: overload2x_load.png/.svg, overload2x-*.load.csv and
#            overload2x-*.admissions.csv (see `baton sim --help`, --load-trace)
# The plot in crates/baton-sim/docs/ is this script's overload2x_load.png.
set -euo pipefail
cd "$(dirname "$0")/.."
TRACE=${1:-fixtures/traces/synthetic_trace.jsonl}
OUT=${2:-${CARGO_TARGET_DIR:-target}/sim-admission}
# BATON=path/to/baton skips the build (time is virtual: any build gives the same figures).
if [[ -z "${BATON:-}" ]]; then
  cargo build --release -q -p baton
  BATON=${CARGO_TARGET_DIR:-target}/release/baton
fi
SIM_ROW_HEADER=1 "$BATON" sim --row --trace "$TRACE" --time-scale 2 --prefill 8 --decode 8 --policy kv-centric \
  --admission early,predictive --ttft-slo-ms 30000 --tbt-slo-ms 12 --seed 0 \
  --load-trace "$OUT" --load-trace-ms 500 --name overload2x \
  --title "Mooncake trace at 2x, 8P+8D, kv-centric, TTFT 30 s / TBT 12 ms" 2>/dev/null
echo
echo "Load traces and plot: $OUT"
