"""Strangers at a listener, for the handoff's and the snapshot peer server's tests (they share a
doorway): frames as the wire has them, watching connections be closed, and accept(2) failing at
the socket boundary."""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from collections.abc import Iterable, Iterator

import pytest


def frame(obj: object) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack("!Q", len(body)) + body


def closed(sock: socket.socket) -> bool:
    """Whether the listener has closed this connection (a FIN, or a reset for bytes it never read).
    `sock` must be in blocking mode: one with a timeout waits for it despite MSG_DONTWAIT."""
    try:
        return sock.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def wait_closed(socks: list[socket.socket], within_s: float) -> list[bool]:
    """Which of `socks` the listener closed within `within_s` (looked at until all are)."""
    gone = [False] * len(socks)
    until = time.monotonic() + within_s
    while not all(gone) and time.monotonic() < until:
        gone = [was or closed(s) for was, s in zip(gone, socks)]
        time.sleep(0.02)
    return gone


def failing_accepts(monkeypatch: pytest.MonkeyPatch, errnos: Iterable[int]) -> Iterator[int]:
    """The next accept() calls in this process raise OSError(errno), one per entry of `errnos`, then
    accept as before; returns the errnos not raised yet (exhausted once every one was). Only the
    listener under test may accept while it is in place."""
    failures = iter(list(errnos))
    real_accept = socket.socket.accept

    def accept(self: socket.socket) -> tuple[socket.socket, object]:
        err = next(failures, None)
        if err is not None:
            raise OSError(err, os.strerror(err))
        return real_accept(self)

    monkeypatch.setattr(socket.socket, "accept", accept)
    return failures
