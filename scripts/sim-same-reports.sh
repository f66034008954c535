#!/usr/bin/env bash
# Do two `baton sim` binaries simulate the same? Runs each workload below with both and compares
# their JSON reports, per-request records included, byte for byte: for a change meant to make
# the simulator faster without changing what it simulates (issue #35: the per-arrival snapshot
# from running totals). The workloads cover every policy, every admission control (overloaded,
# so the queues grow), `--elastic`, colocated instances, sessions with conditional
# disaggregation and layer-wise hand-offs.
#
#   scripts/sim-same-reports.sh OLD_BATON NEW_BATON
#
# e.g. build the base commit into one directory (`git worktree add`, `cargo build --release -p
# baton`) and this one into another. Exits non-zero if any report differs.
set -u
if [ $# -ne 2 ]; then
    echo "usage: $0 OLD_BATON NEW_BATON" >&2
    exit 2
fi
A=$1
B=$2
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TRACE=$ROOT/fixtures/traces/synthetic_trace.jsonl
OUT=$(mktemp -d)
P="--input 1024:4096 --output 128:512"
runs=(
    "--poisson 20000 --rate 106 $P --prefill 8 --decode 8 --policy kv-centric --admission none,early,predictive --ttft-slo-ms 30000 --tbt-slo-ms 100"
    "--poisson 10000 --rate 26.5 $P --prefill 8 --decode 8 --policy random,least-load,prompt-tree,kv-centric,load-aware,session-affinity,round-robin"
    "--trace $TRACE --time-scale 2 --prefill 8 --decode 8 --policy kv-centric,prompt-tree,load-aware --admission none,baseline,early,predictive --ttft-slo-ms 30000 --tbt-slo-ms 12 --decode-time-ms 3000"
    "--poisson 6000 --rate 60 $P --prefill 4 --decode 4 --elastic --policy kv-centric --ttft-slo-ms 2000 --tbt-slo-ms 30"
    "--poisson 6000 --rate 40 $P --prefill 0 --decode 0 --colocated 8 --policy least-load,kv-centric --admission none,early"
    "--sessions 300 --turns 4 --rate 8 --input 2048:700 --output 16:64 --prefill 2 --decode 2 --policy kv-centric --conditional-disagg-tokens 1024 --kv-transfer layerwise"
)
i=0
fail=0
for r in "${runs[@]}"; do
    i=$((i + 1))
    # shellcheck disable=SC2086 # the flags split on purpose
    "$A" sim $r --seed 5 --json --records >"$OUT/a-$i.json" 2>"$OUT/a-$i.err"
    # shellcheck disable=SC2086
    "$B" sim $r --seed 5 --json --records >"$OUT/b-$i.json" 2>"$OUT/b-$i.err"
    if cmp -s "$OUT/a-$i.json" "$OUT/b-$i.json"; then
        verdict=same
    else
        verdict=DIFFERENT
        fail=1
    fi
    echo "workload $i: $verdict ($(grep -c '"policy"' "$OUT/a-$i.json") reports, $(wc -c <"$OUT/a-$i.json") bytes): $r"
done
[ "$fail" = 0 ] && rm -r "$OUT" || echo "reports kept in $OUT" >&2
exit "$fail"
