"""Notice -> torch.distributed Store -> every rank.

The store holds a run-scoped, append-only log of JSON events (`kvstore.EventLog`, slots
`<prefix>event/<i>`): a publisher takes the first free slot with one `compare_set` that also
writes the event. Every rank's listener blocks, on a connection of its own, on the key of the
next slot it has not read: the one write that fills the slot wakes every listener at once (the
server answers all of them), and an idle listener makes no request at all. All ranks read the
same events in the same order.

An interruption is claimed once per node (`compare_set` on `<prefix>claim/<node>`: the first
claim wins, later ones are harmless), so many ranks receiving SIGTERM, or a signal and a
metadata notice together, make one event. The winner also appends the node to
`<prefix>claimed`, which the agreement reads once per round to tell which nodes are leaving.

Publishing goes on a store client of its own, made when the guard starts. The job's store client is
shared with torch and the training code, and a c10d client serves one request at a time: a thread
waiting on it (a process group being made while a peer is late, a store barrier) would hold a
notice up for as long as it waits. Nor is it made at the first publish: a new connection can take
seconds (c10d looks up the peer's name for each one; a resolver that drops the query costs its 5 s
timeout), and a notice must not wait for that.

A silent failure (`spotguard.health`: a node lost without a notice, a hang) is claimed once per job
(`<prefix>claim/silent`): the first rank to see one writes one `silent` event, on which every
listener ends its process.

Under `spotguard.run`, rank 0 writes a `join` event for nodes waiting to join the running job: every
rank stops at the step agreed on it, and the job goes on with them in the next generation.

A rank that leaves its Guard writes a `left` event. No agreement can complete without that
rank, so every listener stops at it; this is also how a stopping listener is woken.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from cloud_adapters.notice import Notice
from spotguard.job.kvstore import IDLE_WAIT, Connection, EventLog

log = logging.getLogger(__name__)

# A publish (on the watcher's thread) that the store does not answer in this long fails, and the
# watcher tries again at its next poll: c10d's store requests have no timeout of their own.
PUBLISH_TIMEOUT_S = 10.0
SLOW_PUBLISH_S = 1.0  # a publish slower than this is logged as a warning
EMERGENCY = "emergency"  # an interruption notice: save and stop
CHECKPOINT = "checkpoint"  # a save the job keeps running after (interval, rebalance advisory)
LEFT = "left"  # a rank left its Guard: the listeners stop
SILENT = "silent"  # a failure without a notice (a node lost, a hang): the job ends (spotguard.health)
JOIN = "join"  # nodes wait to join the running job (in-process): every rank stops at the agreed step


class Broadcast:
    """Publishes events through `store` (on `publishing`, a connection of its own) and runs this rank's
    listener, which reads the log on `connection` (its own too, see `Connection`) and hands each event
    to `on_event(index, event)` on the listener thread, in log order. Both are made here unless given.

    Slots are never removed while the job runs (a removed slot could be taken again by a publish
    that read the next slot before the removal, behind every reader); publishing starts its search
    at this rank's own listener's next slot.
    """

    def __init__(
        self,
        store: dist.Store,
        prefix: str,
        on_event: Callable[[int, dict[str, Any]], None],
        *,
        rank: int,
        connection: Connection | None = None,
        publishing: Connection | None = None,
        publish_timeout_s: float = PUBLISH_TIMEOUT_S,
    ) -> None:
        self.store = store  # kept: the store's server may live in this object, and its clones need it
        self.prefix = prefix
        self.publishing = publishing or Connection.of(store)
        self.log = EventLog(self.publishing, prefix + "event/")
        self.connection = connection or Connection.of(store)
        self.on_event = on_event
        self.rank = rank
        self.publish_timeout_s = publish_timeout_s
        self._next = 1  # the next slot the listener reads
        self._unanswered: threading.Thread | None = None  # a publish the store never answered
        self._stop = threading.Event()
        self._left = threading.Event()  # the listener met a `left` event and stopped
        self._thread: threading.Thread | None = None

    def publish_interruption(self, notice: Notice) -> bool:
        """Announce an interruption of `notice.node` to every rank; False if that node's was announced first."""
        event = {"type": EMERGENCY, "notice": notice.to_json()}
        node = str(notice.node)
        key = f"{self.prefix}claim/{EMERGENCY}/{node}"
        started = time.monotonic()
        won = self._bounded(lambda: self._claim(key, event, claimed=node)) is not None
        took = time.monotonic() - started
        if won:  # how long the store took: a slow one delays every rank's save
            log.log(logging.WARNING if took > SLOW_PUBLISH_S else logging.INFO,
                    "published %s interruption notice of node %s to all ranks in %.3f s", notice.source,
                    notice.node, took)  # fmt: skip
        return won

    def publish_silent_failure(self, event: dict[str, Any]) -> int | None:
        """Announce a silent failure to every rank, once per job: its slot, or None if another rank
        announced one first."""
        event = {**event, "type": SILENT}
        return self._bounded(lambda: self._claim(f"{self.prefix}claim/{SILENT}", event))

    def request_checkpoint(self, reason: str) -> int:
        return self._bounded(lambda: self.log.append({"type": CHECKPOINT, "reason": reason}, self._next))

    def request_join(self, nodes: list[int]) -> int:
        """Ask every rank to stop at the next step they agree on, for the joining `nodes` (their numbers)."""
        return self._bounded(lambda: self.log.append({"type": JOIN, "nodes": nodes}, self._next))

    def _claim(self, key: str, event: dict[str, Any], claimed: str | None = None) -> int | None:
        """Append `event` only if nobody has claimed `key` yet; its slot if this call won, else None.
        `claimed`: a node whose interruption this is, added to the claimed nodes first."""
        token = json.dumps(event)
        store = self.publishing.store
        if store.compare_set(key, "", token).decode() != token:
            return None
        try:
            if claimed is not None:
                store.append(self._claimed_key, claimed + "\n")  # before the event: its round must see it
            index = self.log.append(event, self._next)
        except Exception:
            store.delete_key(key)  # release the claim, so a retry (the next poll) can make it
            raise
        assert index is not None  # no `unless`: the record always goes in
        return index

    @property
    def _claimed_key(self) -> str:
        return f"{self.prefix}claimed"

    def claimed_nodes(self) -> set[str]:
        """The nodes that have announced an interruption (one request; on the listener's connection,
        so only the listener thread calls it)."""
        claimed = self.connection.get_now(self._claimed_key)
        return set(claimed.decode().splitlines()) if claimed else set()

    def _bounded(self, call: Callable[[], Any]) -> Any:
        """`call()` on a thread of its own, waited for `publish_timeout_s`: a hung store then costs the
        caller that long, not the store's own timeout, and never more than one stuck thread."""
        if self._unanswered is not None and self._unanswered.is_alive():
            raise TimeoutError("the store has still not answered the previous publish")
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = call()
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                box["error"] = exc

        thread = threading.Thread(target=run, name="spotguard-publish", daemon=True)
        thread.start()
        thread.join(self.publish_timeout_s)
        if thread.is_alive():
            self._unanswered = thread
            raise TimeoutError(f"the store did not answer within {self.publish_timeout_s:g} s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    @property
    def listening(self) -> bool:
        """Whether this rank's listener still reads the log (it stops at a `left` event, or when stopped)."""
        return self._thread is not None and self._thread.is_alive() and not self._left.is_set()

    @property
    def reading(self) -> int:
        """The slot the listener reads or handles now: no rank has gone past a slot below it undecided."""
        return max(1, self._next - 1)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._listen, name="spotguard-listener", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Leave: tell every rank (a `left` event, unless one is in the log already) and let the
        listener end at it."""
        self._stop.set()
        if self._thread is None or not self._thread.is_alive():
            return
        if not self._left.is_set():
            try:
                left = {"type": LEFT, "rank": self.rank}
                self._bounded(lambda: self.log.append(left, self._next, unless=lambda e: e.get("type") == LEFT))
            except Exception as exc:  # noqa: BLE001 - the store is gone: so is the listener's wait
                log.debug("could not write this rank's left event: %s", exc)
        self._thread.join(timeout=timeout_s)

    def _listen(self) -> None:
        failed = False
        while True:  # until a `left` event, or a store error once stopping
            try:
                event = self.log.read(self.connection, self._next, IDLE_WAIT.total_seconds())
            except Exception as exc:  # noqa: BLE001 - the store may vanish at shutdown; never kill training
                if self._stop.is_set():
                    return
                if not failed:
                    log.warning("broadcast listener cannot read the store (%s); retrying", exc)
                failed = True
                self._stop.wait(1.0)
                continue
            if failed:
                log.info("broadcast listener reads the store again")
                failed = False
            if event is None:  # an idle wait ended: wait again
                if self._stop.is_set():
                    return
                continue
            index = self._next
            self._next += 1
            if event.get("type") == LEFT:
                self._left.set()
                if event.get("rank") != self.rank:
                    log.info("rank %s left its guard: no agreement can complete any more", event["rank"])
                return
            try:
                self.on_event(index, event)
            except Exception:  # noqa: BLE001 - one bad event must not stop the listener
                log.exception("handling event %d (%s) failed", index, event.get("type"))
