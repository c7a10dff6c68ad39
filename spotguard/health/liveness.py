"""Whether every node of the job still lives: a ring of heartbeats between node leaders.

Node k's leader listens on a port of its own and publishes `host port token node` in the job's store;
node k+1's leader (its watcher) connects, says the token, and from then on node k sends it one byte a
beat (a daemon thread: a long training step never delays it). A watcher that hears nothing for
`timeout_s` declares node k lost: frozen, powered off or cut off, all of which leave the connection
open and silent (no FIN). A closed connection is no loss: the process ended (a restart by torchrun, a
node leaving after its notice, the end of the job) and the kernel said so; the job's own collectives
and torchrun's agent deal with that. Every node is watched by one other, so a job with one lost node
and any survivor hears of it; the store carries 3 requests per node at the start (the address set, the
watched node's address read) and none after.

The beats and the judging run on one thread that never blocks: the watched node's address is awaited,
and its connection made, on a second thread, so that neither a node that starts late nor an address
that drops connection attempts delays this node's own beats. A watcher whose own thread was held up
(the GIL held in C code, a VM paused) does not blame its neighbour for the silence it could not hear.
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
from spotguard.job.kvstore import IDLE_WAIT, Connection

log = logging.getLogger(__name__)

BEAT = b"."
HELLO_TIMEOUT_S = 3.0  # a connection that has not said the token by then is dropped
CONNECT_RETRY_S = 5.0  # an address that does not answer (dropped SYNs) is tried again this often
STOPPED = "-"  # written where the address wait blocks, to wake it when the ring stops first


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
        self.stopping = threading.Event()
        self._token = secrets.token_hex(16)
        self._host = advertised_host()
        try:
            self._listener = socket.create_server((self._host, 0))
        except OSError:  # an address peers reach this host on that is not its own (a NAT): listen on all
            self._listener = socket.create_server(("", 0))
        self._upstream = _Upstream(self)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        port = self._listener.getsockname()[1]
        self.store.set(f"{self.prefix}{self.index}", f"{self._host} {port} {self._token} {self.node}")
        self._upstream.start()
        self._thread = threading.Thread(target=self._run, name="spotguard-liveness", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Leave the ring: the connections close, which the watcher takes for an end, not a loss."""
        self.stopping.set()
        self._upstream.stop()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 1)
        self._listener.close()

    # ---- the liveness thread -------------------------------------------------------------------
    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        self._listener.setblocking(False)
        sel.register(self._listener, selectors.EVENT_READ, "accept")
        watchers: list[socket.socket] = []  # connections that said the token: they get the beats
        hellos: dict[socket.socket, tuple[float, bytearray]] = {}  # yet to say it: by when, what came so far
        upstream = self._upstream
        next_beat = last_look = time.monotonic()
        try:
            while not self.stopping.is_set():
                upstream.take_connection(sel)
                for key, _ in sel.select(timeout=min(self.interval_s, max(0.0, next_beat - time.monotonic()))):
                    if key.data == "accept":
                        self._accept(sel, hellos)
                    elif key.data == "hello":
                        self._hello(sel, key.fileobj, hellos, watchers)  # type: ignore[arg-type]
                    else:
                        upstream.readable(sel)
                now = time.monotonic()
                if now - last_look > 2 * self.interval_s + 0.5:  # this thread itself was held up: it heard nothing
                    upstream.heard = max(upstream.heard, now)
                last_look = now
                for conn in [c for c, (until, _) in hellos.items() if until < now]:
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

    def _accept(self, sel: selectors.BaseSelector, hellos: dict[socket.socket, tuple[float, bytearray]]) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        conn.setblocking(False)
        hellos[conn] = (time.monotonic() + HELLO_TIMEOUT_S, bytearray())
        sel.register(conn, selectors.EVENT_READ, "hello")

    def _hello(
        self,
        sel: selectors.BaseSelector,
        conn: socket.socket,
        hellos: dict[socket.socket, tuple[float, bytearray]],
        watchers: list[socket.socket],
    ) -> None:
        said = hellos[conn][1]
        try:
            chunk = conn.recv(64)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        said += chunk
        if chunk and b"\n" not in said and len(said) <= 2 * len(self._token):
            return  # the rest of the line is still on its way
        if not chunk or said.strip() != self._token.encode():
            _drop(sel, conn, hellos)  # not our watcher (a wrong token, a port scan): never beaten to
            return
        sel.unregister(conn)
        del hellos[conn]
        watchers.append(conn)


class _Upstream:
    """The watched node (index - 1): its address from the store and its connection (on a thread of their
    own), then its beats (on the liveness thread)."""

    def __init__(self, ring: Liveness) -> None:
        self.ring = ring
        self.sock: socket.socket | None = None
        self.heard = 0.0
        self.done = ring.count < 2  # nothing to watch, or the watched node ended, or it was declared lost
        self._key = f"{ring.prefix}{(ring.index - 1) % ring.count}"
        self._ready: socket.socket | None = None  # connected by the connecting thread, taken by the liveness thread
        self._thread: threading.Thread | None = None
        self._excused = False  # said once that the silent node is leaving

    def start(self) -> None:
        if not self.done:
            self._thread = threading.Thread(target=self._connect, name="spotguard-liveness-connect", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Wake the connecting thread where it waits for an address that never came, and let it end."""
        if self._thread is None or not self._thread.is_alive():
            return
        if self.ring.watched is None:
            try:
                self.ring.store.set(self._key, STOPPED)
            except Exception as exc:  # noqa: BLE001 - the store is gone: so is the wait
                log.debug("could not wake the liveness address wait: %s", exc)
        self._thread.join(timeout=HELLO_TIMEOUT_S + 1)

    def _connect(self) -> None:
        try:
            self._find_and_connect()
        except Exception:  # noqa: BLE001 - never take the training down; say that this node goes unwatched
            log.exception("node %s cannot watch its neighbour: its losses go unnoticed", self.ring.node)

    def _find_and_connect(self) -> None:
        conn = Connection.of(self.ring.store)
        try:
            raw = conn.get(self._key, IDLE_WAIT.total_seconds())
        except Exception as exc:  # noqa: BLE001 - the store is gone: nothing to watch
            log.warning("cannot read the address of the node to watch: %s", exc)
            return
        del conn  # its store client closes: one connection per node, only for the wait
        if raw is None or raw.decode() == STOPPED or self.ring.stopping.is_set():
            return
        host, port, token, node = raw.decode().split(" ", 3)
        self.ring.watched = node
        told = False
        while not self.ring.stopping.is_set():
            try:
                sock = socket.create_connection((host, int(port)), timeout=HELLO_TIMEOUT_S)
                sock.sendall(token.encode() + b"\n")
            except ConnectionRefusedError:  # its kernel answered: the process has ended
                log.info("node %s is not listening any more: its process ended (not a loss)", node)
                return
            except OSError as exc:  # no answer at all (dropped, filtered): try again, say so once
                if not told:
                    log.warning("cannot connect to node %s to watch it (%s); trying again every %g s",
                                node, exc, CONNECT_RETRY_S)  # fmt: skip
                    told = True
                self.ring.stopping.wait(CONNECT_RETRY_S)
                continue
            sock.setblocking(False)
            self._ready = sock
            log.info("node %s watches node %s (lost after %g s of silence)", self.ring.node, node, self.ring.timeout_s)
            return

    def take_connection(self, sel: selectors.BaseSelector) -> None:
        if self.sock is None and self._ready is not None:
            self.sock, self._ready = self._ready, None
            self.heard = time.monotonic()
            sel.register(self.sock, selectors.EVENT_READ, "beats")

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
        if self.ring.excused(node):  # asked again at every look: the excuse ends if its emergency is called off
            if not self._excused:
                log.info("node %s is silent after its notice: leaving, not lost", node)
                self._excused = True
            return False
        self.done = True
        log.error("node %s has not answered for %.1f s (peer_timeout_s=%g): declared lost", node, silent,
                  self.ring.timeout_s)  # fmt: skip
        self.ring.on_lost(PeerLoss(node=node, silent_s=round(silent, 3), watcher=self.ring.node))
        return True

    def close(self) -> None:
        for sock in (self.sock, self._ready):
            if sock is not None:
                sock.close()


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


def _drop(
    sel: selectors.BaseSelector, conn: socket.socket, hellos: dict[socket.socket, tuple[float, bytearray]]
) -> None:
    sel.unregister(conn)
    hellos.pop(conn, None)
    conn.close()
