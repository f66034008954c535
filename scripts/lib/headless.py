#!/usr/bin/env python3
"""Drives a headless Chromium over the DevTools protocol on a pipe (no websocket, no packages).

usage: headless.py URL [CHROMIUM]

Opens URL in a fresh headless browser, then reads commands on stdin, one a line, and answers
each with one line of JSON on stdout:
    eval EXPRESSION        the expression's value in the page (awaited if a promise)
    screenshot PATH W H    a PNG of the page at W x H CSS pixels, written to PATH
    quit
Used by crates/baton/tests/dashboard.rs (the status page in a real browser) and for the
README's screenshot. Chromium is Debian's `chromium` (scripts/install-deps.sh installs it).
"""
import base64, fcntl, json, os, shutil, subprocess, sys, tempfile

def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    url = sys.argv[1]
    browser = sys.argv[2] if len(sys.argv) > 2 else (shutil.which("chromium") or shutil.which("chromium-browser"))
    if not browser:
        sys.exit("headless.py: no chromium on PATH (scripts/install-deps.sh installs it)")
    # The browser reads commands on fd 3 and writes answers on fd 4 (--remote-debugging-pipe).
    to_browser_r, to_browser_w = os.pipe()
    from_browser_r, from_browser_w = os.pipe()
    high_r = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD, 10)
    high_w = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD, 10)

    def child_fds():
        os.dup2(high_r, 3)
        os.dup2(high_w, 4)

    profile = tempfile.mkdtemp(prefix="baton-headless-")
    proc = subprocess.Popen(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--no-default-browser-check", "--remote-debugging-pipe",
         "--user-data-dir=" + profile, "about:blank"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        preexec_fn=child_fds, close_fds=False,  # fds 3 and 4, made by dup2, are inheritable
    )
    for fd in (to_browser_r, from_browser_w, high_r, high_w):
        os.close(fd)
    out = os.fdopen(to_browser_w, "wb", buffering=0)
    inp = os.fdopen(from_browser_r, "rb", buffering=0)
    buffered = b""
    next_id = 0

    def send(method, params=None, session=None):
        nonlocal next_id, buffered
        next_id += 1
        message = {"id": next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        out.write(json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in buffered:
                chunk = inp.read(65536)
                if not chunk:
                    raise SystemExit("headless.py: the browser closed its pipe")
                buffered += chunk
            raw, buffered = buffered.split(b"\0", 1)
            answer = json.loads(raw)
            if answer.get("id") == next_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer["result"]

    try:
        targets = send("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        session = send("Target.attachToTarget", {"targetId": page["targetId"], "flatten": True})["sessionId"]
        send("Page.enable", session=session)
        send("Page.navigate", {"url": url}, session=session)
        for line in sys.stdin:
            command, _, rest = line.strip().partition(" ")
            try:
                if command == "eval":
                    result = send("Runtime.evaluate", {"expression": rest, "returnByValue": True, "awaitPromise": True},
                                  session=session)
                    if "exceptionDetails" in result:
                        answer = {"error": result["exceptionDetails"].get("text", "exception")}
                    else:
                        answer = {"value": result["result"].get("value")}
                elif command == "screenshot":
                    path, width, height = rest.split()
                    send("Emulation.setDeviceMetricsOverride",
                         {"width": int(width), "height": int(height), "deviceScaleFactor": 1, "mobile": False},
                         session=session)
                    png = send("Page.captureScreenshot", {"format": "png"}, session=session)["data"]
                    with open(path, "wb") as f:
                        f.write(base64.b64decode(png))
                    answer = {"value": path}
                elif command == "quit":
                    break
                else:
                    answer = {"error": f"unknown command {command!r}"}
            except RuntimeError as e:
                answer = {"error": str(e)}
            print(json.dumps(answer), flush=True)
    finally:
        try:
            send("Browser.close")
        except (SystemExit, RuntimeError, OSError):
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(profile, ignore_errors=True)

if __name__ == "__main__":
    main()
