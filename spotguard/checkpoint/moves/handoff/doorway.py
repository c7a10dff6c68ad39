"""Where handoff connections come in: a listener that admits a connection only once its hello is in,
bounded in places and time, and survives a failed accept()."""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import time
from typing import Any

from spotguard.checkpoint.moves.handoff.wire import FRAME, MAX_HELLO, json_object
from spotguard.job.departure import HandoffError

log = logging.getLogger(__name__)

# A leaving rank sends its hello (a hundred bytes) as soon as it connects: this bounds the whole
# hello, whatever a peer's byte rate, so a stranger dripping bytes cannot keep a place.
HELLO_DEADLINE_S = 3.0
# Connections still owing their hello: a leaving rank needs one place for milliseconds, so a few
# per expected sender leave room for retries and probes; past the cap the oldest is dropped.
PENDING_HELLOS_MIN = 8
PENDING_HELLOS_PER_SENDER = 2
# accept(2) out of descriptors or kernel memory: the connection stays queued and the listener
# readable, so pause rather than spin until some are given back.
_ACCEPT_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_ACCEPT_EXHAUSTED_PAUSE_S = 0.05
# accept(2) errors of the one connection being taken (gone, refused by a filter), not of the listener.
_ACCEPT_CONNECTION_ERRORS = frozenset(
    {
        errno.ECONNABORTED,
        errno.EPROTO,
        errno.EPERM,
        errno.ENETDOWN,
        errno.ENETUNREACH,
        errno.EHOSTDOWN,
        errno.EHOSTUNREACH,
        errno.ENOPROTOOPT,
        errno.EOPNOTSUPP,
    }
)


class PendingHello:
    """A connection whose hello is still on its way, read as its bytes arrive, never blocking."""

    def __init__(self, conn: socket.socket, deadline: float) -> None:
        conn.setblocking(False)
        self.conn = conn
        self.fd = conn.fileno()  # its key while it waits (a closed socket's fileno() is -1)
        self.deadline = deadline
        self._buf = bytearray()
        self._size = FRAME.size  # the length prefix, then the whole frame

    def read(self) -> dict[str, Any] | None:
        """The hello once it is all in, None until then; raises on a closed connection or a
        malformed or oversized hello."""
        while len(self._buf) < self._size:
            try:
                data = self.conn.recv(self._size - len(self._buf))  # never past the hello
            except BlockingIOError:
                return None
            if not data:
                raise HandoffError("the connection closed before its hello")
            self._buf += data
            if len(self._buf) == FRAME.size:
                (length,) = FRAME.unpack(self._buf)
                if length > MAX_HELLO:
                    raise HandoffError(f"a {length}-byte hello is too large")
                self._size += length
        return json_object(self._buf[FRAME.size :])


class Doorway:
    """The listener and the connections still owing their hello, on one thread: at most `cap` wait,
    each HELLO_DEADLINE_S in all. Past the cap the oldest goes: whoever took the places first cannot
    lock out a sender that comes later (its hello arrives with its connection). A failed accept()
    (out of descriptors, a connection aborted before it was taken) is logged once per kind and survived.
    `name` says whose listener it is in the logs (the handoff's, the snapshot peer server's).
    """

    def __init__(self, listener: socket.socket, cap: int, name: str = "the handoff listener") -> None:
        listener.setblocking(False)
        self._listener = listener
        self._cap = cap
        self._name = name
        self._waiting: dict[int, PendingHello] = {}  # by descriptor, oldest first: the deadlines come in this order
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ)
        self._accept_errors: set[int | None] = set()  # the kinds already logged
        self._dropped = 0

    def poll(self, timeout_s: float) -> list[tuple[socket.socket, dict[str, Any]]]:
        """The connections whose hello came in within `timeout_s`, with it (yet to be checked)."""
        arrived = []
        for key, _ in self._selector.select(timeout_s):
            waiting = self._accept() if key.fileobj is self._listener else self._waiting.get(key.fd)
            if waiting is not None and (hello := self._read(waiting)) is not None:
                arrived.append((waiting.conn, hello))
        self._expire()
        return arrived

    def refuse(self, conn: socket.socket) -> None:
        """Close a connection whose hello was complete but not good."""
        conn.close()
        self._dropped += 1

    def close(self) -> None:
        for waiting in list(self._waiting.values()):
            self._drop(waiting)
        self._selector.close()
        self._listener.close()
        if self._dropped:
            log.warning("%s dropped %d connections without a good first frame", self._name, self._dropped)

    def _accept(self) -> PendingHello | None:
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:  # the connection went (reset) before it was taken
            return None
        except OSError as exc:
            if exc.errno not in _ACCEPT_EXHAUSTED | _ACCEPT_CONNECTION_ERRORS:
                raise  # the listener itself is broken
            self._survive(exc)
            return None
        if len(self._waiting) >= self._cap:
            self._drop(next(iter(self._waiting.values())))
        waiting = PendingHello(conn, time.monotonic() + HELLO_DEADLINE_S)
        self._waiting[waiting.fd] = waiting
        self._selector.register(conn, selectors.EVENT_READ)
        return waiting  # read at once: a sender's hello usually came with its connection

    def _survive(self, exc: OSError) -> None:
        if exc.errno not in self._accept_errors:
            self._accept_errors.add(exc.errno)
            log.warning("%s could not accept a connection (%s); it goes on listening", self._name, exc)
        if exc.errno in _ACCEPT_EXHAUSTED:
            time.sleep(_ACCEPT_EXHAUSTED_PAUSE_S)

    def _read(self, waiting: PendingHello) -> dict[str, Any] | None:
        try:
            hello = waiting.read()
        except Exception as exc:  # noqa: BLE001 - whatever a stranger sends, the listener goes on
            log.debug("%s dropped a connection: %s", self._name, exc)
            self._drop(waiting)
            return None
        if hello is not None:
            self._release(waiting)
        return hello

    def _expire(self) -> None:
        now = time.monotonic()
        while self._waiting and (oldest := next(iter(self._waiting.values()))).deadline <= now:
            self._drop(oldest)

    def _drop(self, waiting: PendingHello) -> None:
        self._release(waiting)
        self.refuse(waiting.conn)

    def _release(self, waiting: PendingHello) -> None:
        self._selector.unregister(waiting.conn)
        del self._waiting[waiting.fd]
