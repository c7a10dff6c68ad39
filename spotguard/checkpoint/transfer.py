"""Move step files between local disk and an ObjectStore, many at a time, within a deadline."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from cloud_adapters.storage import ObjectStore, Progress


class DeadlineExceeded(OSError):
    """The transfers did not finish in the time allowed; those still running are abandoned."""


def _run_all(jobs: list[Callable[[], None]], threads: int, deadline: float | None) -> None:
    """Run every job on `threads` daemon threads; raise one error naming all that failed.

    Daemon threads, not an executor: when `deadline` (time.monotonic) passes, the
    caller gets DeadlineExceeded at once and the process can still exit on time;
    transfers still in flight are abandoned (their data is never committed).
    """
    if not jobs:
        return
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for job in jobs:
        todo.put(job)
    errors: list[str] = []
    finished = threading.Semaphore(0)

    def worker() -> None:
        while True:
            try:
                job = todo.get_nowait()
            except queue.Empty:
                return
            try:
                job()
            except Exception as exc:  # noqa: BLE001 - collected and raised together below
                errors.append(f"{type(exc).__name__}: {exc}")
            finished.release()

    for _ in range(max(1, min(threads, len(jobs)))):
        threading.Thread(target=worker, name="spotguard-xfer", daemon=True).start()
    for done in range(len(jobs)):
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not finished.acquire(timeout=timeout):
            raise DeadlineExceeded(f"{len(jobs) - done} of {len(jobs)} transfers unfinished at the deadline")
    if errors:
        raise OSError(f"{len(errors)} of {len(jobs)} transfers failed: " + "; ".join(errors[:3]))


def upload(
    store: ObjectStore,
    items: Iterable[tuple[Path, str]],
    *,
    threads: int,
    deadline: float | None = None,
    progress: Progress | None = None,
) -> None:
    """Upload each (local file, key) pair in parallel, by `deadline` (time.monotonic) if given."""
    _run_all([lambda p=path, k=key: store.put_file(p, k, progress=progress) for path, key in items], threads, deadline)


def download(
    store: ObjectStore, items: Iterable[tuple[str, Path]], *, threads: int, progress: Progress | None = None
) -> None:
    """Download each (key, local file) pair in parallel."""
    _run_all([lambda k=key, p=path: store.get_file(k, p, progress=progress) for key, path in items], threads, None)
