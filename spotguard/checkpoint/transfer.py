"""Move step files between local disk and an ObjectStore, many at a time, within a cutoff."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from cloud_adapters.storage import ObjectStore, Progress

# How often a waiting transfer checks whether its cutoff was brought forward.
_CHECK_EVERY_S = 0.2
T = TypeVar("T")


class DeadlineExceeded(OSError):
    """The transfers did not finish in the time allowed; those still running are abandoned."""


class Cutoff:
    """A time.monotonic() moment after which transfers are abandoned (None: no limit yet).

    It can be brought forward while transfers run against it: an emergency save takes
    the window over from a background save in flight.
    """

    def __init__(self, at: float | None = None) -> None:
        self._at = at
        self._lock = threading.Lock()

    @property
    def at(self) -> float | None:
        return self._at

    def left(self) -> float | None:
        """Seconds until the cutoff (negative once passed), or None without one."""
        at = self._at
        return None if at is None else at - time.monotonic()

    def passed(self) -> bool:
        left = self.left()
        return left is not None and left <= 0

    def check_within(self, most_s: float) -> float:
        """How long to wait before looking at the cutoff again: `most_s` at most, 0 once passed."""
        left = self.left()
        return most_s if left is None else max(0.0, min(left, most_s))

    def bring_forward(self, at: float) -> None:
        with self._lock:
            self._at = at if self._at is None else min(self._at, at)


def _run_all(jobs: list[Callable[[], None]], threads: int, cutoff: Cutoff) -> None:
    """Run every job on `threads` daemon threads; raise one error naming all that failed.

    Daemon threads, not an executor: once `cutoff` passes (even if it is brought forward
    meanwhile), no job starts and the caller gets DeadlineExceeded within a fraction of a
    second, so the process can still exit on time; transfers still in flight are
    abandoned (their data is never committed).
    """
    if not jobs:
        return
    if cutoff.passed():
        raise DeadlineExceeded(f"none of {len(jobs)} transfers started: no time was left before the deadline")
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for job in jobs:
        todo.put(job)
    errors: list[str] = []
    finished = threading.Semaphore(0)

    def worker() -> None:
        while not cutoff.passed():
            try:
                job = todo.get_nowait()
            except queue.Empty:
                return
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - any failure of a job is reported by the caller, not lost
                errors.append(f"{type(exc).__name__}: {exc}")
            finally:
                finished.release()

    for _ in range(max(1, min(threads, len(jobs)))):
        threading.Thread(target=worker, name="spotguard-xfer", daemon=True).start()
    for done in range(len(jobs)):
        while not finished.acquire(timeout=cutoff.check_within(_CHECK_EVERY_S)):
            if cutoff.passed():
                raise DeadlineExceeded(f"{len(jobs) - done} of {len(jobs)} transfers unfinished at the deadline")
    if errors:
        raise OSError(f"{len(errors)} of {len(jobs)} transfers failed: " + "; ".join(errors[:3]))


def upload(
    store: ObjectStore,
    items: Iterable[tuple[Path, str]],
    *,
    threads: int,
    cutoff: Cutoff | None = None,
    progress: Progress | None = None,
) -> None:
    """Upload each (local file, key) pair in parallel, by `cutoff` if given.

    Uploads abandoned at the cutoff are cancelled in stores that can (S3), so they stop
    taking bandwidth and threads from what comes next.
    """
    jobs = [lambda p=path, k=key: store.put_file(p, k, progress=progress) for path, key in items]
    try:
        _run_all(jobs, threads, cutoff or Cutoff())
    except DeadlineExceeded:
        cancel = getattr(store, "cancel_transfers", None)
        if cancel is not None:
            cancel()
        raise


def download(
    store: ObjectStore, items: Iterable[tuple[str, Path]], *, threads: int, progress: Progress | None = None
) -> None:
    """Download each (key, local file) pair in parallel."""
    _run_all([lambda k=key, p=path: store.get_file(k, p, progress=progress) for key, path in items], threads, Cutoff())


def within(call: Callable[[], T], cutoff: Cutoff) -> T:
    """`call()`'s result (or its exception), waited for until `cutoff`: DeadlineExceeded then, and
    the call is abandoned on its daemon thread, as `_run_all` abandons transfers."""
    box: dict[str, object] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller below
            box["error"] = exc
        finally:
            done.set()

    if cutoff.passed():
        raise DeadlineExceeded("no time was left before the deadline")
    threading.Thread(target=run, name="spotguard-xfer", daemon=True).start()
    while not done.wait(cutoff.check_within(_CHECK_EVERY_S)):
        if cutoff.passed():
            raise DeadlineExceeded("no answer before the deadline")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]
