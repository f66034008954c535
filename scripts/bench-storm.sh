#!/usr/bin/env bash
# The server under storms: for each KV size, starts `baton serve` (1 prefill + 1 decode worker,
# or --colocated 1 with MODE=colocated) and runs `baton bench storm` at each concurrency.
# Per point it prints: completed, refused before the first token (429), failed before it,
# failed after it (target 0), hung (target 0), completed with the first token within DEADLINE_S,
# completed texts equal to the same request run alone (with SOLO=1), and tokens/s — so the next
# regression shows. Exits non-zero when any point failed after a first token or hung.
#
# #63's overload point, with the server's defaults and then queueing everything:
#   MODEL=smollm2-135m-instruct KV_BLOCKS=64 CONCURRENCY=300 MIX=mixed SOLO=1 scripts/bench-storm.sh
#   MODEL=smollm2-135m-instruct KV_BLOCKS=64 CONCURRENCY=300 MIX=mixed SERVER_ARGS='--max-queue-wait 0' \
#     scripts/bench-storm.sh
#
# Environment (defaults in brackets):
#   MODEL        model directory or GGUF [fixtures/models/tiny-llama]
#   KV_BLOCKS    KV sizes in blocks of 16 tokens, space-separated [64 256 2048]
#   CONCURRENCY  comma-separated [16,64,256,512]
#   MAX_TOKENS   tokens per request [300]
#   MODE         disaggregated | colocated [disaggregated]
#   TIMEOUT_S    a request with no end by then counts as hung [300]
#   MIX          short | mixed: which requests (see `baton bench storm --help`) [short]
#   SOLO         1: run each completed request again alone and compare its text [0]
#   DEADLINE_S   the ttft<=dl column's deadline, seconds [30]
#   SERVER_ARGS  more arguments for `baton serve` (e.g. '--max-queue-wait 0') []
#   BATON_BIN    a built baton binary [builds target/release/baton]
#   PORT         where the server listens [18431]
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL="${MODEL:-fixtures/models/tiny-llama}"
KV_BLOCKS="${KV_BLOCKS:-64 256 2048}"
CONCURRENCY="${CONCURRENCY:-16,64,256,512}"
MAX_TOKENS="${MAX_TOKENS:-300}"
MODE="${MODE:-disaggregated}"
TIMEOUT_S="${TIMEOUT_S:-300}"
PORT="${PORT:-18431}"
MIX="${MIX:-short}"
SOLO="${SOLO:-0}"
DEADLINE_S="${DEADLINE_S:-30}"
read -r -a server_args <<<"${SERVER_ARGS:-}"
solo=()
[[ "$SOLO" == 1 ]] && solo=(--solo)

if [[ -z "${BATON_BIN:-}" ]]; then
  cargo build --release --locked -p baton >&2
  BATON_BIN=target/release/baton
fi
case "$MODE" in
  disaggregated) workers=(--prefill 1 --decode 1) ;;
  colocated) workers=(--colocated 1) ;;
  *) echo "bench-storm: MODE must be disaggregated or colocated" >&2; exit 2 ;;
esac

server=""
cleanup() {
  if [[ -n "$server" ]]; then
    kill "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true  # (the killed server's status is not ours)
  fi
}
trap cleanup EXIT

status=0
first=1
for blocks in $KV_BLOCKS; do
  "$BATON_BIN" serve --model "$MODEL" --num-blocks "$blocks" --port "$PORT" "${workers[@]}" \
    "${server_args[@]}" >".bench-storm-server.log" 2>&1 &
  server=$!
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    kill -0 "$server" 2>/dev/null || { cat .bench-storm-server.log >&2; exit 1; }
    sleep 0.1
  done
  header=()
  [[ $first == 1 ]] && header=(--header) && echo "# $MODE, $MODEL, $MIX requests ($MAX_TOKENS tokens each when short), server: ${SERVER_ARGS:-defaults}"
  first=0
  "$BATON_BIN" bench storm --url "http://127.0.0.1:$PORT" --concurrency "$CONCURRENCY" \
    --max-tokens "$MAX_TOKENS" --timeout-s "$TIMEOUT_S" --kv-blocks "$blocks" --mix "$MIX" \
    --deadline-s "$DEADLINE_S" "${solo[@]}" "${header[@]}" || status=1
  cleanup
  server=""
done
rm -f .bench-storm-server.log
exit $status
