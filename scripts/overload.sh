#!/usr/bin/env bash
# Admission control under overload, live and simulated side by side (Mooncake §6, Table 2's
# measures): a decode-heavy Poisson workload at about 2x and 3x what 2 prefill + 2 decode
# emulated workers (`--emulate h100`) serve within the SLOs, with admission none, early and
# predictive. Per load and admission: requests completed within both SLOs, rejected before their
# prefill (HTTP 429 live), rejected after it (the prefill wasted), and the prefill time wasted,
# live (`baton serve` + `baton bench serve` replaying the trace at its timestamps) and in `baton
# sim` on the same trace, profile and cluster. The live predictive admission uses the `t_d` the
# conductor measures (printed); the simulator is given `T_D_MS` and, like the conductor, assumes
# it for every request (`--uniform-decode-time`) rather than each one's output length.
#
# Usage: scripts/overload.sh
# Environment:
#   OUT        output directory (default: .bench/overload)
#   PORT       server port (default: 8160)
#   BATON_BIN  a baton binary to use instead of building one (release)
#   RATES      request rates (default "50 75"; the cluster's capacity within the SLOs is about 25)
#   DURATION_S seconds of arrivals per rate (default 20)
#   T_D_MS     the simulator's uniform decode time (default 2400: 300 tokens at 8 ms)
#   MODEL      the model file whose tokenizer the emulated workers use
#   TBT_HEADROOM  fraction of the TBT SLO admission keeps free, live and simulated
#              (`--admission-tbt-headroom`; default: the flag's default, 0.1)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$repo_root/.bench/overload}"
port="${PORT:-8160}"
url="http://127.0.0.1:$port"
rates="${RATES:-50 75}"
duration="${DURATION_S:-20}"
t_d_ms="${T_D_MS:-2400}"
model="${MODEL:-${BATON_MODELS_DIR:-$repo_root/.models}/gemma-3-270m-q4_k_m.gguf}"
slo=(--slo-ttft-ms 2000 --slo-tbt-ms 8)
headroom=()
[[ -n "${TBT_HEADROOM:-}" ]] && headroom=(--admission-tbt-headroom "$TBT_HEADROOM")

info() { echo "overload: $*" >&2; }
die() { echo "overload: error: $*" >&2; exit 1; }

[[ -f "$model" ]] || die "$model is missing: run scripts/fetch-model.sh gemma3-270m"
# shellcheck source=lib/serve-common.sh
source "$repo_root/scripts/lib/serve-common.sh"
find_baton
mkdir -p "$out"

for rate in $rates; do
  dir="$out/rate-$rate"
  mkdir -p "$dir"
  n=$((rate * duration))
  trace="$dir/trace.jsonl"
  "$baton" sim --poisson "$n" --rate "$rate" --input 200:600 --output 200:400 --seed 0 --write-trace "$trace" >/dev/null
  info "rate $rate/s, $n requests: simulated"
  "$baton" sim --trace "$trace" --prefill 2 --decode 2 --profile h100 --policy kv-centric \
    --admission none,early,predictive --ttft-slo-ms 2000 --tbt-slo-ms 8 --decode-time-ms "$t_d_ms" --uniform-decode-time \
    --max-batch 512 --seed 0 "${headroom[@]}" --json >"$dir/sim.json" 2>"$dir/sim.log"
  for admission in none early predictive; do
    info "rate $rate/s: live, admission $admission"
    start_server "$dir/$admission.serve.log" --model "$model" --emulate h100 --prefill 2 --decode 2 \
      --num-blocks 65536 --max-num-seqs 512 --max-batch-tokens 2048 --prefill-chunk 2048 \
      --policy kv-centric --admission "$admission" --cost-profile h100 "${slo[@]}" "${headroom[@]}"
    "$baton" bench serve --url "$url" --workload mooncake --dataset "$trace" --ignore-eos --num-requests "$n" \
      "${slo[@]}" --request-timeout-s 600 --no-plots --no-progress --out-dir "$dir/$admission" \
      >"$dir/$admission.bench.txt" 2>&1 || die "bench serve failed: $(tail -5 "$dir/$admission.bench.txt")"
    curl -sf "$url/metrics" >"$dir/$admission.metrics.txt" || true
    stop_server
  done
done

python3 - "$out" "$rates" "$t_d_ms" <<'EOF'
import json, os, re, sys
out, rates, t_d_ms = sys.argv[1], sys.argv[2].split(), sys.argv[3]
def sims(path):
    text, dec, pos, found = open(path).read(), json.JSONDecoder(), 0, {}
    while pos < len(text):
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            break
        obj, pos = dec.raw_decode(text, pos)
        found[obj["admission"]] = obj
    return found
def metric(path, name):
    for line in open(path):
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None
print(f"| rate req/s | admission | live: within SLOs | live: rejected before prefill | live: rejected after prefill | live: wasted prefill s | live t_d s (measured) | sim: within SLOs | sim: rejected before prefill | sim: rejected after prefill | sim: wasted prefill s (t_d {int(t_d_ms)/1000:g} s) |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for rate in rates:
    d = os.path.join(out, f"rate-{rate}")
    sim = sims(os.path.join(d, "sim.json"))
    for adm in ["none", "early", "predictive"]:
        report = json.load(open(os.path.join(d, adm, "report.json")))
        summary = report["runs"][0]["summary"]
        met = summary["slo"]["met"]
        rejected = sum(v for k, v in summary["outcomes"].items() if k != "ok")
        t_d = metric(os.path.join(d, f"{adm}.metrics.txt"), "baton_decode_residency_seconds")
        s = sim.get(adm, {})
        print(f"| {rate} | {adm} | {met} | {rejected} | 0 | 0.0 | {t_d if t_d is None else round(t_d, 2)} | "
              f"{s.get('completed_within_slo')} | {s.get('rejected_early')} | {s.get('rejected_after_prefill')} | "
              f"{s.get('wasted_prefill_us', 0) / 1e6:.1f} |")
EOF
info "reports: $out/rate-*/; the live server never rejects after a prefill (its decode side queues or recomputes), so it wastes none"
