#!/usr/bin/env python3
"""`baton serve --device cuda` colocated and as 1 prefill + 1 decode worker on one GPU (pull,
push, layer-wise), then a conductor with a prefill and a decode `baton worker --device cuda`:
each layout's completions against `baton generate --device cuda`, a chat answer, and a
64-stream storm on a 64-block pool that must end with 0 failures after the first token, 0
hangs and every KV block back; the host tier under a full device arena (same answers when a
prefix comes back from host memory); and a CPU prefill worker handing KV to a GPU decode worker
of the same KV type (answers equal `baton generate --device cpu`), and one of another KV type
(every request run whole on the decode worker, none split); and MemServe's PD-Caching 3
across two GPU workers (a two-turn session: both answers equal `baton generate`'s, turn 2
computing and handing over only what each side lacks); cross-instance fetch of a cached prefix
between GPU workers, then again with the worker holding it killed while a pull of its device
memory is open (every answer still right, the survivors still serving). Part of scripts/gpu-check.sh; runs alone too:

    python3 scripts/gpu_serve_check.py BATON_BIN OUT_DIR
"""
import json, os, socket, subprocess, sys, time, urllib.request
bin_, out = sys.argv[1], sys.argv[2]
# BATON_CHECK_DEVICE=cpu runs the same checks on the CPU (a dry run of this script without a GPU).
device = os.environ.get("BATON_CHECK_DEVICE", "cuda")
model = "fixtures/models/tiny-llama"
prompts = ["Disaggregated inference separates prefill and decode.", "Mooncake", "A"]
def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=60))
def metric(port, name, label=""):
    """The sum of metric `name` (bare, over its labels, or one labelled series such as
    'baton_kv_transfers_total{transport="device"}') on the server at `port`, over the lines that
    also contain `label`."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines()
               if l.startswith(name) and l[len(name):len(name) + 1] in ("{", " ") and label in l)
def first_answer(port, prompt, max_tokens):
    """A completion from a cluster that may still be coming up (its workers joining): retried for
    up to 90 s; None if it never answered."""
    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            return post(port, "/v1/completions", {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        except Exception:
            time.sleep(0.5)
    return None
def serve(args, log):
    """Starts `baton serve --device DEVICE --model MODEL ARGS` on a free port, waits for /health."""
    port = free_port()
    proc = subprocess.Popen([bin_, "serve", "--device", device, "--model", model, "--port", str(port), *args],
                            stdout=open(os.path.join(out, log), "a"), stderr=subprocess.STDOUT)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1); break
        except Exception:
            time.sleep(0.1)
    return proc, port
expected = {}
for p in prompts:
    r = subprocess.run([bin_, "generate", "--device", device, "--model", model, "--prompt", p, "--max-tokens", "16", "--json"],
                       capture_output=True, text=True, timeout=120)
    expected[p] = json.loads(r.stdout)["text"]
ok = True
for layout in (["--colocated", "1"], ["--prefill", "1", "--decode", "1", "--kv-transfer", "pull"],
               ["--prefill", "1", "--decode", "1", "--kv-transfer", "push"],
               ["--prefill", "1", "--decode", "1", "--kv-transfer", "layerwise"]):
    proc, port = serve(["--num-blocks", "64", *layout], "serve.log")
    try:
        same = 0
        for p in prompts:
            r = post(port, "/v1/completions", {"model": "tiny-llama", "prompt": p, "max_tokens": 16, "temperature": 0})
            same += r["choices"][0]["text"] == expected[p]
        chat = post(port, "/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8})
        # A storm on the small pool: 64 streams at once.
        storm = subprocess.run([bin_, "bench", "storm", "--url", f"http://127.0.0.1:{port}", "--model", "tiny-llama",
                                "--concurrency", "64", "--max-tokens", "48", "--kv-blocks", "64", "--timeout-s", "120"],
                               capture_output=True, text=True, timeout=300)
        # Every block back: no worker holds KV (used = not free and not merely cached).
        used = None
        for _ in range(50):
            m = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            used = sum(int(float(l.split()[-1])) for l in m.splitlines()
                       if l.startswith("baton_kv_blocks{") and 'state="used"' in l)
            if used == 0:
                break
            time.sleep(0.1)
        print(f"  {' '.join(layout)}: {same}/{len(prompts)} completions equal `baton generate --device cuda`; "
              f"chat answered ({chat['usage']['completion_tokens']} tokens); KV blocks held after the storm: {used}; "
              "storm (kv_blocks concurrency completed refused failed_before failed_after hung wall_s tokens/s): "
              + " ".join(storm.stdout.strip().splitlines()[-1:]))
        ok &= same == len(prompts) and storm.returncode == 0 and used == 0
        if storm.returncode != 0:
            print(storm.stdout[-2000:], storm.stderr[-2000:])
    finally:
        proc.terminate(); proc.wait(timeout=30)
# The host tier under a full device arena: 32 device blocks, 512 host blocks, six prompts of
# ~15 blocks each, twice. The second round finds each prompt's prefix evicted to host memory and
# copied back beside the step; its answers must equal the first round's (float32, so that a
# prefix served from the cache and one computed afresh cannot round apart).
words = ["Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot"]
tier_prompts = [w + ": " + "the prefill worker computes the prompt and the decode worker continues it, " * 8 for w in words]
proc, port = serve(["--dtype", "float32", "--num-blocks", "32", "--host-kv-blocks", "512", "--colocated", "1"], "serve-tiers.log")
try:
    rounds, prompt_tokens = [], 0
    for _ in range(2):
        answers = []
        for p in tier_prompts:
            r = post(port, "/v1/completions", {"model": "tiny-llama", "prompt": p, "max_tokens": 8, "temperature": 0})
            answers.append(r["choices"][0]["text"]); prompt_tokens = r["usage"]["prompt_tokens"]
        rounds.append((answers, metric(port, "baton_prefix_cache_hits_tokens_total"), metric(port, "baton_kv_index_blocks", 'tier="host"')))
    same = sum(a == b for a, b in zip(rounds[0][0], rounds[1][0]))
    hits = rounds[1][1] - rounds[0][1]
    print(f"  host tier under a 32-block device arena: {len(tier_prompts)} prompts of {prompt_tokens} tokens, twice: "
          f"{same}/{len(tier_prompts)} second-round answers equal the first; prompt tokens served from the cache in "
          f"the second round {hits:.0f} of {len(tier_prompts) * prompt_tokens}; blocks in the host tier after the first "
          f"round {rounds[0][2]:.0f}")
    ok &= same == len(tier_prompts) and hits > 0 and rounds[0][2] > 0
finally:
    proc.terminate(); proc.wait(timeout=30)
def spawn_cluster(conductor_args, worker_args, more_modes=()):
    """A conductor (serving the registry) with `conductor_args`, a prefill and a decode `baton
    worker` with `worker_args[role]`, and a conductor per mode in `more_modes` following the
    first's registry. Returns the processes (for `stop`) and each conductor's port by mode."""
    env = dict(os.environ, BATON_CLUSTER_SECRET="gpu-check")
    log = open(os.path.join(out, "cluster.log"), "a")
    run = lambda args: subprocess.Popen([bin_, *args], env=env, stdout=log, stderr=subprocess.STDOUT)
    port = free_port()
    procs, ports = [run(["conductor", "--model", model, "--port", str(port), *conductor_args])], {"pull": port}
    registry = f"http://127.0.0.1:{port}"
    for role in ("prefill", "decode"):
        procs.append(run(["worker", "--role", role, "--registry", registry, "--model", model, "--port", str(free_port()),
                          "--kv-port", str(free_port()), *worker_args[role]]))
    for mode in more_modes:
        ports[mode] = free_port()
        procs.append(run(["conductor", "--model", model, "--port", str(ports[mode]), "--registry", registry, "--kv-transfer", mode]))
    return procs, ports


def stop(procs):
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=30)


def cluster(label, worker_args, modes, want, transport):
    """A conductor (pull) and a prefill and a decode `baton worker` (`worker_args[role]`), plus a
    conductor per other mode over the same workers; each mode's completions must equal `want`
    and its hand-offs all go by `transport`. Returns whether they did."""
    procs, ports = spawn_cluster([], {r: ["--num-blocks", "64", *a] for r, a in worker_args.items()}, modes[1:])
    passed = True
    try:
        for mode, p_ in ports.items():
            answer = first_answer(p_, prompts[0], 16)
            same = sum(post(p_, "/v1/completions", {"model": "tiny-llama", "prompt": p, "max_tokens": 16, "temperature": 0})["choices"][0]["text"] == want[p]
                       for p in prompts) if answer else 0
            # Each of the 1 + len(prompts) requests handed over once; the counts reach the
            # conductor with the workers' reports, which may come just after the answers.
            moved, deadline = {}, time.time() + 5
            while answer and sum(moved.values()) < 1 + len(prompts) and time.time() < deadline:
                moved = {t: metric(p_, f'baton_kv_transfers_total{{transport="{t}"}}') for t in ("device", "shm", "tcp")}
                time.sleep(0.05)
            moved = {t: moved.get(t, 0.0) for t in ("device", "shm", "tcp")}
            print(f"  baton conductor ({mode}) + {label}: {same}/{len(prompts)} completions equal the reference; "
                  f"hand-offs by transport: {moved} ({transport} expected)")
            passed &= same == len(prompts) and moved[transport] > 0 and sum(moved.values()) == moved[transport]
    finally:
        stop(procs)
    return passed


# The same as separate processes: a conductor, and a prefill and a decode `baton worker --device cuda`,
# whose KV moves device to device (CUDA IPC: the workers find at CONNECT that both arenas are on
# this host's GPU); two more conductors over the same workers hand off by push and layer-wise push.
gpu = ["--device", device]
ok &= cluster("baton worker --device cuda (prefill, decode), against `baton generate --device cuda`",
              {"prefill": gpu, "decode": gpu}, ("pull", "push", "layerwise"), expected, "device")
# A CPU prefill worker handing KV to a GPU decode worker of the same model and KV type (float32):
# through host shared memory (the CPU side has no device arena), then uploaded; the answers must
# be the CPU engine's (float32 on the GPU matches it token for token: the correctness part).
cpu_expected = {}
for p in prompts:
    r = subprocess.run([bin_, "generate", "--device", "cpu", "--model", model, "--prompt", p, "--max-tokens", "16", "--json"],
                       capture_output=True, text=True, timeout=120)
    cpu_expected[p] = json.loads(r.stdout)["text"]
ok &= cluster("baton worker --device cpu (prefill) and --device cuda --dtype float32 (decode), against `baton generate --device cpu`",
              {"prefill": ["--device", "cpu"], "decode": [*gpu, "--dtype", "float32"]}, ("pull", "push"), cpu_expected, "shm")


def kv_types_differ():
    """A CPU prefill worker (float32 KV) and a GPU decode worker (bfloat16 KV) cannot exchange KV:
    the conductor must run each request whole on the decode worker (counted in
    `baton_kv_incompatible_routes_total`), its answers those of `baton generate --device cuda`,
    and nothing moved. Returns whether it did."""
    procs, ports = spawn_cluster([], {"prefill": ["--device", "cpu"], "decode": gpu})
    port = ports["pull"]
    try:
        answer = first_answer(port, prompts[0], 16)
        same = sum(post(port, "/v1/completions", {"model": "tiny-llama", "prompt": p, "max_tokens": 16, "temperature": 0})["choices"][0]["text"] == expected[p]
                   for p in prompts) if answer else 0
        whole, moved = metric(port, "baton_kv_incompatible_routes_total"), metric(port, "baton_kv_transfers_total")
        print(f"  conductor + baton worker --device cpu (prefill, float32 KV) and --device cuda (decode, bfloat16 KV): "
              f"{same}/{len(prompts)} completions equal `baton generate --device cuda`; requests run whole on the decode "
              f"worker {whole:.0f} of {1 + len(prompts)}; KV transfers {moved:.0f}")
        return same == len(prompts) and whole == 1 + len(prompts) and moved == 0
    finally:
        stop(procs)


ok &= kv_types_differ()


def pd_caching_3():
    """MemServe's PD-Caching 3 across GPU worker processes (float32, 4-token blocks): a two-turn
    session whose turn 2 computes only what the prefill worker lacks (turn 1's answer came back
    into its cache) and hands over only what the decode worker lacks, device to device; both
    turns' answers must equal `baton generate`'s. Returns whether they did."""
    f32 = [*gpu, "--dtype", "float32"]
    def generate(prompt):
        r = subprocess.run([bin_, "generate", *f32, "--model", model, "--prompt", prompt, "--max-tokens", "8", "--json"],
                           capture_output=True, text=True, timeout=120)
        return json.loads(r.stdout)["text"]
    turn_1 = prompts[0] + " " + tier_prompts[0]
    want_1 = generate(turn_1)
    turn_2 = turn_1 + want_1 + " And then the story goes on."
    want_2 = generate(turn_2)
    workers = ["--block-size", "4", *f32]
    procs, ports = spawn_cluster(["--pd-caching", "3", "--block-size", "4"], {"prefill": workers, "decode": workers})
    port = ports["pull"]
    try:
        got_1 = first_answer(port, turn_1, 8)
        deadline = time.time() + 10
        while metric(port, "baton_kv_return_tokens_total") == 0 and time.time() < deadline:
            time.sleep(0.05)
        computed, moved, returned = (metric(port, n) for n in ("baton_prefill_tokens_total", "baton_kv_transfer_tokens_total",
                                                         "baton_kv_return_tokens_total"))
        got_2 = post(port, "/v1/completions", {"model": "tiny-llama", "prompt": turn_2, "max_tokens": 8, "temperature": 0})
        computed_2, moved_2 = metric(port, "baton_prefill_tokens_total") - computed, metric(port, "baton_kv_transfer_tokens_total") - moved
        deadline = time.time() + 5
        while metric(port, 'baton_kv_transfers_total{transport="device"}') < 2 and time.time() < deadline:
            time.sleep(0.05)
        device = metric(port, 'baton_kv_transfers_total{transport="device"}')
        same = (got_1 or {}).get("choices", [{}])[0].get("text") == want_1, got_2["choices"][0]["text"] == want_2
        prompt_2 = got_2["usage"]["prompt_tokens"]
        print(f"  PD-Caching 3, conductor + baton worker --device cuda --dtype float32 (prefill, decode): turns equal "
              f"`baton generate` {sum(same)}/2; turn 1's answer returned to the prefill worker ({returned:.0f} tokens); turn 2 of "
              f"{prompt_2} tokens computed {computed_2:.0f} and handed over {moved_2:.0f}; device-to-device hand-offs {device:.0f}")
        return all(same) and returned > 0 and computed_2 < prompt_2 and moved_2 < prompt_2 and device > 0
    finally:
        stop(procs)


ok &= pd_caching_3()


fetch_want = {}


def fetches(kill_holder):
    """Mooncake's cross-instance fetch between GPU workers (float32, so a fetched prefix and one
    computed afresh cannot round apart): a conductor (kv-centric) with two prefill `baton worker
    --device cuda` and a decode one; one prefill worker caches a long prefix, then six requests
    sharing it arrive together and the other prefill worker takes some, pulling the prefix device
    to device. Every answer must equal `baton generate`'s. With `kill_holder` (a build with
    `--features fault-injection`: every fetch pauses 2 s after TRANSFER), the worker holding the
    prefix is killed while a pull of its device memory is open: every answer must still be right
    (the fetcher recomputes) and the survivors' CUDA contexts must go on serving. The arenas are
    CUDA virtual-memory allocations the fetcher imported, so its copy runs after the holder died,
    from memory the import keeps alive (the case legacy CUDA IPC leaves undefined). Returns
    whether all that held, or None when the build has no fault injection."""
    env = dict(os.environ, BATON_CLUSTER_SECRET="gpu-check")
    if kill_holder:
        env["BATON_FAULT_FETCH_DELAY_MS"] = "2000"
    log = open(os.path.join(out, "fetch.log"), "a")
    f32 = [*gpu, "--dtype", "float32"]
    port = free_port()
    registry = f"http://127.0.0.1:{port}"
    procs = {"conductor": subprocess.Popen([bin_, "conductor", "--model", model, "--port", str(port), "--policy", "kv-centric"],
                                           env=env, stdout=log, stderr=subprocess.STDOUT)}
    for name, role in (("p1", "prefill"), ("p2", "prefill"), ("d", "decode")):
        procs[name] = subprocess.Popen([bin_, "worker", "--role", role, "--name", name, "--registry", registry, "--model", model,
                                        "--port", str(free_port()), "--kv-port", str(free_port()), "--num-blocks", "256", *f32],
                                       env=env, stdout=log, stderr=subprocess.STDOUT)
    def holding(worker):
        v = json.load(urllib.request.urlopen(f"{registry}/debug/kv-index", timeout=5))
        return bool((v.get("workers", {}).get(worker) or {}).get("blocks"))
    try:
        prefix = tier_prompts[1]
        first = first_answer(port, prefix, 4)
        if kill_holder and "every pull of a fetched prefix pauses" not in open(os.path.join(out, "fetch.log")).read():
            print("  fetch with the holder killed mid-pull: skipped (this build has no fault injection: "
                  "scripts/gpu-pack.sh builds it with --features cuda,fault-injection)")
            return None
        deadline = time.time() + 5
        while not (holding("p1") or holding("p2")) and time.time() < deadline:
            time.sleep(0.02)
        holder = "p1" if holding("p1") else "p2"
        asks = [f"{prefix} and then, in turn {i}, the story goes on" for i in range(6)]
        for a in asks:
            if a not in fetch_want:
                r = subprocess.run([bin_, "generate", *f32, "--model", model, "--prompt", a, "--max-tokens", "8", "--json"],
                                   capture_output=True, text=True, timeout=120)
                fetch_want[a] = json.loads(r.stdout)["text"]
        want = [fetch_want[a] for a in asks]
        import concurrent.futures
        with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
            futures = [pool.submit(post, port, "/v1/completions", {"model": "tiny-llama", "prompt": a, "max_tokens": 8, "temperature": 0})
                       for a in asks]
            if kill_holder:
                time.sleep(0.7)
                procs[holder].kill()
            got = []
            for f in futures:
                try:
                    got.append(f.result()["choices"][0]["text"])
                except Exception as e:
                    got.append(f"error: {e}")
        same = sum(g == w for g, w in zip(got, want))
        fetched = metric(port, 'baton_kv_fetches_total{outcome="fetched"}')
        recomputed = metric(port, 'baton_kv_fetches_total{outcome="recomputed"}')
        device = metric(port, 'baton_kv_transfers_total{transport="device"}')
        # The survivors still serve: one more request after it all.
        after = post(port, "/v1/completions", {"model": "tiny-llama", "prompt": asks[0], "max_tokens": 8, "temperature": 0})
        after_ok = after["choices"][0]["text"] == want[0]
        what = "with the holder killed mid-pull" if kill_holder else "between GPU workers"
        print(f"  cross-instance fetch {what} (conductor kv-centric + two prefill and a decode baton worker --device cuda "
              f"--dtype float32): {same}/{len(asks)} answers equal `baton generate`; fetches fetched {fetched:.0f}, "
              f"recomputed {recomputed:.0f}; device-to-device transfers {device:.0f}; a request after it all "
              f"{'answered right' if after_ok else 'went wrong'}")
        if kill_holder:
            return same == len(asks) and recomputed >= 1 and after_ok
        return same == len(asks) and fetched >= 1 and recomputed == 0 and device >= 1 and after_ok
    finally:
        stop(list(procs.values()))


ok &= fetches(False)
ok &= fetches(True) is not False
sys.exit(0 if ok else 1)
