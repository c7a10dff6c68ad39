"""Notice -> torch.distributed Store -> every rank.

The store holds an ordered, run-scoped event log: `<prefix>seq` counts events and
`<prefix>event/<i>` holds each one as JSON. Any rank may append; every rank's
listener thread reads the log in order, so all ranks see the same events in the
same order. An interruption is claimed once per node (`compare_set` on one key per
node: the first claim wins, later ones are harmless), so many ranks receiving SIGTERM,
or a signal and a metadata notice together, make one event; the claims also tell the
agreement which nodes are leaving.

Listeners do not poll when the store has queues (TCPStore's default server, HashStore):
each append also drops the event's index into every rank's inbox queue
(`<prefix>inbox/<rank>`), and a listener blocks on its own inbox on a connection of its
own, so an idle guard makes almost no store requests and wake-ups. A safety tick wakes
it every `tick_s` too, so an event whose publisher died before ringing every inbox costs
seconds, not the event. Stores without queues (FileStore, the legacy TCPStore server)
are polled every `poll_s`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from cloud_adapters.notice import Notice

log = logging.getLogger(__name__)

# A blocking wait on the inbox ends with a timeout (logged by c10d) after the store's timeout;
# the connection that waits gets a long one so an idle guard stays quiet (ticks wake it anyway).
INBOX_WAIT_TIMEOUT = timedelta(hours=24)
_NO_QUEUES = (NotImplementedError, AttributeError)  # FileStore, the legacy TCPStore server, older torch
# A publish (on the watcher's thread) that the store does not answer in this long fails, and the
# watcher tries again at its next poll: c10d's store requests have no timeout of their own.
PUBLISH_TIMEOUT_S = 10.0
EMERGENCY = "emergency"  # an interruption notice: save and stop
CHECKPOINT = "checkpoint"  # a save the job keeps running after (interval, rebalance advisory)


def listener_store(store: dist.Store) -> dist.Store:
    """A store client for a background thread.

    A TCPStore client is one socket; cloning gives the listener its own, so its
    requests never queue behind the training thread's store calls.
    """
    try:
        return store.clone()
    except (RuntimeError, NotImplementedError):
        return store  # in-process stores (HashStore) are thread-safe as they are


def inbox_connection(store: dist.Store) -> dist.Store | None:
    """A connection to block on this rank's inbox, or None when the store has no queues.

    The probe runs on a connection of its own: a store that cannot do queues may drop the
    connection that asked, and the default group's connection must never be the one.
    """
    connection = listener_store(store)
    try:
        connection.queue_len("spotguard/probe")
    except _NO_QUEUES:
        return None
    except RuntimeError as exc:  # e.g. a newer client talking to a legacy server: it hung up on us
        log.info("the store cannot do queues (%s); listeners poll it instead", exc)
        return None
    if _has_own_connection(store):  # a HashStore's clone is the store itself: leave its timeout alone
        connection.set_timeout(INBOX_WAIT_TIMEOUT)
    return connection


def _has_own_connection(store: dist.Store) -> bool:
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return isinstance(store, dist.TCPStore)


class EventLog:
    """An append-only log of JSON events in a Store, shared by the `world_size` ranks of a run."""

    def __init__(self, store: dist.Store, prefix: str, world_size: int) -> None:
        self.store = store
        self.prefix = prefix
        self.world_size = world_size
        self._ring = True  # until the store says it has no queues

    def inbox(self, rank: int) -> str:
        return f"{self.prefix}inbox/{rank}"

    def append(self, event: dict[str, Any]) -> int:
        index = int(self.store.add(self.prefix + "seq", 1))
        self.store.set(f"{self.prefix}event/{index}", json.dumps(event))
        self._ring_inboxes(index)
        return index

    def _ring_inboxes(self, index: int) -> None:
        """Wake every rank's listener. The event is in the log already: a failed ring only
        delays it to that listener's next tick, so it is logged, never raised."""
        if not self._ring:
            return
        try:
            for rank in range(self.world_size):
                self.store.queue_push(self.inbox(rank), str(index))
        except _NO_QUEUES:
            self._ring = False  # every listener polls this store
        except Exception as exc:  # noqa: BLE001 - see above
            log.warning("could not wake every listener for event %d (%s); they find it at their next tick", index, exc)

    def claim(self, name: str, event: dict[str, Any]) -> bool:
        """Append `event` only if nobody has claimed `name` yet; True if this call won."""
        token = json.dumps(event)
        key = f"{self.prefix}claim/{name}"
        if self.store.compare_set(key, "", token).decode() != token:
            return False
        try:
            self.append(event)
        except Exception:
            self.store.delete_key(key)  # release the claim, so a retry (the next poll) can make it
            raise
        return True

    def count(self) -> int:
        return int(self.store.add(self.prefix + "seq", 0))

    def handled(self, index: int) -> None:
        """One more rank is done with event `index`; the last one removes it from the store."""
        key = f"{self.prefix}event/{index}"
        try:
            if int(self.store.add(f"{key}/handled", 1)) == self.world_size:
                self.store.delete_key(key)
                self.store.delete_key(f"{key}/handled")
        except Exception as exc:  # noqa: BLE001 - a leftover event costs a few bytes, not the listener
            log.debug("could not clean up event %d: %s", index, exc)

    def get(self, index: int, wait_s: float = 10.0) -> dict[str, Any] | None:
        """The event at `index`, or None if its writer never finished it (died between add and set).

        A rank that skips an event makes that agreement round abort on every rank, never hang.
        """
        key = f"{self.prefix}event/{index}"
        deadline = time.monotonic() + wait_s
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.005)
        return json.loads(self.store.get(key))


class Broadcast:
    """Publishes events through `store` and runs this rank's listener, which reads the log on
    `listen_store` (see `listener_store`) and hands each event to `on_event(index, event)`
    on the listener thread, in log order. It waits on its inbox through `inbox` (see
    `inbox_connection`), with a tick every `tick_s`; with no inbox connection it checks the
    log every `poll_s`: 50 ms keeps delivery well under 100 ms.
    """

    def __init__(
        self,
        store: dist.Store,
        listen_store: dist.Store,
        prefix: str,
        on_event: Callable[[int, dict[str, Any]], None],
        *,
        inbox: dist.Store | None,
        rank: int,
        world_size: int,
        poll_s: float = 0.05,
        tick_s: float = 5.0,
        publish_timeout_s: float = PUBLISH_TIMEOUT_S,
    ) -> None:
        self.log = EventLog(store, prefix, world_size)
        self.publish_timeout_s = publish_timeout_s
        self._unanswered: threading.Thread | None = None  # a publish the store never answered
        self._listen_log = EventLog(listen_store, prefix, world_size)
        self._inbox = inbox
        self.on_event = on_event
        self.rank = rank
        self.poll_s = poll_s
        self.tick_s = tick_s
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def uses_inbox(self) -> bool:
        return self._inbox is not None

    def publish_interruption(self, notice: Notice) -> bool:
        """Announce an interruption of `notice.node` to every rank; False if that node's was announced first."""
        event = {"type": EMERGENCY, "notice": notice.to_json()}
        won = self._bounded(lambda: self.log.claim(f"{EMERGENCY}/{notice.node}", event))
        if won:
            log.info("published %s interruption notice of node %s to all ranks", notice.source, notice.node)
        return won

    def interrupted_nodes(self, nodes: set[str]) -> set[str]:
        """Which of `nodes` have announced an interruption (read on the listener's connection)."""
        store = self._listen_log.store
        return {node for node in nodes if store.check([f"{self.log.prefix}claim/{EMERGENCY}/{node}"])}

    def request_checkpoint(self, reason: str) -> int:
        return self._bounded(lambda: self.log.append({"type": CHECKPOINT, "reason": reason}))

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

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._listen, name="spotguard-listener", daemon=True)]
        if self.uses_inbox:
            self._threads.append(threading.Thread(target=self._tick, name="spotguard-tick", daemon=True))
        for thread in self._threads:
            thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._threads and self.uses_inbox:
            self._wake("stop")
        for thread in self._threads:
            thread.join(timeout=timeout_s)

    def _wake(self, why: str) -> None:
        try:
            self.log.store.queue_push(self.log.inbox(self.rank), why)
        except Exception as exc:  # noqa: BLE001 - the store is gone: so is the listener's wait
            log.debug("could not wake the listener (%s): %s", why, exc)

    def _tick(self) -> None:
        while not self._stop.wait(self.tick_s):
            self._wake("tick")

    def _listen(self) -> None:
        seen = 0
        failed = False
        while not self._stop.is_set():
            try:
                self._await_news()
                if self._stop.is_set():
                    break
                available = self._listen_log.count()
                events = [self._listen_log.get(i) for i in range(seen + 1, available + 1)]
                failed = False
            except Exception as exc:  # noqa: BLE001 - the store may vanish at shutdown; never kill training
                if not failed and not self._stop.is_set():
                    log.warning("broadcast listener cannot read the store (%s); retrying", exc)
                failed = True
                self._stop.wait(1.0)
                continue
            for event in events:
                seen += 1
                if event is None:
                    log.warning("event %d was announced but never written (its writer died?); skipped", seen)
                    continue
                try:
                    self.on_event(seen, event)
                except Exception:  # noqa: BLE001 - one bad event must not stop the listener
                    log.exception("handling event %d (%s) failed", seen, event.get("type"))
                self._listen_log.handled(seen)

    def _await_news(self) -> None:
        """Return when the log may have grown (or when asked to stop)."""
        if self._inbox is None:
            self._stop.wait(self.poll_s)
            return
        try:
            self._inbox.queue_pop(self.log.inbox(self.rank), True)
        except dist.DistStoreError:
            pass  # the wait timed out: look at the log anyway, then wait again
