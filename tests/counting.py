"""A Store that counts the requests spotguard makes through it, for tests and the scale bench."""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch.distributed as dist


class Counts:
    """Calls by kind, from any thread."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def add(self, op: str) -> None:
        with self._lock:
            self.calls[op] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.calls)

    def total(self) -> int:
        return server_requests(self.snapshot())


def server_requests(calls: dict[str, int]) -> int:
    """Requests a TCPStore server answers for these client calls (a `get` is a wait, then the read)."""
    return sum(calls.values()) + calls.get("get", 0)


def counting_store(inner: dist.Store, counts: Counts, spares: Iterable[dist.Store] = ()) -> dist.Store:
    """`inner`, counting every call spotguard makes on it and on its clones into `counts`. Its first
    clones are `spares` (connections made beforehand), then clones of `inner`."""
    spare = list(spares)

    class CountingStore(dist.Store):
        def __init__(self, store: dist.Store) -> None:
            super().__init__()
            self.inner = store

        def clone(self) -> dist.Store:
            if spare:
                return CountingStore(spare.pop())
            clone = self.inner.clone()
            return self if clone is self.inner else CountingStore(clone)  # a HashStore's clone is itself

        def set_timeout(self, timeout: timedelta) -> None:
            self.inner.set_timeout(timeout)

        def set(self, key: str, value: Any) -> None:
            counts.add("set")
            self.inner.set(key, value)

        def get(self, key: str) -> bytes:
            counts.add("get")
            return self.inner.get(key)

        def add(self, key: str, value: int) -> int:
            counts.add("add")
            return self.inner.add(key, value)

        def append(self, key: str, value: Any) -> None:
            counts.add("append")
            self.inner.append(key, value)

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            counts.add("compare_set")
            return self.inner.compare_set(key, expected, desired)

        def check(self, keys: list[str]) -> bool:
            counts.add("check")
            return self.inner.check(keys)

        def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
            counts.add("wait")
            self.inner.wait(keys, timeout) if timeout is not None else self.inner.wait(keys)

        def delete_key(self, key: str) -> bool:
            counts.add("delete_key")
            return self.inner.delete_key(key)

    return CountingStore(inner)
