"""Notice -> torch.distributed Store -> every rank.

The store holds an ordered, run-scoped event log: `<prefix>seq` counts events and
`<prefix>event/<i>` holds each one as JSON. Any rank may append; every rank's
listener thread reads the log in order, so all ranks see the same events in the
same order. An interruption is claimed once (`compare_set` on one key: the first
claim wins, later ones are harmless), so many ranks receiving SIGTERM, or a signal
and a metadata notice together, make one event.
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

log = logging.getLogger(__name__)

EMERGENCY = "emergency"  # an interruption notice: save and stop
CHECKPOINT = "checkpoint"  # a save the job keeps running after (interval, rebalance advisory)


def listener_store(store: dist.Store) -> dist.Store:
    """A store client for a background thread.

    A TCPStore client is one socket; cloning gives the listener its own, so its
    polling never queues behind the training thread's store calls.
    """
    try:
        return store.clone()
    except (RuntimeError, NotImplementedError):
        return store  # in-process stores (HashStore) are thread-safe as they are


class EventLog:
    """An append-only log of JSON events in a Store, shared by every rank of a run."""

    def __init__(self, store: dist.Store, prefix: str) -> None:
        self.store = store
        self.prefix = prefix

    def append(self, event: dict[str, Any]) -> int:
        index = int(self.store.add(self.prefix + "seq", 1))
        self.store.set(f"{self.prefix}event/{index}", json.dumps(event))
        return index

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
    """Publishes events through `store` and runs this rank's listener on `listen_store`
    (see `listener_store`), which hands each event to `on_event(index, event)` on the
    listener thread, in log order. The listener checks the log every `poll_s`: 50 ms keeps
    delivery well under 100 ms for a fraction of a percent of one core.
    """

    def __init__(
        self,
        store: dist.Store,
        listen_store: dist.Store,
        prefix: str,
        on_event: Callable[[int, dict[str, Any]], None],
        *,
        poll_s: float = 0.05,
    ) -> None:
        self.log = EventLog(store, prefix)
        self._listen_log = EventLog(listen_store, prefix)
        self.on_event = on_event
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def publish_interruption(self, notice: Notice) -> bool:
        """Announce an interruption to every rank; False if another one was announced first."""
        won = self.log.claim(EMERGENCY, {"type": EMERGENCY, "notice": notice.to_json()})
        if won:
            log.info("published %s interruption notice to all ranks", notice.source)
        return won

    def request_checkpoint(self, reason: str) -> int:
        return self.log.append({"type": CHECKPOINT, "reason": reason})

    def start(self) -> None:
        self._thread = threading.Thread(target=self._listen, name="spotguard-listener", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def _listen(self) -> None:
        seen = 0
        failed = False
        while not self._stop.is_set():
            try:
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
            self._stop.wait(self.poll_s)
