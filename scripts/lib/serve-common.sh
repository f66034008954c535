# Shared by the benchmark scripts that run `baton serve` and drive it (sourced, not run).
#
# The sourcing script defines `die MESSAGE` and sets `repo_root`, `port` and `url` first.
# `find_baton` sets `baton` to $BATON_BIN or a freshly built release binary; `start_server LOG
# ARGS...` runs `baton serve --port $port ARGS...` in the background (logging to LOG) and waits
# for /health; `stop_server` stops it (also on exit, once this file is sourced).

find_baton() {
  baton="${BATON_BIN:-}"
  if [[ -z "$baton" ]]; then
    echo "building baton (release)" >&2
    (cd "$repo_root" && cargo build --release -q -p baton)
    local target_dir="${CARGO_TARGET_DIR:-target}"
    [[ "$target_dir" == /* ]] || target_dir="$repo_root/$target_dir"
    baton="$target_dir/release/baton"
  fi
  [[ -x "$baton" ]] || die "$baton is not an executable"
}

server_pid=""
stop_server() {
  if [[ -n "$server_pid" ]]; then
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
    server_pid=""
  fi
}
trap stop_server EXIT

start_server() {
  local log="$1"
  shift
  "$baton" serve --port "$port" "$@" >"$log" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 300); do
    curl -sf "$url/health" >/dev/null 2>&1 && return 0
    kill -0 "$server_pid" 2>/dev/null || die "the server exited: $(tail -5 "$log")"
    sleep 0.5
  done
  die "the server did not come up in 150 s (see $log)"
}
