#!/usr/bin/env python3
"""Partitions, slow links and broken connections between a conductor and its workers (issue #19).

Needs root (network namespaces), `ip` and `tc`. Builds a cluster in network namespaces the
script creates, all joined by veth pairs to one bridge in a namespace of its own, on addresses
10.77.0.0/24 that exist only inside them (the host's network is never touched, and nothing else
is ever a target):

    bpt-c   10.77.0.1    baton conductor (embedded registry)
    bpt-p1  10.77.0.11   baton worker --role prefill, behind scripts/lib/faultproxy.py
    bpt-p2  10.77.0.12   baton worker --role prefill
    bpt-d1  10.77.0.21   baton worker --role decode
    bpt-d2  10.77.0.22   baton worker --role decode
    bpt-cl  10.77.0.99   this script's client

with the fixture model tiny-llama (real forward passes, greedy). Each scenario streams
requests through the conductor, injects one fault, and checks: every stream ends with the
greedy text of an undisturbed run or with a clean error event, never a hang (a 60 s deadline
per request); a cut-off worker leaves membership within its heartbeat TTL (measured), and joins
again when healed (measured); afterwards every worker is quiet (nothing in flight, every KV block
allocatable). Scenarios:

    cut-decode       a decode worker's link goes down mid-stream (`ip link set ... down`)
    cut-prefill      a prefill worker's link goes down before the requests come (it is still
                     a member until its TTL passes: requests routed to it are lost, run again)
    cut-prefill-mid  the same just after the requests are sent (prefills, KV pulls under way)
    slow-link        a decode worker's link is slowed by `tc ... tbf` (256 kbit/s)
    half-open        the proxy before a prefill worker accepts and forwards nothing, before the
                     requests come (the worker stays a member: only the conductor's
                     --worker-timeout-s frees what is sent to it)
    half-open-mid    the same just after the requests are sent (KV pulls stall)
    delay            the proxy holds every chunk 100 ms
    resets           the proxy aborts connections (RST) at 30% of chunks
    kill-decode      kill -9 a decode worker mid-stream; it is started again
    kill-prefill-mid kill -9 a prefill worker just after the requests are sent (mid-prefill,
                     mid-transfer; mid-push with KV_TRANSFER=push); it is started again

Printed per scenario: requests with the undisturbed text, clean errors, wrong texts, hung
streams, the slowest request's seconds, the conductor's counters (retries: routed again before
streaming; migrations: continued on another worker mid-stream; breaker trips), how long the
cut-off worker took to leave membership and to join again, and whether every worker was quiet
after and how long that took (quiet_s: a hand-off the conductor gave up on is released when the
worker can be reached again, else it waits out the worker's --lease-s). Exits 1 if a stream hung or had a wrong text, or a worker stayed busy.

Usage: sudo scripts/partition.py [SCENARIO ...]   (default: all)
Environment: BATON_BIN (default: target/release/baton, built if missing), TTL_S (workers'
membership TTL, default 2), WORKER_TIMEOUT_S (conductor's --worker-timeout-s, default 3), LEASE_S
(workers' --lease-s, how long handed-off KV no one takes is held, default 5; the quiet check waits
3 times that), REQUESTS (per scenario, default 6), MAX_TOKENS (default 300), ROUNDS (each
scenario this many times: the long version, default 1), KV_TRANSFER (pull or push, default pull).
"""

import atexit
import ctypes
import hashlib
import hmac
import http.client
import json
import os
import secrets
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "fixtures/models/tiny-llama")
NET = "10.77.0"
BRIDGE_NS = "bpt-br"
NODES = {"c": 1, "p1": 11, "p2": 12, "d1": 21, "d2": 22, "cl": 99}
TTL_S = float(os.environ.get("TTL_S", "2"))
WORKER_TIMEOUT_S = float(os.environ.get("WORKER_TIMEOUT_S", "3"))
LEASE_S = int(os.environ.get("LEASE_S", "5"))
REQUESTS = int(os.environ.get("REQUESTS", "6"))
ROUNDS = int(os.environ.get("ROUNDS", "1"))
KV_TRANSFER = os.environ.get("KV_TRANSFER", "pull")
MAX_TOKENS = int(os.environ.get("MAX_TOKENS", "300"))
PROMPT = ("The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill, "
          "and the farmer counts his sheep one by one before the evening rain begins")
CONDUCTOR = f"{NET}.1:8000"
SECRET = secrets.token_hex(16)
OUT = os.path.join(ROOT, ".bench/partition")
MODE_FILE = os.path.join(OUT, "proxy-mode")
CONTROL_PORT, KV_PORT = 9100, 9101
procs = []


def info(msg):
    print(f"partition: {msg}", file=sys.stderr, flush=True)


def sh(*args, check=True):
    return subprocess.run(args, check=check, capture_output=True, text=True)


def ns(node):
    return f"bpt-{node}"


# ---------------------------------------------------------------- topology
def teardown():
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    for node in list(NODES) + ["br"]:
        sh("ip", "netns", "del", ns(node), check=False)


def setup():
    teardown()
    sh("ip", "netns", "add", BRIDGE_NS)
    sh("ip", "-n", BRIDGE_NS, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", BRIDGE_NS, "link", "set", "br0", "up")
    for node, host in NODES.items():
        sh("ip", "netns", "add", ns(node))
        sh("ip", "-n", BRIDGE_NS, "link", "add", f"vb-{node}", "type", "veth", "peer", "name", "eth0", "netns", ns(node))
        sh("ip", "-n", BRIDGE_NS, "link", "set", f"vb-{node}", "master", "br0", "up")
        sh("ip", "-n", ns(node), "addr", "add", f"{NET}.{host}/24", "dev", "eth0")
        sh("ip", "-n", ns(node), "link", "set", "eth0", "up")
        sh("ip", "-n", ns(node), "link", "set", "lo", "up")


def link(node, up):
    sh("ip", "-n", BRIDGE_NS, "link", "set", f"vb-{node}", "up" if up else "down")


def enter(node):
    """Moves this (single-threaded) process into a node's network namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{ns(node)}", os.O_RDONLY)
    if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
        raise OSError(ctypes.get_errno(), "setns")
    os.close(fd)


# ---------------------------------------------------------------- processes
worker_procs, worker_args = {}, {}


def spawn(node, name, args, env=None):
    log = open(os.path.join(OUT, f"{name}.log"), "a")
    p = subprocess.Popen(["ip", "netns", "exec", ns(node)] + args, stdout=log, stderr=subprocess.STDOUT,
                         env={**os.environ, "BATON_CLUSTER_SECRET": SECRET, **(env or {})})
    procs.append(p)
    return p


def spawn_worker(node, args):
    worker_args[node] = args
    worker_procs[node] = spawn(node, node, args)


def kill(node):
    """kill -9 a worker (`ip netns exec` runs it in place, so this is the baton process)."""
    worker_procs[node].kill()
    worker_procs[node].wait()


def restart(node):
    spawn_worker(node, worker_args[node])


def start_cluster(baton):
    spawn("c", "conductor", [baton, "conductor", "--model", MODEL, "--host", f"{NET}.1", "--port", "8000",
                             "--registry", "embedded", "--worker-timeout-s", str(WORKER_TIMEOUT_S),
                             "--kv-transfer", KV_TRANSFER])
    wait_for(lambda: get("/health")[0] in (200, 503), 60, "the conductor to listen")
    registry = f"http://{CONDUCTOR}"
    # A hand-off whose conductor gave up on it (the worker was cut off or silent) is held until
    # its lease ends: short leases, so that "quiet after" is checked within the scenario.
    common = ["--model", MODEL, "--registry", registry, "--ttl-s", str(TTL_S), "--num-blocks", "512",
              "--lease-s", str(LEASE_S)]
    # p1 listens on loopback only; the proxy in its namespace is its address for everyone else.
    spawn("p1", "proxy", [sys.executable, os.path.join(ROOT, "scripts/lib/faultproxy.py"), "--mode-file", MODE_FILE,
                          f"{NET}.11:{CONTROL_PORT}=127.0.0.1:{CONTROL_PORT}", f"{NET}.11:{KV_PORT}=127.0.0.1:{KV_PORT}"])
    wait_for(lambda: "ready" in open(os.path.join(OUT, "proxy.log")).read(), 30, "the proxy to listen")
    spawn_worker("p1", [baton, "worker", "--role", "prefill", "--host", "127.0.0.1", "--advertise", f"{NET}.11",
                        "--port", str(CONTROL_PORT), "--kv-port", str(KV_PORT)] + common)
    for node, role in [("p2", "prefill"), ("d1", "decode"), ("d2", "decode")]:
        host = f"{NET}.{NODES[node]}"
        spawn_worker(node, [baton, "worker", "--role", role, "--host", host, "--port", str(CONTROL_PORT),
                            "--kv-port", str(KV_PORT), "--transport", "tcp"] + common)
    wait_for(lambda: len(members()) == 4, 120, "four workers to join")


def worker_url(node):
    return f"{NET}.{NODES[node]}:{CONTROL_PORT}"


# ---------------------------------------------------------------- HTTP
def get(path, host=CONDUCTOR, headers=None, timeout=5):
    try:
        c = http.client.HTTPConnection(host, timeout=timeout)
        c.request("GET", path, headers=headers or {})
        r = c.getresponse()
        return r.status, r.read()
    except OSError:
        return None, b""


def members():
    status, body = get("/health")
    if status != 200:
        return []
    return sorted(w["name"] for w in json.loads(body).get("workers", []))


COUNTERS = {"retries": "baton_retries_total", "migrations": "baton_migrations_total",
            "breaker_trips": "baton_worker_breaker_trips_total"}


def counters():
    """The conductor's fault counters: requests routed again, streams migrated, breaker trips."""
    _, body = get("/metrics")
    out = dict.fromkeys(COUNTERS, 0)
    for line in body.decode().splitlines():
        for key, metric in COUNTERS.items():
            if line.startswith(metric + " "):
                out[key] = int(float(line.split()[1]))
    return out


def member_node(name):
    """The node of a worker's name (`ROLE-HOST-PORT`)."""
    host = name.split("-")[1]
    return next(n for n, h in NODES.items() if f"{NET}.{h}" == host)


def signed(method, path, body=b""):
    """The cluster proof header (baton_cluster::ClusterSecret::sign_request)."""
    ts, nonce = str(int(time.time() * 1000)), secrets.token_hex(8)
    mac = hmac.new(SECRET.encode(), b"baton-cluster-v1\n", hashlib.sha256)
    for part in [method.encode(), path.encode(), ts.encode(), nonce.encode(), body]:
        mac.update(len(part).to_bytes(8, "little"))
        mac.update(part)
    return {"x-baton-cluster-auth": f"t={ts},n={nonce},sig={mac.hexdigest()}"}


def quiet(node):
    status, body = get("/worker/v1/stats", worker_url(node), signed("GET", "/worker/v1/stats"))
    if status != 200:
        return False, f"stats: HTTP {status}"
    s = json.loads(body)
    idle = all(s.get(k, 0) == 0 for k in ["running", "waiting", "pulling", "incoming", "leased"])
    return idle and s["available_blocks"] == s["total_blocks"], s


class Stream:
    """One streamed completion, read in the background of the scenario (non-blocking reads)."""

    def __init__(self):
        self.text, self.error, self.done, self.first_at = "", None, False, None
        self.start = self.end = time.monotonic()
        body = json.dumps({"model": "tiny-llama", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                           "stream": True})
        try:
            self.conn = http.client.HTTPConnection(CONDUCTOR, timeout=60)
            self.conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
            self.resp = self.conn.getresponse()
            if self.resp.status != 200:
                self.error, self.done = f"HTTP {self.resp.status}: {self.resp.read()[:200]!r}", True
        except OSError as e:
            self.error, self.done = f"request: {e}", True

    def pump(self, until):
        """Reads events until the stream ends or `until()` holds; False on a hang (60 s)."""
        try:
            return self._pump(until)
        finally:
            self.end = time.monotonic()

    def _pump(self, until):
        while not self.done and not until():
            if time.monotonic() - self.start > 60:
                self.error, self.done = "HUNG: no end within 60 s", True
                return False
            try:
                line = self.resp.readline()
            except OSError as e:
                self.error, self.done = f"HUNG or broken: {e}", True
                return False
            if not line:
                self.error, self.done = self.error or "the stream ended without [DONE]", True
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done = True
                break
            event = json.loads(data)
            if "error" in event:
                self.error, self.done = f"error event: {event['error'].get('message')}", True
                break
            self.text += event["choices"][0].get("text") or ""
            if self.first_at is None:
                self.first_at = time.monotonic()
        return True


def wait_for(cond, limit, what):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if cond():
            return time.monotonic()
        time.sleep(0.05)
    raise SystemExit(f"partition: timed out after {limit} s waiting for {what}")


# ---------------------------------------------------------------- scenarios
def run_streams(expected, fault=None, when="first-token", heal=None, gone=None):
    """Streams REQUESTS completions; applies `fault` once every stream has its first token (or
    at once); checks each ends right; measures leaving and rejoining of the `gone` node."""
    before = counters()
    cut_at = time.monotonic()
    if fault and when == "before":
        fault()
    streams = [Stream() for _ in range(REQUESTS)]
    row = {"requests": REQUESTS, "same_text": 0, "clean_errors": 0, "wrong": 0, "hung": 0,
           "left_s": "", "rejoined_s": ""}
    if when == "first-token":
        for s in streams:
            s.pump(lambda s=s: s.first_at is not None)
    if fault and when != "before":
        cut_at = time.monotonic()
        fault()
    if gone:
        left = wait_for(lambda: not any(member_node(m) == gone for m in members()), 30, f"{gone} to leave")
        row["left_s"] = f"{left - cut_at:.2f}"
    for s in streams:
        s.pump(lambda: False)
    if heal:
        healed_at = time.monotonic()
        heal()
        if gone:
            back = wait_for(lambda: any(member_node(m) == gone for m in members()), 60, f"{gone} to join again")
            row["rejoined_s"] = f"{back - healed_at:.2f}"
    row["slowest_s"] = f"{max(s.end - s.start for s in streams):.2f}"
    after = counters()
    for key in COUNTERS:
        row[key] = after[key] - before[key]
    for s in streams:
        if s.error and s.error.startswith("HUNG"):
            row["hung"] += 1
        elif s.error:
            row["clean_errors"] += 1
        elif s.text == expected:
            row["same_text"] += 1
        else:
            row["wrong"] += 1
            info(f"wrong text: {s.text[:80]!r}")
        if s.error:
            info(f"  {s.error}")
    return row


def settle():
    """Waits until every worker is a member and quiet; returns the nodes that stayed busy, and
    the seconds it took until all were quiet (from the end of the scenario's streams and heal)."""
    start = time.monotonic()
    wait_for(lambda: len(members()) == 4, 60, "all four workers to be members")
    busy = []
    for node in ["p1", "p2", "d1", "d2"]:
        deadline = time.monotonic() + 3 * LEASE_S
        ok, stats = quiet(node)
        while not ok and time.monotonic() < deadline:
            time.sleep(0.2)
            ok, stats = quiet(node)
        if not ok:
            busy.append(f"{node}: {stats}")
    return busy, time.monotonic() - start


def proxy(mode):
    with open(MODE_FILE, "w") as f:
        f.write(mode)


def tbf(node, on):
    if on:
        sh("ip", "netns", "exec", ns(node), "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "256kbit",
           "burst", "16kb", "latency", "400ms")
    else:
        sh("ip", "netns", "exec", ns(node), "tc", "qdisc", "del", "dev", "eth0", "root", check=False)


# `when`: the fault comes before the requests are sent, at once after (prefills and transfers
# under way), or once every stream has its first token (decoding).
SCENARIOS = {
    "cut-decode": dict(fault=lambda: link("d1", False), heal=lambda: link("d1", True), gone="d1"),
    "cut-prefill": dict(fault=lambda: link("p2", False), heal=lambda: link("p2", True), gone="p2", when="before"),
    "cut-prefill-mid": dict(fault=lambda: link("p2", False), heal=lambda: link("p2", True), gone="p2", when="now"),
    "slow-link": dict(fault=lambda: tbf("d1", True), heal=lambda: tbf("d1", False), when="before"),
    "half-open": dict(fault=lambda: proxy("stall"), heal=lambda: proxy("pass"), when="before"),
    "half-open-mid": dict(fault=lambda: proxy("stall"), heal=lambda: proxy("pass"), when="now"),
    "delay": dict(fault=lambda: proxy("delay 100"), heal=lambda: proxy("pass"), when="before"),
    "resets": dict(fault=lambda: proxy("reset 0.3"), heal=lambda: proxy("pass"), when="before"),
    "kill-decode": dict(fault=lambda: kill("d1"), heal=lambda: restart("d1"), gone="d1"),
    "kill-prefill-mid": dict(fault=lambda: kill("p2"), heal=lambda: restart("p2"), gone="p2", when="now"),
}


def main():
    if os.geteuid() != 0:
        raise SystemExit("partition: needs root (network namespaces); run it with sudo")
    chosen = sys.argv[1:] or list(SCENARIOS)
    for name in chosen:
        if name not in SCENARIOS:
            raise SystemExit(f"partition: unknown scenario {name!r} (one of {', '.join(SCENARIOS)})")
    baton = os.environ.get("BATON_BIN") or os.path.join(ROOT, "target/release/baton")
    if not os.environ.get("BATON_BIN"):
        info("building baton (release)")
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "baton"], cwd=ROOT, check=True)
    os.makedirs(OUT, exist_ok=True)
    for name in os.listdir(OUT):
        if name.endswith(".log"):
            os.remove(os.path.join(OUT, name))  # logs are appended to (a restarted worker's too)
    proxy("pass")
    expected = json.loads(sh(baton, "generate", "--model", MODEL, "--prompt", PROMPT, "--max-tokens",
                             str(MAX_TOKENS), "--json").stdout)["text"]
    atexit.register(teardown)
    setup()
    enter("cl")
    info(f"cluster in namespaces bpt-*, logs in {OUT}")
    start_cluster(baton)
    rows, failed = [], False
    for name in ["baseline"] + chosen * ROUNDS:
        info(name)
        row = run_streams(expected, **SCENARIOS.get(name, {}))
        if row["breaker_trips"]:
            # A tripped worker is probed back into routing with back-off (at most 5 s apart).
            time.sleep(6)
        busy, row["quiet_s"] = settle()
        row["quiet_s"] = f"{row['quiet_s']:.1f}"
        row["quiet_after"] = "yes" if not busy else "NO"
        for b in busy:
            info(f"  still busy: {b}")
        failed |= bool(row["hung"] or row["wrong"] or busy)
        rows.append((name, row))
    cols = ["requests", "same_text", "clean_errors", "wrong", "hung", "slowest_s", "retries", "migrations",
            "breaker_trips", "left_s", "rejoined_s", "quiet_s", "quiet_after"]
    print(f"TTL {TTL_S} s, conductor --worker-timeout-s {WORKER_TIMEOUT_S} --kv-transfer {KV_TRANSFER}, "
          f"{MAX_TOKENS} tokens a request, {ROUNDS} round(s)")
    print("| scenario | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, row in rows:
        print(f"| {name} | " + " | ".join(str(row[c]) for c in cols) + " |")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
