"""The snapshot peer server under strangers: a connection takes a place only once its whole request
is in (within the doorway's deadline) and carries the token, so slow drips and wrong tokens cannot
lock the job's own ranks out."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from spotguard.checkpoint.handoff import doorway
from spotguard.snapshots.loading import load_shards
from spotguard.snapshots.node_dir import NodeDir, name_of
from spotguard.snapshots.peers import MAX_CONNECTIONS, PeerRuns, PeerServer, fetch_info, push
from tests.test_snapshots import write_shard

NAME = name_of(5, 0, 1)


def within(seconds: float, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, failing the test if it takes longer than `seconds` (never hangs the suite)."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(fn, *args).result(timeout=seconds)
    finally:
        pool.shutdown(wait=False)


def round_trip(server: PeerServer, path, live: dict) -> float:
    """A replica pushed, then fetched back into `live`; the seconds both took."""
    started = time.monotonic()
    within(5, push, server.address, path, NAME)
    within(5, fetch_back, server.address, live)
    return time.monotonic() - started


def fetch_back(address: str, live: dict) -> None:
    info = fetch_info(address, NAME)
    load_shards(live, {0: info}, lambda s: s, lambda shard, runs: PeerRuns(address, NAME, runs))


class Drippers:
    """`n` strangers that each send a request's length, then one byte a second, and connect again
    whenever the server closes them: each holds whatever it gets for as long as the server lets it."""

    def __init__(self, host: str, port: int, n: int) -> None:
        self._address = (host, port)
        self.socks = [self._open() for _ in range(n)]
        self.reconnects = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drip, daemon=True)
        self._thread.start()

    def _open(self) -> socket.socket:
        sock = socket.create_connection(self._address, timeout=5)
        sock.sendall((1000).to_bytes(8, "big"))  # a 1000-byte request: 1000 s at this rate
        sock.setblocking(False)
        return sock

    def _drip(self) -> None:
        while not self._stop.wait(1.0):
            for i, sock in enumerate(self.socks):
                try:
                    closed = sock.recv(1) == b""
                except BlockingIOError:
                    closed = False
                except OSError:
                    closed = True
                if not closed:
                    try:
                        sock.send(b" ")
                        continue
                    except OSError:
                        pass
                sock.close()
                self.socks[i] = self._open()
                self.reconnects += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for sock in self.socks:
            sock.close()


@pytest.fixture
def snapshot(tmp_path):
    path = tmp_path / "shard.snap"
    state = {"w": torch.arange(4096, dtype=torch.float32), "step": 5}
    write_shard(path, state)
    return path, state


@pytest.mark.timeout(60)
def test_slow_drip_connections_past_the_cap_do_not_lock_out_replicas_or_fetches(tmp_path, snapshot, caplog):
    path, state = snapshot
    server = PeerServer(NodeDir(tmp_path / "b", "run"))
    host, port, _ = server.address.split()
    drippers = Drippers(host, int(port), MAX_CONNECTIONS + 16)
    try:
        time.sleep(1.5)  # every dripper connected and sending (places taken at accept would all be theirs)
        live = {"w": torch.zeros(4096), "step": 0}
        assert round_trip(server, path, live) < 3.0
        assert torch.equal(live["w"], state["w"])
        time.sleep(doorway.HELLO_DEADLINE_S + 1.5)  # every dripper cut at least once: none keeps a place
        assert drippers.reconnects >= MAX_CONNECTIONS + 16
        assert round_trip(server, path, {"w": torch.zeros(4096), "step": 0}) < 3.0
    finally:
        drippers.close()
    try:
        assert round_trip(server, path, {"w": torch.zeros(4096), "step": 0}) < 3.0  # and after they went
    finally:
        with caplog.at_level(logging.WARNING, logger="spotguard.checkpoint.handoff.doorway"):
            server.close()
    assert any(r.getMessage().startswith("the snapshot peer server dropped") for r in caplog.records)


@pytest.mark.timeout(60)
def test_wrong_token_connections_are_answered_and_closed_without_a_place(tmp_path, snapshot):
    path, state = snapshot
    server = PeerServer(NodeDir(tmp_path / "b", "run"))
    host, port, _ = server.address.split()
    strangers = []
    try:
        for _ in range(MAX_CONNECTIONS + 8):  # each sends its whole request, then keeps its end open
            sock = socket.create_connection((host, int(port)), timeout=5)
            head = json.dumps({"token": "not-the-token", "op": "get", "name": NAME}).encode()
            sock.sendall(len(head).to_bytes(8, "big") + head)
            strangers.append(sock)
        for sock in strangers:
            length = int.from_bytes(sock.recv(8), "big")
            answer = json.loads(sock.recv(length))
            assert not answer["ok"] and "wrong token" in answer["error"]
            assert sock.recv(1) == b""  # closed by the server: no handler, no slot
        live = {"w": torch.zeros(4096), "step": 0}
        assert round_trip(server, path, live) < 3.0
        assert torch.equal(live["w"], state["w"])
    finally:
        for sock in strangers:
            sock.close()
        server.close()
