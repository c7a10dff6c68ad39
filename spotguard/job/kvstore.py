"""The job's key-value store (a torch.distributed Store): connections and reads that block.

Every rank of a job talks to one store server (torchrun's TCPStore runs one event loop), so
spotguard's coordination blocks where the server can make it wait, instead of polling: a
`get` of a key that does not exist yet waits on the server until someone sets it, and one
`set` wakes every rank waiting on that key. A blocking call holds its client connection
(a TCPStore client serves one request at a time), so each thread that blocks gets a
`Connection` of its own, cloned from the job's store.

Costs on a TCPStore server, in requests: `get` 2 (a wait, then the read), `set`, `add`,
`append`, `compare_set`, `check` and `delete_key` 1 each.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

# How long a connection waits for a key no one has set yet before it asks again. Waiting is
# free on the server; c10d logs a timed-out wait, so idle waits are long and end by a wake-up.
IDLE_WAIT = timedelta(hours=24)
_ABSENT = "\x00spotguard-absent"  # never a value spotguard writes


def base_store(store: dist.Store) -> dist.Store:
    """The store under any PrefixStores."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


class Connection:
    """A store client that one thread may block on.

    `of(store)` clones the job's store; a store whose clone is the very same object (a
    HashStore) is shared, which is fine for in-process stores: they are thread-safe and
    block without holding other callers up. Only an own connection has its timeout changed.
    A lazy one is cloned when first used (most ranks of a large job never use theirs).
    """

    def __init__(self, store: dist.Store, own: bool) -> None:
        self._store: dist.Store | None = store
        self.own = own
        self._source: dist.Store | None = None
        self._lock = threading.Lock()

    @classmethod
    def of(cls, store: dist.Store, *, lazy: bool = False) -> Connection:
        if lazy:
            connection = cls(store, own=False)
            connection._store, connection._source = None, store
            return connection
        try:
            clone = store.clone()
        except dist.DistError:  # the server did not take the connection: the caller's error (a lazy one retries)
            raise
        except (RuntimeError, NotImplementedError, AttributeError):  # stores that cannot be cloned
            return cls(store, own=False)
        return cls(clone, own=base_store(clone) is not base_store(store))

    @property
    def store(self) -> dist.Store:
        with self._lock:
            if self._store is None:
                made = Connection.of(self._source)  # type: ignore[arg-type]
                self._store, self.own = made.store, made.own
            return self._store

    def get(self, key: str, timeout_s: float) -> bytes | None:
        """The value of `key` once someone sets it, or None after `timeout_s`.

        Store errors other than the timeout (the server is gone) are raised.
        """
        timeout_s = max(timeout_s, 0.001)
        until = time.monotonic() + timeout_s
        try:
            store = self.store
            if self.own:
                store.set_timeout(timedelta(seconds=timeout_s))
                return store.get(key)
            # A shared store's timeout belongs to every caller: wait with an explicit one instead.
            store.wait([key], timedelta(seconds=timeout_s))
            return store.get(key)
        except Exception:
            if time.monotonic() >= until - 0.001:  # stores raise different types for a timeout
                return None
            raise

    def get_now(self, key: str) -> bytes | None:
        """The value of `key`, or None when it is not set, without waiting: one request (a
        compare-and-set whose expected value never matches answers the current value, or
        the expected value itself when the key does not exist)."""
        value = self.store.compare_set(key, _ABSENT, _ABSENT)
        return None if value == _ABSENT.encode() else value


class EventLog:
    """An append-only log of JSON records in a store, in slots `<prefix><i>`, i = 1, 2, ...

    A writer takes the first free slot with `compare_set`: the request that takes a slot also
    writes the record, so no slot is ever taken and left empty, and concurrent writers end up
    in consecutive slots. Readers block on the key of the next slot they have not read (`read`):
    one write wakes all of them.
    """

    def __init__(self, writer: Connection, prefix: str) -> None:
        self.writer = writer  # the connection records are written on
        self.prefix = prefix

    def slot(self, index: int) -> str:
        return f"{self.prefix}{index}"

    def append(
        self, record: dict[str, Any], start: int = 1, *, unless: Callable[[dict[str, Any]], bool] | None = None
    ) -> int | None:
        """Write `record` into the first free slot from `start` on; its index.

        `start` must not lie below a slot that was ever removed (a removed slot would be taken
        again, behind the readers). A record met on the way for which `unless(record)` holds
        ends the search: None, nothing written.
        """
        payload = json.dumps({**record, "id": secrets.token_hex(8)})  # unique: a slot we took says so
        index, store = start, self.writer.store
        while True:
            current = store.compare_set(self.slot(index), "", payload)
            if current == payload.encode():
                return index
            if unless is not None and unless(json.loads(current)):
                return None
            index += 1

    def read(self, connection: Connection, index: int, timeout_s: float) -> dict[str, Any] | None:
        """The record in slot `index` once it is written, or None after `timeout_s`."""
        raw = connection.get(self.slot(index), timeout_s)
        return None if raw is None else json.loads(raw)
