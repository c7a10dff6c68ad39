"""Whether every node of the job still lives: a ring of heartbeats between node leaders.

Node k's leader runs a beacon (`beacon.py`, a small process of its own), which listens on a port and
publishes `host port token node` in the job's store through its parent; node k+1's beacon connects,
says the token, and from then on node k's beacon sends it one byte a beat. A watcher that hears nothing
for `timeout_s` tells its parent, which declares node k lost: frozen, powered off or cut off, all of
which leave the connection open and silent (no FIN). A closed connection is no loss: the process ended
(a restart by torchrun, a node leaving after its notice, the end of the job) and the kernel said so; the
job's own collectives and torchrun's agent deal with that. Every node is watched by one other, so a job
with one lost node and any survivor hears of it; the store carries 3 requests per node at the start
(the address set, the watched node's address read) and none after.

The beats come from a process of their own so that nothing the training process does can silence them:
its GIL held by one long C call, its own snapshot being mapped, a full output pipe. A node whose training
process is alive but stuck is the hang watch's (`hangs.py`). The watched node's address is awaited on a
thread of the parent (the store is its), then handed to the beacon, which connects in the background:
neither a node that starts late nor an address that drops connection attempts delays this node's beats.
A beacon that was itself held up (a VM paused) does not blame its neighbour for the silence it could
not hear.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import selectors
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from spotguard.checkpoint.moves.handoff.wire import advertised_host
from spotguard.job.kvstore import IDLE_WAIT, Connection

log = logging.getLogger(__name__)

BEACON = Path(__file__).with_name("beacon.py")
BEACON_START_S = 10.0  # how long the beacon may take to say its port (a fresh interpreter, no imports)
STOPPED = "-"  # written where the address wait blocks, to wake it when the ring stops first


@dataclasses.dataclass(frozen=True)
class PeerLoss:
    """A node declared lost by its watcher (crosses from the beacon's reader thread to the guard's)."""

    node: str  # the silent node
    silent_s: float  # how long it had been silent when declared lost
    watcher: str  # the node that noticed
    index: int | None = None  # the silent node's place in the ring: its ranks are the index-th block of the job's


class Liveness:
    """One node leader's place in the ring: `index` of `count` nodes, named `node`. `on_lost` is called
    once, on the thread that reads the beacon, when the watched node goes silent, unless
    `excused(node)` (a node leaving after its notice). OSError when the beacon cannot start."""

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
        self.on_lost = on_lost
        self.excused = excused
        self.watched: str | None = None  # the node this one watches, once its address is known
        self.stopping = threading.Event()
        self._token = secrets.token_hex(16)
        self._host = advertised_host()
        self._beacon, self._port = _start_beacon(self._host, self._token, timeout_s)
        self._upstream = _Upstream(self)
        self._reader: threading.Thread | None = None
        self._lost = False
        self._excused = False  # said once that the silent node is leaving

    def start(self) -> None:
        self.store.set(f"{self.prefix}{self.index}", f"{self._host} {self._port} {self._token} {self.node}")
        self._upstream.start()
        self._reader = threading.Thread(target=self._read, name="spotguard-liveness", daemon=True)
        self._reader.start()

    def stop(self) -> None:
        """Leave the ring: the beacon ends and its connections close, which the watcher takes for an end."""
        self.stopping.set()
        self._upstream.stop()
        _close(self._beacon.stdin)
        try:
            self._beacon.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self._beacon.kill()
            self._beacon.wait()
        if self._reader is not None:
            self._reader.join(timeout=2)
        _close(self._beacon.stdout)

    def tell(self, line: str) -> None:
        """One line to the beacon (OSError when it has ended)."""
        assert self._beacon.stdin is not None
        self._beacon.stdin.write((line + "\n").encode())
        self._beacon.stdin.flush()

    # ---- the thread that reads the beacon ---------------------------------------------------------
    def _read(self) -> None:
        assert self._beacon.stdout is not None
        try:
            for raw in self._beacon.stdout:
                kind, node, *rest = raw.decode().split(" ", 2)
                rest_s = rest[0].strip() if rest else ""
                if kind == "silent" and self._silent(node, float(rest_s)):
                    return
                if kind == "watching":
                    log.info("node %s watches node %s (lost after %g s of silence)", self.node, node, self.timeout_s)
                elif kind == "unreachable":
                    log.warning("cannot connect to node %s to watch it (%s); trying again in the background", node,
                                rest_s)  # fmt: skip
                elif kind == "ended" and rest_s == "refused":
                    log.info("node %s is not listening any more: its process ended (not a loss)", node)
                elif kind == "ended":
                    log.info("node %s closed its heartbeat: its guard or its process ended (not a loss)", node)
                elif kind == "error":
                    log.debug("the liveness beacon of node %s: %s %s", self.node, node, rest_s)
        except Exception:  # noqa: BLE001 - never take the training down: this node is then simply not watched
            log.exception("reading the liveness beacon failed; node %s no longer watches its neighbour", self.node)
        if not self.stopping.is_set():
            log.warning("the liveness beacon of node %s ended: its neighbour is no longer watched", self.node)

    def _silent(self, node: str, silent_s: float) -> bool:
        """The beacon's word that `node` is silent past the timeout: whether it is now declared lost."""
        if self._lost or self.stopping.is_set():
            return True
        if self.excused(node):  # asked again at every word: the excuse ends if its emergency is called off
            if not self._excused:
                log.info("node %s is silent after its notice: leaving, not lost", node)
                self._excused = True
            return False
        self._lost = True
        log.error("node %s has not answered for %.1f s (peer_timeout_s=%g): declared lost", node, silent_s,
                  self.timeout_s)  # fmt: skip
        watched = (self.index - 1) % self.count  # the ring's upstream neighbour (_Upstream)
        self.on_lost(PeerLoss(node=node, silent_s=round(silent_s, 3), watcher=self.node, index=watched))
        return True


class _Upstream:
    """The watched node (index - 1): its address from the store, awaited on a thread of its own (the node
    may start late), then handed to the beacon."""

    def __init__(self, ring: Liveness) -> None:
        self.ring = ring
        self._key = f"{ring.prefix}{(ring.index - 1) % ring.count}"
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.ring.count > 1:
            self._thread = threading.Thread(target=self._find, name="spotguard-liveness-address", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Wake the thread where it waits for an address that never came, and let it end."""
        if self._thread is None or not self._thread.is_alive():
            return
        if self.ring.watched is None:
            try:
                self.ring.store.set(self._key, STOPPED)
            except Exception as exc:  # noqa: BLE001 - the store is gone: so is the wait
                log.debug("could not wake the liveness address wait: %s", exc)
        self._thread.join(timeout=2)

    def _find(self) -> None:
        try:
            conn = Connection.of(self.ring.store)
            raw = conn.get(self._key, IDLE_WAIT.total_seconds())
            del conn  # its store client closes: one connection per node, only for the wait
        except Exception as exc:  # noqa: BLE001 - the store is gone: nothing to watch
            log.warning("cannot read the address of the node to watch: %s", exc)
            return
        if raw is None or raw.decode() == STOPPED or self.ring.stopping.is_set():
            return
        host, port, token, node = raw.decode().split(" ", 3)
        self.ring.watched = node
        try:
            self.ring.tell(f"watch {host} {port} {token} {node}")
        except (OSError, ValueError) as exc:  # the beacon ended, or its pipe was closed (the ring stops)
            log.warning("node %s cannot watch node %s: its beacon ended (%s)", self.ring.node, node, exc)


def _start_beacon(host: str, token: str, timeout_s: float) -> tuple[subprocess.Popen, int]:
    """The beacon process, listening: it and its port. Its stderr goes nowhere: a blocked stream of the
    training process's must never stop its beats."""
    beacon = subprocess.Popen(
        [sys.executable, "-I", "-S", str(BEACON), host, repr(timeout_s)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert beacon.stdin is not None and beacon.stdout is not None
    try:
        beacon.stdin.write((token + "\n").encode())
        beacon.stdin.flush()
        with selectors.DefaultSelector() as sel:
            sel.register(beacon.stdout, selectors.EVENT_READ)
            said = beacon.stdout.readline() if sel.select(BEACON_START_S) else b""
        kind, _, port = said.decode().partition(" ")
        if kind != "port":
            raise OSError(f"the liveness beacon did not start ({said.decode().strip() or 'no answer'})")
        return beacon, int(port)
    except BaseException:
        beacon.kill()
        beacon.wait()
        raise


def _close(stream: object) -> None:
    try:
        stream.close()  # type: ignore[attr-defined]
    except (OSError, AttributeError):
        pass
