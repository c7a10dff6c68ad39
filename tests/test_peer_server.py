"""The snapshot peer server under strangers: a connection takes a place only once its whole request
is in (within the doorway's deadline), bounded in size, and carries the token, so slow drips, wrong
tokens and huge length prefixes cannot lock the job's own ranks out; transfers are capped, a failed
accept() is survived, and a file is served whole from the one open file its trailer was read from."""

from __future__ import annotations

import builtins
import errno
import json
import logging
import os
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from spotguard.checkpoint.moves.handoff import doorway
from spotguard.job.departure import HandoffError
from spotguard.snapshots import shard_file
from spotguard.snapshots.loading import load_shards
from spotguard.snapshots.node_dir import NodeDir, name_of
from spotguard.snapshots.peers import MAX_CONNECTIONS, PeerRuns, PeerServer, fetch_info, push
from tests.floods import closed, failing_accepts, frame, wait_closed
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
    load_runs(address, fetch_info(address, NAME), live)


def load_runs(address: str, info: shard_file.ShardInfo, live: dict) -> None:
    """Load into `live` the body of the peer's file whose trailer is `info`, its blocks checked against it."""
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
        with caplog.at_level(logging.WARNING, logger="spotguard.checkpoint.moves.handoff.doorway"):
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


@pytest.mark.timeout(60)
def test_a_huge_length_prefix_is_refused_at_once_without_allocating_it(tmp_path, snapshot, monkeypatch):
    """2^40 bytes (more than any machine has) and 64 MiB (which it would hand out): both closed as
    soon as their length is read, not at the request deadline, and no buffer of either size exists."""
    monkeypatch.setattr(doorway, "HELLO_DEADLINE_S", 60.0)  # only the size check closes anything here
    path, state = snapshot
    server = PeerServer(NodeDir(tmp_path / "b", "run"))
    host, port, _ = server.address.split()
    strangers = [socket.create_connection((host, int(port))) for _ in range(2)]  # blocking: see `closed`
    tracemalloc.start()
    try:
        for sock, length in zip(strangers, (1 << 40, 64 << 20)):
            sock.sendall(length.to_bytes(8, "big") + b"{")
        gone = wait_closed(strangers, within_s=5.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        for sock in strangers:
            sock.close()
    assert peak < 8 << 20, f"{peak} bytes allocated while refusing"
    assert gone == [True, True]
    try:
        live = {"w": torch.zeros(4096), "step": 0}
        round_trip(server, path, live)
        assert torch.equal(live["w"], state["w"])
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_transfers_past_max_connections_are_refused_busy_at_once_and_served_once_places_free(tmp_path, snapshot):
    """MAX_CONNECTIONS requests with the token that never send their runs each hold a transfer's
    place (a thread); one more is told "busy" at once instead of a thread of its own."""
    path, state = snapshot
    server = PeerServer(NodeDir(tmp_path / "b", "run"))
    host, port, token = server.address.split()
    within(5, push, server.address, path, NAME)
    holders = []
    try:
        for _ in range(MAX_CONNECTIONS):
            sock = socket.create_connection((host, int(port)))  # blocking: see `closed`
            sock.sendall(frame({"token": token, "op": "get", "name": NAME}))  # and no runs frame
            holders.append(sock)
        deadline = time.monotonic() + 10  # until every holder is admitted (on a loaded machine, not at once)
        with pytest.raises(HandoffError, match="busy"):
            while time.monotonic() < deadline:  # a request before that is served, and gives its place back
                within(5, fetch_info, server.address, NAME)
                time.sleep(0.1)
        assert not any(closed(sock) for sock in holders)  # the places were theirs, not given away
        for sock in holders:
            sock.close()
        deadline = time.monotonic() + 5  # each holder's handler sees its connection close, then leaves
        while True:
            try:
                live = {"w": torch.zeros(4096), "step": 0}
                round_trip(server, path, live)
                break
            except HandoffError as exc:
                if "busy" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        assert torch.equal(live["w"], state["w"])
    finally:
        for sock in holders:
            sock.close()
        server.close()


@pytest.mark.timeout(60)
def test_a_failed_accept_is_logged_and_survived(tmp_path, snapshot, monkeypatch, caplog):
    """Out of descriptors (EMFILE) or a connection aborted before it was taken: the server goes on
    listening, and the next push and fetch are served."""
    path, state = snapshot
    server = PeerServer(NodeDir(tmp_path / "b", "run"))
    failures = failing_accepts(monkeypatch, [errno.EMFILE, errno.ECONNABORTED])  # only the server accepts here
    live = {"w": torch.zeros(4096), "step": 0}
    try:
        with caplog.at_level(logging.WARNING, logger="spotguard.checkpoint.moves.handoff.doorway"):
            round_trip(server, path, live)
    finally:
        server.close()
    assert next(failures, None) is None and torch.equal(live["w"], state["w"])
    logged = [r.getMessage() for r in caplog.records if "could not accept" in r.getMessage()]
    assert len(logged) == 2 and all(m.startswith("the snapshot peer server") for m in logged), logged


def replaced_once_opened(monkeypatch: pytest.MonkeyPatch, target, replacement) -> None:
    """The first time `target` is opened, a new file (`replacement`, moved) takes its name right after:
    a replica of the same name landing while the server holds the old one open. Whatever the
    server then reads or sends by the name comes from the new file."""
    real_open = builtins.open

    def opening(file, *args, **kwargs):
        f = real_open(file, *args, **kwargs)
        if not isinstance(file, int) and os.fspath(file) == os.fspath(target) and replacement.exists():
            os.replace(replacement, target)
        return f

    monkeypatch.setattr(builtins, "open", opening)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("replaced_at", ["info", "get"])
def test_a_file_replaced_while_served_is_sent_from_the_file_whose_trailer_was_read(
    tmp_path, snapshot, monkeypatch, replaced_at
):
    """The trailer (`info`) or the runs (`get`) of the file the request opened, whatever takes its name after."""
    path, state = snapshot
    newer = tmp_path / "newer.snap"
    newer_info = write_shard(newer, {"w": torch.arange(4096, dtype=torch.float32) + 1, "step": 5})  # same size
    server = PeerServer(NodeDir(tmp_path / "b", "run"))
    target = server.node_dir.file(NAME)
    try:
        within(5, push, server.address, path, NAME)
        if replaced_at == "info":
            replaced_once_opened(monkeypatch, target, newer)
        info = within(5, fetch_info, server.address, NAME)
        assert info == shard_file.read_info(path)  # the pushed file's trailer, whole
        if replaced_at == "get":
            replaced_once_opened(monkeypatch, target, newer)
            live = {"w": torch.zeros(4096), "step": 0}
            within(5, load_runs, server.address, info, live)  # every block checked against `info`
            assert torch.equal(live["w"], state["w"])
        assert shard_file.read_info(target) == newer_info != info  # it was replaced while being served
    finally:
        server.close()
