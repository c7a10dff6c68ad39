"""Whether every node of the job still lives: a ring of heartbeats between node leaders.

Node k's leader listens on a port of its own and publishes `host port token node` in the job's store;
node k+1's leader (its watcher) connects, says the token, and from then on node k sends it one byte a
beat (a daemon thread: a long training step never delays it). A watcher that hears nothing for
`timeout_s` declares node k lost: frozen, powered off or cut off, all of which leave the connection
open and silent (no FIN). A closed connection is no loss: the process ended (a restart by torchrun, a
node leaving after its notice, the end of the job) and the kernel said so; the job's own collectives
and torchrun's agent deal with that. Every node is watched by one other, so a job with one lost node
and any survivor hears of it; the store carries 3 requests per node at the start (the address set, the
predecessor's read) and none after.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from spotguard.checkpoint.handoff.wire import advertised_host
from spotguard.job.kvstore import Connection

log = logging.getLogger(__name__)

BEAT = b"."
HELLO_TIMEOUT_S = 3.0  # a connection that has not said the token by then is dropped
ADDRESS_WAIT_S = 30.0  # one wait for the watched node's address (it may start later); repeated until stopped


@dataclasses.dataclass(frozen=True)
class PeerLoss:
    """A node declared lost by its watcher (crosses from the liveness thread to the guard's)."""

    node: str  # the silent node
    silent_s: float  # how long it had been silent when declared lost
    watcher: str  # the node that noticed


def beat_interval(timeout_s: float) -> float:
    """Beats come often enough that a few lost to scheduling never add up to the timeout."""
    return min(1.0, timeout_s / 5)


class Liveness:
    """One node leader's place in the ring: `index` of `count` nodes, named `node`. `on_lost` is called
    once, on the liveness thread, when the watched node goes silent, unless `excused(node)` (a node
    leaving after its notice)."""

    def __init__(
        self,
        store: dist.Store,
        prefix: str,
        *,
        index: int,
        count: int,
        node: str,
        timeout_s: float,
        on_lost: Callable[[PeerLoss], None],
        excused: Callable[[str], bool] = lambda node: False,
    ) -> None:
        self.store = store
        self.prefix = f"{prefix}health/node/"
        self.index, self.count, self.node = index, count, node
        self.timeout_s = timeout_s
        self.interval_s = beat_interval(timeout_s)
        self.on_lost = on_lost
        self.excused = excused
        self.watched: str | None = None  # the node this one watches, once its address is known
        self._token = secrets.token_hex(16)
        self._host = advertised_host()
        try:
            self._listener = socket.create_server((self._host, 0))
        except OSError:  # an address peers reach this host on that is not its own (a NAT): listen on all
            self._listener = socket.create_server(("", 0))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        port = self._listener.getsockname()[1]
        self.store.set(f"{self.prefix}{self.index}", f"{self._host} {port} {self._token} {self.node}")
        self._thread = threading.Thread(target=self._run, name="spotguard-liveness", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Leave the ring: the connections close, which the watcher takes for an end, not a loss."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 1)
        self._listener.close()

    # ---- the liveness thread -------------------------------------------------------------------
    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        self._listener.setblocking(False)
        sel.register(self._listener, selectors.EVENT_READ, "accept")
        watchers: list[socket.socket] = []  # connections that said the token: they get the beats
        hellos: dict[socket.socket, float] = {}  # connections yet to say it, and when they must have
        upstream = _Upstream(self)
        next_beat = time.monotonic()
        try:
            while not self._stop.is_set():
                upstream.advance(sel)
                for key, _ in sel.select(timeout=min(self.interval_s, max(0.0, next_beat - time.monotonic()))):
                    if key.data == "accept":
                        self._accept(sel, hellos)
                    elif key.data == "hello":
                        self._hello(sel, key.fileobj, hellos, watchers)  # type: ignore[arg-type]
                    else:
                        upstream.readable(sel)
                now = time.monotonic()
                for conn in [c for c, until in hellos.items() if until < now]:
                    _drop(sel, conn, hellos)
                if now >= next_beat:
                    next_beat = now + self.interval_s
                    watchers[:] = [c for c in watchers if _send(c)]
                if upstream.lost(now):
                    return
        except Exception:  # noqa: BLE001 - never take the training down: this node is then simply not watched
            log.exception("the liveness thread failed; node %s no longer watches its neighbour", self.node)
        finally:
            for conn in [*watchers, *hellos]:
                conn.close()
            upstream.close()
            sel.close()

    def _accept(self, sel: selectors.BaseSelector, hellos: dict[socket.socket, float]) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        conn.setblocking(False)
        hellos[conn] = time.monotonic() + HELLO_TIMEOUT_S
        sel.register(conn, selectors.EVENT_READ, "hello")

    def _hello(
        self,
        sel: selectors.BaseSelector,
        conn: socket.socket,
        hellos: dict[socket.socket, float],
        watchers: list[socket.socket],
    ) -> None:
        try:
            said = conn.recv(64)
        except OSError:
            said = b""
        if said.strip() != self._token.encode():
            _drop(sel, conn, hellos)  # not our watcher (a wrong token, a port scan): never beaten to
            return
        sel.unregister(conn)
        del hellos[conn]
        watchers.append(conn)


class _Upstream:
    """The watched node (index - 1): its address from the store, then its beats."""

    def __init__(self, ring: Liveness) -> None:
        self.ring = ring
        self.sock: socket.socket | None = None
        self.heard = 0.0
        self.done = ring.count < 2  # nothing to watch, or the watched node ended, or it was declared lost
        self._conn: Connection | None = None
        self._address_wait: threading.Thread | None = None
        self._address: str | None = None

    def advance(self, sel: selectors.BaseSelector) -> None:
        """Connect once the address is known; the address is awaited on a thread of its own, so the
        beats never wait for a node that starts late."""
        if self.done or self.sock is not None:
            return
        if self._address is None:
            if self._address_wait is None:
                self._address_wait = threading.Thread(target=self._await_address, name="spotguard-liveness-address",
                                                      daemon=True)  # fmt: skip
                self._address_wait.start()
            return
        host, port, token, node = self._address.split(" ", 3)
        self.ring.watched = node
        try:
            sock = socket.create_connection((host, int(port)), timeout=HELLO_TIMEOUT_S)
            sock.sendall(token.encode() + b"\n")
        except OSError as exc:
            log.warning("cannot connect to node %s to watch it (%s): nobody watches it", node, exc)
            self.done = True
            return
        sock.setblocking(False)
        self.sock = sock
        self.heard = time.monotonic()
        sel.register(sock, selectors.EVENT_READ, "beats")
        log.info("node %s watches node %s (lost after %g s of silence)", self.ring.node, node, self.ring.timeout_s)

    def _await_address(self) -> None:
        watched = (self.ring.index - 1) % self.ring.count
        self._conn = Connection.of(self.ring.store)
        key = f"{self.ring.prefix}{watched}"
        while not self.ring._stop.is_set():
            try:
                raw = self._conn.get(key, ADDRESS_WAIT_S)
            except Exception as exc:  # noqa: BLE001 - the store is gone: nothing to watch
                log.warning("cannot read the address of node %d to watch: %s", watched, exc)
                return
            if raw is not None:
                self._address = raw.decode()
                return

    def readable(self, sel: selectors.BaseSelector) -> None:
        assert self.sock is not None
        try:
            data = self.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self.heard = time.monotonic()
            return
        log.info("node %s closed its heartbeat: its process ended (not a loss)", self.ring.watched)
        sel.unregister(self.sock)
        self.sock.close()
        self.sock = None
        self.done = True

    def lost(self, now: float) -> bool:
        """Whether the watched node is declared lost now (and, once, says so)."""
        if self.done or self.sock is None:
            return False
        silent = now - self.heard
        if silent < self.ring.timeout_s:
            return False
        try:  # a beat (or an end) that came while this thread was not scheduled: `readable` takes it
            self.sock.recv(1, socket.MSG_PEEK)
            return False
        except (BlockingIOError, InterruptedError):
            pass  # nothing there: silent
        except OSError:
            return False  # reset: the node's kernel answered, so it is not silent
        node = self.ring.watched or "?"
        if self.ring.excused(node):
            log.info("node %s is silent after its notice: leaving, not lost", node)
            self.done = True
            return False
        self.done = True
        log.error("node %s has not answered for %.1f s (peer_timeout_s=%g): declared lost", node, silent,
                  self.ring.timeout_s)  # fmt: skip
        self.ring.on_lost(PeerLoss(node=node, silent_s=round(silent, 3), watcher=self.ring.node))
        return True

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


def _send(conn: socket.socket) -> bool:
    """One beat; False once the watcher's end is gone (it is dropped)."""
    try:
        conn.send(BEAT)
        return True
    except BlockingIOError:
        return True  # the watcher's buffer is full: it is not reading, which is its own watcher's business
    except OSError:
        conn.close()
        return False


def _drop(sel: selectors.BaseSelector, conn: socket.socket, hellos: dict[socket.socket, float]) -> None:
    sel.unregister(conn)
    hellos.pop(conn, None)
    conn.close()
