"""What one TCPStore call costs the caller: the figures the coordination's design rests on.

    python bench/store_calls.py [--calls 2000]

One TCPStore server (the default libuv one) in a process of its own, as torchrun hosts it, and one
client in this process on 127.0.0.1. Each call kind is made --calls times in a row and timed on the
caller's clock (median and p99 per call): `set` and `append` (answered by no reply), `add`,
`compare_set` and `check` (one round trip), `get` of a key that is set (a wait and a read). The
baseline is a round trip of the same size on a plain TCP socket to an echo server in another
process (the loopback's own floor).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta

from _common import table

SERVER = """
import sys
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(minutes=1))
print(store.port, flush=True)
sys.stdin.read()  # until the parent closes it
"""
ECHO = """
import socket, sys
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while data := conn.recv(64):
    conn.sendall(data)
"""


def started(code: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def timed(call: Callable[[int], object], calls: int) -> tuple[float, float]:
    """Median and p99 of one call, in µs."""
    for i in range(calls, calls + min(100, calls)):  # warm-up, on keys of its own
        call(i)
    samples = []
    for i in range(calls):
        began = time.perf_counter()
        call(i)
        samples.append(time.perf_counter() - began)
    samples.sort()
    return statistics.median(samples) * 1e6, samples[int(0.99 * (len(samples) - 1))] * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    import torch.distributed as dist

    server, port = started(SERVER)
    try:
        echo, echo_port = started(ECHO)
    except BaseException:
        server.kill()
        raise
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(minutes=1))
        store.set("ready", b"1")
        store.set("counter", b"0")
        sock = socket.create_connection(("127.0.0.1", echo_port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def echo_round_trip(_: int) -> None:
            sock.sendall(b"x" * 32)
            got = 0
            while got < 32:
                got += len(sock.recv(64))

        kinds: list[tuple[str, Callable[[int], object]]] = [
            ("TCP round trip, 32 bytes (the loopback floor)", echo_round_trip),
            ("set", lambda i: store.set(f"k{i}", b"v")),
            ("append", lambda i: store.append("log", b"e")),
            ("add", lambda i: store.add("counter", 1)),
            ("compare_set", lambda i: store.compare_set(f"c{i}", b"", b"v")),
            ("check", lambda i: store.check(["ready"])),
            ("get (key set)", lambda i: store.get("ready")),
        ]
        results = [(name, *timed(call, args.calls)) for name, call in kinds]
        floor = results[0][1]
    finally:
        for proc in (server, echo):
            proc.stdin.close()
            proc.kill()
            proc.wait()
    print(f"{args.calls} calls of each kind, one client, the server in another process, 127.0.0.1")
    print(table(
        ["call", "median µs", "p99 µs", "vs the TCP round trip"],
        [[name, f"{median:.1f}", f"{p99:.1f}", f"{median / floor:.2f}x"] for name, median, p99 in results],
    ))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
