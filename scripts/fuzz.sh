#!/usr/bin/env bash
# Fuzzes what hostile peers and clients can send Baton (issue #19): the KV transfer frame
# decoder, the control plane's messages (work requests, event lines, state stream, the cluster
# proof header, --registry values), the binary state stream's decoder (frames and chunked
# streams), the OpenAI request parser and the GGUF reader. Each target
# runs for MINUTES under libFuzzer with AddressSanitizer (cargo-fuzz, nightly toolchain); the
# table at the end gives executions, corpus size and crashes per target. A crash leaves its
# input under fuzz/artifacts/TARGET/ (replay: cargo +nightly fuzz run TARGET FILE).
#
# Usage: scripts/fuzz.sh [TARGET...]     (default: every target)
# Environment:
#   MINUTES     minutes per target (default 10)
#   JOBS        targets run at once (default 1; each uses one core)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
minutes="${MINUTES:-10}"
jobs="${JOBS:-1}"
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(transfer_frame control_messages state_stream openai_request gguf_reader)

info() { echo "fuzz: $*" >&2; }
die() { echo "fuzz: error: $*" >&2; exit 1; }

rustup toolchain list 2>/dev/null | grep -q '^nightly' \
  || die "cargo-fuzz needs a nightly toolchain: rustup toolchain install nightly"
if ! cargo fuzz --version >/dev/null 2>&1; then
  info "installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi
info "building the targets (release, AddressSanitizer)"
cargo +nightly fuzz build -O

mkdir -p fuzz/logs
run() {
  local target="$1"
  mkdir -p "fuzz/corpus/$target"
  info "$target: $minutes min"
  # libFuzzer exits non-zero on a crash; the summary below reports it.
  cargo +nightly fuzz run -O "$target" -- -max_total_time=$((minutes * 60)) -print_final_stats=1 \
    -rss_limit_mb=4096 -max_len=65536 >"fuzz/logs/$target.log" 2>&1 || true
}
running=0
for t in "${targets[@]}"; do
  run "$t" &
  running=$((running + 1))
  if [[ $running -ge $jobs ]]; then
    wait -n
    running=$((running - 1))
  fi
done
wait

echo "| target | minutes | executions | corpus | crashes |"
echo "|---|---|---|---|---|"
status=0
for t in "${targets[@]}"; do
  log="fuzz/logs/$t.log"
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  corpus=$(find "fuzz/corpus/$t" -type f | wc -l)
  crashes=$(find "fuzz/artifacts/$t" -type f 2>/dev/null | wc -l)
  [[ "$crashes" -eq 0 ]] || status=1
  echo "| $t | $minutes | ${execs:-?} | $corpus | $crashes |"
done
exit $status
