# Shared by the benchmark scripts that run `baton serve` and drive it (sourced, not run).
#
# The sourcing script defines `die MESSAGE` and sets `repo_root`, `port` and `url` first.
# `find_baton` sets `baton` to $BATON_BIN or a freshly built release binary; `start_server LOG
# ARGS...` runs `baton serve --port $port ARGS...` in the background (logging to LOG) and waits
# for /health; `start_cluster` runs the same as processes, `baton conductor` replicas and `baton
# worker`s (below); `stop_server` stops either (also on exit, once this file is sourced).

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
cluster_pids=()
stop_server() {
  local pid
  for pid in $server_pid "${cluster_pids[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in $server_pid "${cluster_pids[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
  server_pid=""
  cluster_pids=()
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

# start_cluster LOG_PREFIX CONDUCTORS PREFILL DECODE CONDUCTOR_ARGS... -- WORKER_ARGS...
# A multi-process cluster: CONDUCTORS `baton conductor`s on ports $port, $port+1, ... (the first
# serves the embedded registry, the others follow it: replicas routing to the same workers), and
# PREFILL + DECODE `baton worker`s. Both argument lists get --model-like flags from the caller;
# the cluster secret is made here. Waits until every conductor routes to every worker; sets
# `conductor_urls`. Logs go to LOG_PREFIX.conductorN.log and LOG_PREFIX.WORKER.log.
start_cluster() {
  local prefix="$1" conductors="$2" prefill="$3" decode="$4"
  shift 4
  local conductor_args=() worker_args=()
  while [[ $# -gt 0 && "$1" != "--" ]]; do conductor_args+=("$1"); shift; done
  [[ $# -gt 0 ]] && shift
  worker_args=("$@")
  export BATON_CLUSTER_SECRET="bench-$RANDOM-$RANDOM-$RANDOM"
  conductor_urls=()
  local i registry="embedded"
  for ((i = 0; i < conductors; i++)); do
    "$baton" conductor --port $((port + i)) --registry "$registry" "${conductor_args[@]}" \
      >"$prefix.conductor$i.log" 2>&1 &
    cluster_pids+=($!)
    conductor_urls+=("http://127.0.0.1:$((port + i))")
    wait_health "${conductor_urls[$i]}" "$!" "$prefix.conductor$i.log"
    registry="${conductor_urls[0]}"
  done
  local role n
  for role in prefill decode; do
    n=$prefill
    [[ $role == decode ]] && n=$decode
    for ((i = 0; i < n; i++)); do
      "$baton" worker --role "$role" --registry "${conductor_urls[0]}" --port 0 --kv-port 0 \
        "${worker_args[@]}" >"$prefix.$role$i.log" 2>&1 &
      cluster_pids+=($!)
    done
  done
  local url members
  for url in "${conductor_urls[@]}"; do
    for _ in $(seq 1 300); do
      members=$(curl -sf "$url/health" | python3 -c 'import json,sys; print(len(json.load(sys.stdin).get("workers", [])))' 2>/dev/null || echo 0)
      [[ "$members" -eq $((prefill + decode)) ]] && break
      sleep 0.5
    done
    [[ "$members" -eq $((prefill + decode)) ]] \
      || die "$url routes to $members of $((prefill + decode)) workers after 150 s (see $prefix.*.log)"
  done
}

# wait_health URL PID LOG: until URL/health answers (a 503 for no workers yet counts), or the
# process exits.
wait_health() {
  for _ in $(seq 1 300); do
    curl -s -o /dev/null "$1/health" 2>/dev/null && return 0
    kill -0 "$2" 2>/dev/null || die "$1 exited: $(tail -5 "$3")"
    sleep 0.5
  done
  die "$1 did not come up in 150 s (see $3)"
}
