#!/usr/bin/env bash
# MemServe's context caching inside disaggregation, live (issue #16): the same multi-turn
# workloads against `baton serve` in each `--pd-caching` mode, and with fetching between prefill
# workers on top:
#   0        PD-Basic: nothing cached
#   1        PD-Caching-1: prefill workers cache prompts
#   2        PD-Caching-2: decode workers keep sessions' history; hand-offs move only new blocks
#   3        PD-Caching-3: each answer's KV goes back into the prefill worker's cache
#   3+fetch  mode 3 with `--kv-fetch on`: a prefill worker may pull a prefix another one caches
#   3+cond   mode 3 with conditional disaggregation (`--conditional-disagg-tokens $COND`): a
#            request with few tokens not cached on its decode worker runs whole there
# Workloads (`baton bench serve --workload sessions`, causal turns, every turn carrying the whole
# conversation), shaped like MemServe's §6:
#   sharegpt  short chat turns and answers over a short system prompt
#   loogle    one long document every session shares, short questions and answers
#   react     agent loops: many turns, each adding an observation, the context growing
# Per run: mean and p99 JCT and TTFT, KV moved between workers per request (hand-offs, fetches,
# answers sent back; tokens times the profile's bytes per token), prompt tokens computed by
# prefill. A Markdown table (`table.md`) and a bar chart of mean JCT and TTFT relative to
# PD-Basic (`jct.svg`), beside MemServe's published gains.
#
# Usage: scripts/pd-caching.sh
# Environment:
#   OUT        output directory (default: .bench/pd-caching)
#   PORT       server port (default: 8150)
#   BATON_BIN  a baton binary to use instead of building one (release)
#   WORKLOADS  which workloads (default "sharegpt loogle react")
#   MODES      which modes (default "0 1 2 3 3+fetch")
#   EMULATE    the cost profile the workers emulate (default h100: Llama-2 70B on 8 H100s); set
#              EMULATE= (empty) with MODEL=gemma to run Gemma 3 270M on the CPU instead
#   MODEL      the model (tokenizer and context; default Gemma 3 270M's GGUF)
#   SCALE      multiplies the sessions of every workload (default 1; 0.25 for a quick look)
#   DOC        tokens of the LooGLE-like shared document (default 6000; smaller on the CPU)
#   PREFILL, DECODE  workers of each role (default 2 and 2)
#   COND       the token bound of the +cond runs (default 256)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$repo_root/.bench/pd-caching}"
port="${PORT:-8150}"
url="http://127.0.0.1:$port"
workloads="${WORKLOADS:-sharegpt loogle react}"
modes="${MODES:-0 1 2 3 3+fetch}"
emulate="${EMULATE-h100}"
model="${MODEL:-${BATON_MODELS_DIR:-$repo_root/.models}/gemma-3-270m-q4_k_m.gguf}"
scale="${SCALE:-1}"
doc="${DOC:-6000}"
prefill="${PREFILL:-2}"
cond="${COND:-256}"
decode="${DECODE:-2}"

info() { echo "pd-caching: $*" >&2; }
die() { echo "pd-caching: error: $*" >&2; exit 1; }

[[ -f "$model" ]] || die "$model is missing: run scripts/fetch-model.sh gemma3-270m"
# shellcheck source=lib/serve-common.sh
source "$repo_root/scripts/lib/serve-common.sh"
find_baton
mkdir -p "$out"

sessions() { python3 -c "print(max(2, round($1 * $scale)))"; }

# The workload's `baton bench serve` flags.
workload_args() {
  case "$1" in
    sharegpt)
      echo "--sessions $(sessions 24) --turns 4 --system-len 64 --turn-len uniform:32:256" \
        "--output-len uniform:64:256 --rate 2 --think-time-ms 500" ;;
    loogle)
      echo "--sessions $(sessions 16) --turns 4 --system-len $doc --turn-len uniform:16:48" \
        "--output-len uniform:16:64 --rate 1 --think-time-ms 500" ;;
    react)
      echo "--sessions $(sessions 8) --turns 8 --system-len 512 --turn-len uniform:128:384" \
        "--output-len uniform:48:128 --rate 1 --think-time-ms 200" ;;
    *) die "unknown workload $1" ;;
  esac
}

engine=(--num-blocks 4096 --block-size 16 --max-batch-tokens 8192 --prefill-chunk 8192)
[[ -n "$emulate" ]] && engine+=(--emulate "$emulate")

for w in $workloads; do
  for m in $modes; do
    mode="${m%%+*}"
    fetch=off
    [[ "$m" == *+fetch ]] && fetch=on
    extra=()
    [[ "$m" == *+cond ]] && extra=(--conditional-disagg-tokens "$cond")
    name="$w-$m"
    info "$name"
    start_server "$out/$name.server.log" --model "$model" --prefill "$prefill" --decode "$decode" \
      --policy kv-centric --pd-caching "$mode" --kv-fetch "$fetch" "${extra[@]}" "${engine[@]}"
    # shellcheck disable=SC2046 # the workload's flags are words
    "$baton" bench serve --url "$url" --workload sessions $(workload_args "$w") --ignore-eos --seed 7 \
      --no-plots --no-progress --out-dir "$out/$name" >"$out/$name.bench.txt" 2>&1 \
      || die "bench serve failed: $(tail -5 "$out/$name.bench.txt")"
    curl -sf "$url/metrics" >"$out/$name.metrics.txt"
    stop_server
  done
done

python3 - "$out" "$workloads" "$modes" <<'EOF'
import glob, json, os, re, sys
out, workloads, modes = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()

def run(name):
    reports = sorted(glob.glob(os.path.join(out, name, "*.json")), key=os.path.getmtime)
    s = json.load(open(reports[-1]))["runs"][0]["summary"]
    metrics = open(os.path.join(out, name + ".metrics.txt")).read()
    def m(metric):
        found = re.findall(r"^%s(?:\{[^}]*\})? (\S+)$" % metric, metrics, re.M)
        return sum(float(v) for v in found)
    tokens_moved = m("baton_kv_transfer_tokens_total") + m("baton_kv_fetch_tokens_total") + m("baton_kv_return_tokens_total")
    per_token = m("baton_kv_transfer_bytes_total") / max(m("baton_kv_transfer_tokens_total"), 1)
    done = max(s["completed"], 1)
    return {
        "jct": s["jct_ms"]["mean"], "jct99": s["jct_ms"]["p99"],
        "ttft": s["ttft_ms"]["mean"], "ttft99": s["ttft_ms"]["p99"],
        "mb": tokens_moved * per_token / done / 1e6,
        "computed": m("baton_prefill_tokens_total") / done,
        "prompt": m("baton_prompt_tokens_total") / done,
        "completed": s["completed"], "sent": s["sent"],
    }

# MemServe §6 (memserve.txt, "ShareGPT", "LooGLE and ReAct"): disaggregated inference with
# context caching against without, mean JCT and mean TTFT.
paper = {"sharegpt": "JCT −17%, TTFT −58%", "loogle": "JCT −26.9%, TTFT −56.2%", "react": "JCT −26.7%, TTFT −78.5%"}
rows = ["| workload | mode | JCT mean ms | JCT p99 ms | TTFT mean ms | TTFT p99 ms | KV moved MB / request | prompt tokens computed / request | vs PD-Basic (JCT, TTFT) | MemServe (caching vs none) |",
        "|---|---|---|---|---|---|---|---|---|---|"]
results = {}
for w in workloads:
    base = None
    for m in modes:
        r = run(f"{w}-{m}")
        results[(w, m)] = r
        base = base or r
        rel = f"{100 * (r['jct'] / base['jct'] - 1):+.0f}%, {100 * (r['ttft'] / base['ttft'] - 1):+.0f}%"
        rows.append(f"| {w} | {m} | {r['jct']:.0f} | {r['jct99']:.0f} | {r['ttft']:.0f} | {r['ttft99']:.0f} | "
                    f"{r['mb']:.1f} | {r['computed']:.0f} of {r['prompt']:.0f} | {rel} | {paper.get(w, '') if m == modes[0] else ''} |"
                    + ("" if r["completed"] == r["sent"] else f" ({r['completed']} of {r['sent']} completed)"))
table = "\n".join(rows)
open(os.path.join(out, "table.md"), "w").write(table + "\n")
print(table)

# A grouped bar chart: mean JCT and TTFT of each mode relative to the workload's first mode.
width, height, pad = 160 * len(workloads) + 80, 320, 40
bar = 120 / (2 * len(modes))
colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"]
svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">',
       f'<text x="{pad}" y="16">Mean JCT (solid) and TTFT (light) relative to mode {modes[0]}</text>']
top, bottom = 30, height - 50
for i, w in enumerate(workloads):
    x0 = pad + 20 + i * 160
    svg.append(f'<text x="{x0}" y="{height - 30}">{w}</text>')
    for j, m in enumerate(modes):
        r, b = results[(w, m)], results[(w, modes[0])]
        for k, (key, opacity) in enumerate((("jct", 1.0), ("ttft", 0.45))):
            v = r[key] / b[key] if b[key] else 0
            h = (bottom - top) * min(v, 1.5) / 1.5
            x = x0 + (2 * j + k) * bar
            svg.append(f'<rect x="{x:.1f}" y="{bottom - h:.1f}" width="{bar - 1:.1f}" height="{h:.1f}" '
                       f'fill="{colors[j % len(colors)]}" fill-opacity="{opacity}"><title>{w} {m} {key}: {v:.2f}</title></rect>')
y1 = bottom - (bottom - top) / 1.5
svg.append(f'<line x1="{pad}" x2="{width - 10}" y1="{y1:.1f}" y2="{y1:.1f}" stroke="#888" stroke-dasharray="4"/>')
for j, m in enumerate(modes):
    svg.append(f'<rect x="{pad + j * 70}" y="{height - 18}" width="10" height="10" fill="{colors[j % len(colors)]}"/>'
               f'<text x="{pad + j * 70 + 14}" y="{height - 9}">{m}</text>')
svg.append("</svg>")
open(os.path.join(out, "jct.svg"), "w").write("\n".join(svg) + "\n")
print(f"\n{os.path.join(out, 'table.md')}, {os.path.join(out, 'jct.svg')}")
EOF
