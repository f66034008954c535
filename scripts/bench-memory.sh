#!/usr/bin/env bash
# Does a long-running server's memory stay flat? Starts `baton serve` (1 prefill + 1 decode
# worker, in one process) and sends distinct requests in rounds (8 clients, ~100-token prompts
# of random words, 4 tokens each), printing after each round the process's memory from
# /proc/PID/smaps_rollup:
#   private_anon_mb  anonymous memory only this process maps (heap, stacks): what must stay flat
#   shared_mb        shared pages (the KV arenas' memfd mappings, filling as the prefix cache does;
#                    bounded by --num-blocks)
#   rss_mb           both
# and the growth of private memory per request since the first round (target: ~0 bytes).
#
# Environment (defaults in brackets):
#   MODEL       model directory or GGUF [fixtures/models/tiny-llama]
#   ROUNDS      cumulative request counts at which to measure [2000 8000 20000]
#   CONCURRENCY clients [8]
#   PORT        where the server listens [18433]
#   BATON_BIN   a built baton binary [builds target/release/baton]
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
MODEL="${MODEL:-fixtures/models/tiny-llama}"
ROUNDS="${ROUNDS:-2000 8000 20000}"
CONCURRENCY="${CONCURRENCY:-8}"
port="${PORT:-18433}"
url="http://127.0.0.1:$port"

die() { echo "bench-memory: error: $*" >&2; exit 1; }
# shellcheck source=lib/serve-common.sh
source "$repo_root/scripts/lib/serve-common.sh"
find_baton

out="$(mktemp -d)"
trap 'stop_server; rm -rf "$out"' EXIT
start_server "$out/server.log" --model "$MODEL" --prefill 1 --decode 1
server=$server_pid

# Memory of the server process in kB: private anonymous, shared, RSS.
memory() {
  awk '/^Rss:/ {rss=$2} /^Anonymous:/ {anon=$2} /^Shared_Clean:/ {sc=$2} /^Shared_Dirty:/ {sd=$2}
       END {print anon, sc+sd, rss}' "/proc/$server/smaps_rollup"
}

echo "# baton serve --model $MODEL, $CONCURRENCY clients, distinct ~100-token prompts, 4 tokens each"
printf '%10s %16s %10s %8s %24s\n' requests private_anon_mb shared_mb rss_mb private_bytes_per_request
sent=0
first_requests=""
first_anon=""
round=0
for target in $ROUNDS; do
  n=$((target - sent))
  (( n > 0 )) || continue
  round=$((round + 1))
  "$baton" bench serve --url "$url" --workload synthetic --num-requests "$n" \
    --input-len 100 --output-len 4 --ignore-eos --concurrency "$CONCURRENCY" --seed "$round" \
    --out-dir "$out" --no-plots --no-progress --json >"$out/bench.log" 2>&1 || { cat "$out/bench.log" >&2; exit 1; }
  sent=$target
  read -r anon shared rss < <(memory)
  if [[ -z "$first_anon" ]]; then
    first_anon=$anon
    first_requests=$sent
    per="-"
  else
    per=$(( (anon - first_anon) * 1024 / (sent - first_requests) ))
  fi
  awk -v n="$sent" -v a="$anon" -v s="$shared" -v r="$rss" -v p="$per" \
    'BEGIN {printf "%10d %16.1f %10.1f %8.1f %24s\n", n, a / 1024, s / 1024, r / 1024, p}'
done
