#!/usr/bin/env bash
# Issue 7's simulator experiments: prints three markdown tables.
#   (1) prefill scheduling on the Mooncake trace, 8P+8D: random / least-load / prompt-tree / kv-centric
#   (2) the same trace at 2x speed: no admission / Mooncake baseline / early rejection / predictive
#   (3) a decode-heavy (imbalanced) workload: fixed roles vs load-aware role switching
# Usage: scripts/sim-experiments.sh [TRACE]   (default ../shared/fixtures/traces/synthetic_trace.jsonl)
# Cost profile: LLaMA-2-70B on 8xA800 per instance (roofline; see baton-sched CostProfile docs).
set -euo pipefail
cd "$(dirname "$0")/.."
TRACE=${1:-../shared/fixtures/traces/synthetic_trace.jsonl}
if [[ ! -f "$TRACE" ]]; then
  echo "trace not found: $TRACE (the Mooncake FAST'25 synthetic trace, see ../shared/fixtures/traces/README.md)" >&2
  exit 1
fi
cargo build --release -q -p baton
BATON=${CARGO_TARGET_DIR:-target}/release/baton
SIM() { "$BATON" sim "$@"; }
header() { SIM_ROW_HEADER=1 "$@" 2>/dev/null; }

echo "## (1) Prefill scheduling, $TRACE, 8P+8D, 1x speed, TTFT SLO 30 s"
first=1
for policy in random least-load prompt-tree kv-centric; do
  cmd=(SIM --trace "$TRACE" --prefill 8 --decode 8 --policy "$policy" --admission none --seed 0 --row)
  if ((first)); then header "${cmd[@]}"; first=0; else "${cmd[@]}" 2>/dev/null; fi
done
echo
echo "## (1b) Same, TTFT SLO 10 s"
first=1
for policy in random least-load prompt-tree kv-centric; do
  cmd=(SIM --trace "$TRACE" --prefill 8 --decode 8 --policy "$policy" --admission none --ttft-slo-ms 10000 --seed 0 --row)
  if ((first)); then header "${cmd[@]}"; first=0; else "${cmd[@]}" 2>/dev/null; fi
done
echo
echo "## (2) Overload: 2x speed, kv-centric, 8P+8D, TTFT SLO 30 s, TBT SLO 12 ms, t_d 3 s"
first=1
for adm in none baseline early predictive; do
  cmd=(SIM --trace "$TRACE" --prefill 8 --decode 8 --policy kv-centric --admission "$adm" --time-scale 2 \
       --tbt-slo-ms 12 --decode-time-ms 3000 --seed 0 --row)
  if ((first)); then header "${cmd[@]}"; first=0; else "${cmd[@]}" 2>/dev/null; fi
done
echo
echo "## (3) Imbalanced (decode-heavy) workload: 12,000 Poisson requests at 120/s, prompts 200-600, outputs 300-900, 8P+8D"
first=1
for policy in least-load load-aware; do
  cmd=(SIM --poisson 12000 --rate 120 --input 200:600 --output 300:900 --prefill 8 --decode 8 \
       --policy "$policy" --persist-ms 5000 --seed 0 --row)
  if ((first)); then header "${cmd[@]}"; first=0; else "${cmd[@]}" 2>/dev/null; fi
done
echo
echo "## Replay time of the full trace on 16 instances (release build)"
/usr/bin/time -f "%e s wall, %M KiB max RSS" "$BATON" sim --trace "$TRACE" --prefill 8 --decode 8 --policy kv-centric >/dev/null
