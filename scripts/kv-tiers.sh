#!/usr/bin/env bash
# KV memory tiers, live (issue #17): a long-context multi-turn workload whose working set is
# several times one worker's device tier, served by one `baton serve` worker with
#   device       the device tier only: a prefix evicted from it is gone
#   host         + `--host-kv-blocks`: evicted blocks move to host memory and come back
#   host+disk    + `--disk-kv-dir --disk-kv-blocks`: and from host to a block file on disk
# Printed per configuration (a table like SGLang HiCache's): prefix hit ratio (prompt tokens
# served from any tier / prompt tokens, from the worker's /metrics), TTFT mean and p90, request
# and output throughput, and the blocks each tier holds at the end (the conductor's index).
#
# The workload is `baton sim --context-sessions` written as a Mooncake trace (every session
# extends a context of its own; its turns come THINK_S apart, so many sessions are active at
# once and each comes back after the others have filled the device tier) and replayed at its
# timestamps by `baton bench serve --workload mooncake`.
#
# Emulated workers (the default, `--emulate h100`: Llama-2 70B on 8 H100s) charge each step the
# copy of the KV it brought back from host or disk over the profile's links (200 GB/s host,
# 6 GB/s disk; 327,680 bytes a token). EMULATE= (empty) runs Gemma 3 270M on the CPU instead:
# set smaller CONTEXT / TURN_TOKENS / SESSIONS and a slower RATE (see docs/benchmarks/kv-tiers.md for the values
# used).
#
# Usage: scripts/kv-tiers.sh
# Environment:
#   OUT          output directory (default: .bench/kv-tiers)
#   PORT         server port (default: 8160)
#   BATON_BIN    a baton binary to use instead of building one (release)
#   EMULATE      cost profile of emulated workers (default h100; empty: the model on the CPU)
#   MODEL        the model (tokenizer and context; default Gemma 3 270M's GGUF)
#   SESSIONS     sessions (default 24); TURNS turns each (default 4); RATE session starts/s
#                (default 1); THINK_S seconds between a session's turns (default 6)
#   CONTEXT      tokens of a session's first prompt (default 4096); TURN_TOKENS added per turn
#                (default 1024); OUTPUT output tokens (default 32)
#   NUM_BLOCKS   device KV blocks of 16 tokens (default 1024: 16K tokens, two sessions)
#   HOST_BLOCKS  host tier blocks (default 4096); DISK_BLOCKS disk tier blocks (default 8192)
#   TIERS        configurations to run (default "device host host+disk")
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$repo_root/.bench/kv-tiers}"
port="${PORT:-8160}"
url="http://127.0.0.1:$port"
emulate="${EMULATE-h100}"
model="${MODEL:-${BATON_MODELS_DIR:-$repo_root/.models}/gemma-3-270m-q4_k_m.gguf}"
sessions="${SESSIONS:-24}"
turns="${TURNS:-4}"
rate="${RATE:-1}"
think_s="${THINK_S:-6}"
context="${CONTEXT:-4096}"
turn_tokens="${TURN_TOKENS:-1024}"
output="${OUTPUT:-32}"
num_blocks="${NUM_BLOCKS:-1024}"
host_blocks="${HOST_BLOCKS:-4096}"
disk_blocks="${DISK_BLOCKS:-8192}"
tiers="${TIERS:-device host host+disk}"
block_size=16

info() { echo "kv-tiers: $*" >&2; }
die() { echo "kv-tiers: error: $*" >&2; exit 1; }

[[ -f "$model" ]] || die "$model is missing: run scripts/fetch-model.sh gemma3-270m"
# shellcheck source=lib/serve-common.sh
source "$repo_root/scripts/lib/serve-common.sh"
find_baton
mkdir -p "$out"
disk_dir="$out/disk"

trace="$out/trace.jsonl"
"$baton" sim --context-sessions "$sessions" --turns "$turns" --rate "$rate" --think-s "$think_s" \
  --input "$context:$turn_tokens" --output "$output:$output" --write-trace "$trace" >&2
working_set=$(python3 -c "
import json, sys
seen = set()
for line in open(sys.argv[1]):
    seen.update(json.loads(line)['hash_ids'])
print(len(seen) * 512)" "$trace")
info "working set $working_set prompt tokens; device tier $((num_blocks * block_size)) tokens"

engine=(--num-blocks "$num_blocks" --block-size "$block_size" --max-batch-tokens 8192 --prefill-chunk 8192)
[[ -n "$emulate" ]] && engine+=(--emulate "$emulate")

for tier in $tiers; do
  case "$tier" in
    device) flags=() ;;
    host) flags=(--host-kv-blocks "$host_blocks") ;;
    host+disk)
      rm -rf "$disk_dir"
      mkdir -p "$disk_dir"
      flags=(--host-kv-blocks "$host_blocks" --disk-kv-dir "$disk_dir" --disk-kv-blocks "$disk_blocks")
      ;;
    *) die "unknown configuration $tier (device, host, host+disk)" ;;
  esac
  info "live: $tier"
  start_server "$out/$tier.server.log" --model "$model" --prefill 0 --decode 0 --colocated 1 \
    "${engine[@]}" "${flags[@]}"
  "$baton" bench serve --url "$url" --workload mooncake --dataset "$trace" --ignore-eos \
    --num-requests $((sessions * turns)) --no-plots --no-progress --out-dir "$out/$tier" >"$out/$tier.bench.txt" 2>&1 \
    || die "bench serve failed: $(tail -5 "$out/$tier.bench.txt")"
  curl -sf "$url/metrics" >"$out/$tier.metrics.txt"
  stop_server
done

python3 - "$out" "$tiers" <<'EOF' | tee "$out/table.md"
import glob, json, os, re, sys
out, tiers = sys.argv[1], sys.argv[2].split()
print("| tiers | hit ratio | TTFT mean ms | TTFT p90 ms | req/s | output tok/s | device / host / disk blocks at the end | completed |")
print("|---|---|---|---|---|---|---|---|")
for tier in tiers:
    reports = sorted(glob.glob(os.path.join(out, tier, "*.json")), key=os.path.getmtime)
    s = json.load(open(reports[-1]))["runs"][0]["summary"]
    m = open(os.path.join(out, tier + ".metrics.txt")).read()
    def total(pattern):
        return sum(float(v) for v in re.findall(r"^%s (\S+)$" % pattern, m, re.M))
    q = total(r"baton_prefix_cache_queries_tokens_total\{[^}]*\}")
    h = total(r"baton_prefix_cache_hits_tokens_total\{[^}]*\}")
    held = "/".join("%d" % total(r'baton_kv_index_blocks\{[^}]*tier="%s"[^}]*\}' % t) for t in ("device", "host", "disk"))
    print(f"| {tier} | {h / q if q else 0:.3f} | {s['ttft_ms']['mean']:.0f} | {s['ttft_ms']['p90']:.0f} | "
          f"{s['request_throughput']:.2f} | {s['output_throughput']:.1f} | {held} | {s['completed']} / {s['sent']} |")
EOF
