#!/usr/bin/env bash
# What a worker on a device holds in host memory (issue #58): a `baton worker --device stand-in`
# whose device arena is DEVICE_GIB GiB, with no host tier and then with HOST_KV_BLOCKS blocks
# of one, each behind a `baton conductor`, serving a few requests. The stand-in's arena is a
# memfd named `baton-device-arena` (a GPU's would be device memory), the host tier one named
# `baton-host-tier`, so /proc/PID/smaps tells them from the rest of the process. Printed per run:
# A first run with a quarter of the arena shows that nothing outside it grows with its size.
#   arena_mib      the device arena's size (one memfd, however often it is mapped)
#   host_tier_mib  the host tier's size (0 without one)
#   rss_other_mib  resident memory outside the device arena: weights, runtime, bookkeeping, the
#                  host tier's touched pages; what must stay under LIMIT_MIB (512) whatever the
#                  arena's size
# The second run's host tier must be HOST_KV_BLOCKS blocks, and nothing else may grow with the
# device arena.
#
# Environment (defaults in brackets):
#   MODEL           the model [SmolLM2-135M-Instruct's GGUF, scripts/fetch-model.sh]
#   DEVICE_GIB      the device arena, GiB [4]
#   NUM_BLOCKS      the device arena in blocks [DEVICE_GIB GiB of SmolLM2-135M's]
#   HOST_KV_BLOCKS  the second run's host tier, blocks [1024]
#   REQUESTS        requests served before measuring [8]
#   PORT            the conductor's port [18533]
#   BATON_BIN       a built baton binary [builds target/release/baton]
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
MODEL="${MODEL:-.models/SmolLM2-135M-Instruct.Q4_1.gguf}"
DEVICE_GIB="${DEVICE_GIB:-4}"
HOST_KV_BLOCKS="${HOST_KV_BLOCKS:-1024}"
REQUESTS="${REQUESTS:-8}"
LIMIT_MIB=512
port="${PORT:-18533}"
url="http://127.0.0.1:$port"

die() { echo "bench-device-memory: error: $*" >&2; exit 1; }
[[ -e "$MODEL" ]] || die "$MODEL is missing: run scripts/fetch-model.sh smollm2-135m-instruct"
# shellcheck source=lib/serve-common.sh
source "$repo_root/scripts/lib/serve-common.sh"
find_baton

# Blocks of DEVICE_GIB GiB: SmolLM2-135M's block is 30 layers x K,V x 3 heads x 64 x 4 bytes x
# 16 tokens (another model: set NUM_BLOCKS). The host tier is checked against the block size the
# device arena shows (its size over its blocks).
num_blocks="${NUM_BLOCKS:-$(( (DEVICE_GIB << 30) / (30 * 2 * 3 * 64 * 4 * 16) ))}"

# The worker's memory, from smaps: arena, host tier and resident-elsewhere MiB.
measure() {
  python3 - "$1" <<'EOF'
import re, sys
pid = sys.argv[1]
arena, tier, other = {}, {}, 0
name = None
for line in open(f"/proc/{pid}/smaps"):
    head = re.match(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ (\d+)\s*(.*)$", line)
    if head:
        inode, name = head.group(1), head.group(2)
        continue
    key, _, rest = line.partition(":")
    if key not in ("Size", "Rss"):
        continue
    kb = int(rest.split()[0])
    if "/memfd:baton-device-arena" in name:
        if key == "Size":
            arena[inode] = max(arena.get(inode, 0), kb)
    elif key == "Rss":
        other += kb
    if "/memfd:baton-host-tier" in name and key == "Size":
        tier[inode] = max(tier.get(inode, 0), kb)
print(sum(arena.values()) / 1024, sum(tier.values()) / 1024, other / 1024)
EOF
}

out="$(mktemp -d)"
trap 'stop_server; rm -rf "$out"' EXIT
echo "# baton worker --device stand-in --model $MODEL: $DEVICE_GIB GiB arena ($num_blocks blocks) and a quarter of it, $REQUESTS requests served"
printf '%-36s %10s %14s %14s %10s\n' run arena_mib host_tier_mib rss_other_mib limit_mib
status=0
# A quarter of the arena first: what lies outside it must not change with its size.
for run in "$((num_blocks / 4)) 0" "$num_blocks 0" "$num_blocks $HOST_KV_BLOCKS"; do
  read -r blocks host <<<"$run"
  start_cluster "$out/run$host" 1 0 1 --model "$MODEL" -- --model "$MODEL" --device stand-in \
    --num-blocks "$blocks" --host-kv-blocks "$host"
  "$baton" bench serve --url "$url" --workload synthetic --num-requests "$REQUESTS" --input-len 256 \
    --output-len 16 --ignore-eos --concurrency 4 --out-dir "$out" --no-plots --no-progress --json \
    >"$out/bench$host.log" 2>&1 || { cat "$out/bench$host.log" >&2; exit 1; }
  worker_pid="${cluster_pids[-1]}"
  read -r arena tier other < <(measure "$worker_pid")
  printf '%-36s %10.0f %14.1f %14.1f %10d\n' "--num-blocks $blocks --host-kv-blocks $host" "$arena" "$tier" "$other" \
    "$LIMIT_MIB"
  awk -v o="$other" -v l="$LIMIT_MIB" 'BEGIN { exit !(o < l) }' || { echo "  over the limit" >&2; status=1; }
  want=$(awk -v a="$arena" -v b="$blocks" -v n="$host" 'BEGIN { printf "%.1f", a / b * n }')
  awk -v t="$tier" -v w="$want" 'BEGIN { exit !(t - w < 0.1 && w - t < 0.1) }' \
    || { echo "  the host tier is $tier MiB, not $host blocks ($want MiB)" >&2; status=1; }
  stop_server
done
exit "$status"
