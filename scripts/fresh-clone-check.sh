#!/usr/bin/env bash
# Does the README's run command work on a fresh clone of a machine without protoc?
#
# Clones this repository's HEAD (committed work only) into a fresh temporary directory, puts a
# `protoc` that always fails first on PATH and sets PROTOC=/nonexistent, so any build script that
# needs protoc fails; then runs the README's command,
#
#     scripts/fetch-model.sh && cargo run --release -- serve
#
# (with `--port 0`, so it cannot collide with another server), waits until it serves, sends one
# chat request and checks the answer. The clone has its own cargo target directory (a cold
# release build: 10 minutes or more) and its own `.models`; nothing here needs root.
#
# Environment:
#   BATON_PIP_CACHE     reuse downloaded wheels (passed to scripts/fetch-model.sh)
#   KEEP                1 keeps the temporary directory (its path is printed)
#   BUILD_TIMEOUT_S     how long to wait for the build and model load (default 3600)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/baton-fresh.XXXXXX")"
server_pid=""
cleanup() {
    if [[ -n "$server_pid" ]]; then
        # The server runs in its own process group (setsid): stop cargo and baton together.
        kill -INT -- "-$server_pid" 2>/dev/null || true
        sleep 1
        kill -KILL -- "-$server_pid" 2>/dev/null || true
    fi
    if [[ "${KEEP:-0}" == 1 ]]; then
        echo "fresh-clone-check: kept $work" >&2
    else
        rm -rf "$work"
    fi
}
trap cleanup EXIT
say() { echo "fresh-clone-check: $*" >&2; }
fail() {
    say "FAILED: $*"
    exit 1
}

say "cloning $(git -C "$repo_root" rev-parse --short HEAD) into $work/baton"
git clone --quiet "$repo_root" "$work/baton"

# A protoc that fails, first on PATH, and PROTOC pointing nowhere.
mkdir -p "$work/bin"
cat >"$work/bin/protoc" <<'EOS'
#!/bin/sh
echo "protoc: this machine has no protoc (fresh-clone-check)" >&2
exit 1
EOS
chmod +x "$work/bin/protoc"
export PATH="$work/bin:$PATH"
export PROTOC=/nonexistent
unset CARGO_TARGET_DIR BATON_MODELS_DIR
command -v protoc | grep -q "^$work/bin/protoc$" || fail "the failing protoc is not first on PATH"
if protoc --version >/dev/null 2>&1; then fail "protoc works"; fi

cd "$work/baton"
log="$work/serve.log"
say "running: scripts/fetch-model.sh && cargo run --release -- serve --port 0   (log: $log)"
setsid bash -c 'scripts/fetch-model.sh && exec cargo run --release -- serve --port 0' >"$log" 2>&1 &
server_pid=$!

deadline=$((SECONDS + ${BUILD_TIMEOUT_S:-3600}))
url=""
while [[ -z "$url" ]]; do
    if ! kill -0 "$server_pid" 2>/dev/null; then
        tail -n 40 "$log" >&2
        fail "the command exited before serving"
    fi
    ((SECONDS < deadline)) || {
        tail -n 20 "$log" >&2
        fail "not serving after ${BUILD_TIMEOUT_S:-3600} s"
    }
    sleep 5
    url="$(grep -o 'on http://[0-9.:]*' "$log" | head -n1 | cut -d' ' -f2 || true)"
done
say "serving on $url after ${SECONDS} s"
grep -q "Compiling etcd-client" "$log" && fail "etcd-client was compiled in the default build"

body='{"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 24, "temperature": 0}'
answer="$(curl -sS --max-time 120 "$url/v1/chat/completions" -H 'content-type: application/json' -d "$body")" ||
    fail "the chat request failed"
say "answer: $answer"
content="$(python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"])' <<<"$answer")" ||
    fail "the answer is not a chat completion"
[[ "$content" == *Paris* ]] || fail "the answer does not name Paris: $content"
say "OK: built without protoc, served, and answered the chat: $content"
