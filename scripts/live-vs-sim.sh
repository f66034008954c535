#!/usr/bin/env bash
# Live vs simulated: does `baton sim` predict the server? One multi-turn workload in which every
# session has a long context of its own (more sessions than one worker's cache holds) is written
# as a Mooncake-format trace by `baton sim --write-trace`, then
#   - replayed live at its timestamps (`baton bench serve --workload mooncake`) against
#     `baton serve --emulate h100` with 4 prefill + 4 decode workers, once per policy:
#     kv-centric on the exact index (workers' KV events), kv-centric on predictions only
#     (`--kv-index predicted`), least-load and random;
#   - run by `baton sim` on the same trace, profile, cluster and cache size.
# Printed per policy: prefix hit ratio (prompt tokens served from a cache / prompt tokens; live
# from the workers' /metrics counters, simulated from the report), mean and p90 TTFT, live and
# simulated side by side, and the live/sim ratio of the mean TTFT. Both columns of a figure come
# from the one definition (issue #34): the p90s are `baton_measure::percentile`'s (linear
# interpolation between the closest ranks), taken from the reports as the Rust side computed
# them (`baton bench serve`'s in ms, `baton sim`'s rounded to the µs), never recomputed here; the
# means per turn below are plain means of the per-request records. Targets (issue #15): exact
# kv-centric has the highest live hit ratio and the lowest live mean TTFT of the four; live and
# simulated mean TTFT agree within 20% for each policy. A second table sets the two side by side
# per turn of the sessions (TTFT and prompt tokens found cached), from per-request records.
#
# Usage: scripts/live-vs-sim.sh
# Environment:
#   OUT         output directory (default: .bench/live-vs-sim)
#   PORT        server port (default: 8140)
#   BATON_BIN   a baton binary to use instead of building one (release)
#   SESSIONS    sessions (default 40); TURNS turns each (default 4); RATE session starts/s
#               (default 1); THINK_S seconds between a session's turns (default 4): about a
#               dozen sessions are active at once, more than one prefill worker's cache holds and
#               fewer than the four together hold
#   CONTEXT     tokens of a session's first prompt (default 4096); TURN_TOKENS added per turn
#               (default 1024); OUTPUT output tokens (default 32)
#   NUM_BLOCKS  KV blocks of 16 tokens per worker (default 2048: 32K tokens, four or five
#               sessions' histories)
#   POLICIES    live runs (default "kv-centric kv-centric-predicted least-load random")
#   MODEL       tokenizer and context length of the emulated model (default Gemma 3 270M)
#   KV_FETCH    on (default) / off: whether a prefill instance may fetch a prefix cached on
#               another (`--kv-fetch`, live and simulated alike)
#   CONDUCTORS  1 (default): one `baton serve` with in-process workers. 2 or more: a cluster of
#               processes, that many `baton conductor` replicas over the same 4 + 4 `baton worker`s,
#               the requests sent to the replicas in turn (round-robin, as a load balancer in front
#               of them would). A replica that predicts its index sees only its own routing: the
#               case of stale indexes (a new router replica blind) that the exact index is for.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$repo_root/.bench/live-vs-sim}"
port="${PORT:-8140}"
url="http://127.0.0.1:$port"
sessions="${SESSIONS:-40}"
turns="${TURNS:-4}"
rate="${RATE:-1}"
think_s="${THINK_S:-4}"
context="${CONTEXT:-4096}"
turn_tokens="${TURN_TOKENS:-1024}"
output="${OUTPUT:-32}"
num_blocks="${NUM_BLOCKS:-2048}"
conductors="${CONDUCTORS:-1}"
policies="${POLICIES:-kv-centric kv-centric-predicted least-load random}"
kv_fetch="${KV_FETCH:-on}"
model="${MODEL:-${BATON_MODELS_DIR:-$repo_root/.models}/gemma-3-270m-q4_k_m.gguf}"
prefill=4
decode=4
block_size=16
# The simulator counts cache in blocks of the trace's 512 tokens.
sim_blocks=$((num_blocks * block_size / 512))

info() { echo "live-vs-sim: $*" >&2; }
die() { echo "live-vs-sim: error: $*" >&2; exit 1; }

[[ -f "$model" ]] || die "$model is missing: run scripts/fetch-model.sh gemma3-270m"
# shellcheck source=lib/serve-common.sh
source "$repo_root/scripts/lib/serve-common.sh"
find_baton
mkdir -p "$out"

trace="$out/trace.jsonl"
"$baton" sim --context-sessions "$sessions" --turns "$turns" --rate "$rate" --think-s "$think_s" \
  --input "$context:$turn_tokens" --output "$output:$output" --write-trace "$trace"

# The simulator, on the same trace: every policy it has a counterpart for, fetching prefixes
# between instances as the live runs do (or not).
sim_json="$out/sim.json"
"$baton" sim --trace "$trace" --prefill "$prefill" --decode "$decode" --profile h100 \
  --policy kv-centric,least-load,random --device-blocks "$sim_blocks" --cache-blocks "$sim_blocks" \
  --host-blocks 0 --kv-fetch "$kv_fetch" --json --records >"$sim_json" 2>"$out/sim.log"

for name in $policies; do
  policy="$name"
  index=exact
  if [[ "$name" == *-predicted ]]; then
    policy="${name%-predicted}"
    index=predicted
  fi
  # PD-Caching-1 live: the simulator does not model decode workers keeping sessions' KV.
  engine=(--emulate h100 --num-blocks "$num_blocks" --block-size "$block_size" --max-batch-tokens 8192
    --prefill-chunk 8192)
  replicas=()
  info "live: $name (policy $policy, index $index, $conductors conductor(s))"
  if [[ "$conductors" -eq 1 ]]; then
    start_server "$out/$name.server.log" --model "$model" --prefill "$prefill" --decode "$decode" \
      --policy "$policy" --kv-index "$index" --kv-fetch "$kv_fetch" --pd-caching 1 "${engine[@]}"
    urls=("$url")
  else
    start_cluster "$out/$name" "$conductors" "$prefill" "$decode" --model "$model" --policy "$policy" \
      --kv-index "$index" --kv-fetch "$kv_fetch" --pd-caching 1 --block-size "$block_size" -- --model "$model" "${engine[@]}"
    urls=("${conductor_urls[@]}")
    for u in "${urls[@]:1}"; do replicas+=(--replica "$u"); done
  fi
  "$baton" bench serve --url "${urls[0]}" "${replicas[@]}" --workload mooncake --dataset "$trace" --ignore-eos \
    --num-requests $((sessions * turns)) --no-plots --no-progress --out-dir "$out/$name" >"$out/$name.bench.txt" 2>&1 \
    || die "bench serve failed: $(tail -5 "$out/$name.bench.txt")"
  # Each conductor counts the cache hits of the requests it routed; the table sums them.
  for u in "${urls[@]}"; do curl -sf "$u/metrics"; done >"$out/$name.metrics.txt"
  stop_server
done

python3 - "$out" "$policies" <<'EOF'
import glob, json, os, re, sys
out, policies = sys.argv[1], sys.argv[2].split()
# `baton sim --json` prints one pretty JSON object per policy, one after another.
text = open(os.path.join(out, "sim.json")).read()
dec, pos, sims = json.JSONDecoder(), 0, {}
while pos < len(text):
    while pos < len(text) and text[pos].isspace():
        pos += 1
    if pos >= len(text):
        break
    obj, pos = dec.raw_decode(text, pos)
    sims[obj["policy"]] = obj

# Every percentile below is read from a report, computed by baton-measure on both sides.
def live(name):
    reports = sorted(glob.glob(os.path.join(out, name, "*.json")), key=os.path.getmtime)
    rep = json.load(open(reports[-1]))
    s = rep["runs"][0]["summary"]
    metrics = open(os.path.join(out, name + ".metrics.txt")).read()
    def total(metric):
        return sum(float(v) for v in re.findall(r"^%s\{[^}]*\} (\S+)$" % metric, metrics, re.M))
    q, h = total("baton_prefix_cache_queries_tokens_total"), total("baton_prefix_cache_hits_tokens_total")
    return s, (h / q if q else 0.0)

print("| policy | hit ratio live | hit ratio sim | TTFT mean live ms | TTFT mean sim ms | live/sim | TTFT p90 live ms | TTFT p90 sim ms | completed live / sim |")
print("|---|---|---|---|---|---|---|---|---|")
for name in policies:
    s, hit = live(name)
    sim = sims.get(name)
    ttft_mean, ttft_p90 = s["ttft_ms"]["mean"], s["ttft_ms"]["p90"]
    if sim:
        sm, sp = sim["ttft"]["mean"] / 1000, sim["ttft"]["p90"] / 1000
        row = f"{sim['cache_hit_ratio']:.3f} | {ttft_mean:.0f} | {sm:.0f} | {ttft_mean / sm:.2f} | {ttft_p90:.0f} | {sp:.0f} | {s['completed']} / {sim['completed']}"
    else:
        row = f"— | {ttft_mean:.0f} | — | — | {ttft_p90:.0f} | — | {s['completed']} / —"
    print(f"| {name} | {hit:.3f} | {row} |")

# Request by request: each request's turn in its session (a prompt that extends an earlier
# one's blocks is its next turn), then per policy and turn the mean TTFT and the mean prompt
# tokens found cached (fetched included), live (the server's usage.prompt_tokens_details) and
# simulated (`baton sim --records`). Where the two sides part, this says on which turns.
trace = [json.loads(l)["hash_ids"] for l in open(os.path.join(out, "trace.jsonl"))]
turn = []
for i, h in enumerate(trace):
    turn.append(max([turn[j] + 1 for j in range(i) if h[:len(trace[j])] == trace[j]], default=0))
print()
print("| policy | turn | requests | TTFT mean live ms | TTFT mean sim ms | cached tokens live | cached tokens sim |")
print("|---|---|---|---|---|---|---|")
for name in policies:
    sim = sims.get(name)
    if not sim or not sim.get("records"):
        continue
    reports = sorted(glob.glob(os.path.join(out, name, "*.json")), key=os.path.getmtime)
    live = sorted(json.load(open(reports[-1]))["runs"][0]["records"], key=lambda r: r["start_us"])
    rows = {}
    for t, l, r in zip(turn, live, sim["records"]):
        a = rows.setdefault(t, [0, 0.0, 0.0, 0, 0])
        a[0] += 1
        a[1] += (l["ttft_us"] or 0) / 1000
        a[2] += (r["ttft_us"] or 0) / 1000
        a[3] += l.get("cached_tokens") or 0
        a[4] += r["cached_tokens"] + r["fetched_tokens"]
    for t in sorted(rows):
        n, lt, st, lc, sc = rows[t]
        print(f"| {name} | {t + 1} | {n} | {lt / n:.1f} | {st / n:.1f} | {lc // n} | {sc // n} |")
EOF
