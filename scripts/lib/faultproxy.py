#!/usr/bin/env python3
"""A small fault-injecting TCP proxy, for scripts/partition.py (issue #19).

Forwards each LISTEN=TARGET pair (host:port each) and injects the fault named in MODE_FILE,
read again whenever the file changes:

  pass          forward everything
  stall         half-open: connections are accepted and kept open, nothing is forwarded in
                either direction (a frozen peer or a silently dropping middlebox)
  delay MS      hold every chunk MS milliseconds before forwarding it
  reset P       abort a connection (TCP RST) at each chunk with probability P, as a lossy path
                that gives up does; the rest is forwarded

Usage: faultproxy.py --mode-file FILE LISTEN=TARGET [LISTEN=TARGET ...]
"""

import argparse
import asyncio
import os
import random
import socket
import struct
import sys


class Mode:
    def __init__(self, path):
        self.path = path
        self.stamp = None
        self.kind, self.arg = "pass", 0.0

    def get(self):
        try:
            stamp = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            return self.kind, self.arg
        if stamp != self.stamp:
            self.stamp = stamp
            words = open(self.path).read().split()
            self.kind = words[0] if words else "pass"
            self.arg = float(words[1]) if len(words) > 1 else 0.0
        return self.kind, self.arg


def abort(writer):
    """Closes with a RST (SO_LINGER 0), not a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.close()


async def pump(mode, reader, writer, peer_writer):
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            while True:
                kind, arg = mode.get()
                if kind != "stall":
                    break
                await asyncio.sleep(0.05)
            if kind == "delay":
                await asyncio.sleep(arg / 1000)
            elif kind == "reset" and random.random() < arg:
                abort(writer)
                abort(peer_writer)
                return
            peer_writer.write(data)
            await peer_writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            peer_writer.close()
        except Exception:
            pass


async def serve(mode, listen, target):
    lhost, lport = listen.rsplit(":", 1)
    thost, tport = target.rsplit(":", 1)

    async def handle(reader, writer):
        # A stalled proxy accepts (the kernel would anyway) but does not even connect onward.
        while mode.get()[0] == "stall":
            await asyncio.sleep(0.05)
        try:
            up_reader, up_writer = await asyncio.open_connection(thost, int(tport))
        except OSError:
            abort(writer)
            return
        await asyncio.gather(pump(mode, reader, writer, up_writer), pump(mode, up_reader, up_writer, writer))

    return await asyncio.start_server(handle, lhost, int(lport), reuse_address=True)


async def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode-file", required=True)
    ap.add_argument("pairs", nargs="+", metavar="LISTEN=TARGET")
    a = ap.parse_args()
    mode = Mode(a.mode_file)
    servers = [await serve(mode, *p.split("=", 1)) for p in a.pairs]
    print("faultproxy ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(0)
