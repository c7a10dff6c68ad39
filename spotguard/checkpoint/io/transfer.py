"""Move step files between local disk and an ObjectStore, many at a time, by a deadline (`cutoff`)."""

from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from cloud_adapters.deadline import Deadline
from cloud_adapters.storage import Abandoned, ObjectStore, Progress

# How often a waiting transfer checks whether its cutoff was brought forward.
_CHECK_EVERY_S = 0.2
T = TypeVar("T")

Job = Callable[[Progress], None]  # one transfer, reporting its bytes through the callback it is given


class DeadlineExceeded(OSError):
    """The transfers did not finish in the time allowed; those still running are abandoned."""


def _run_all(jobs: list[Job], threads: int, cutoff: Deadline, progress: Progress | None) -> None:
    """Run every job on `threads` daemon threads; at the first failure, or once `cutoff` passes, start
    no more and raise at once.

    Daemon threads, not an executor: the caller gets the failure, or DeadlineExceeded within a
    fraction of a second of the cutoff (even one brought forward meanwhile), however long the jobs
    still in flight hang, so the process can still exit on time; what they were doing is abandoned
    (their data is never committed): each job reports its bytes through the progress callback it
    is given, which stops it with Abandoned once the caller has been answered. Each thread runs in
    a copy of the caller's context, so the store deadlines set with `calls_until` hold there too.
    """
    if not jobs:
        return
    if cutoff.passed():
        raise DeadlineExceeded(f"none of {len(jobs)} transfers started: no time was left before the deadline")
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for job in jobs:
        todo.put(job)
    errors: list[BaseException] = []
    finished = threading.Semaphore(0)
    answered = threading.Event()

    def report(delta: int) -> None:
        if answered.is_set():
            raise Abandoned("transfer abandoned: another one failed, or the deadline passed")
        if progress is not None:
            progress(delta)

    def worker() -> None:
        while not (cutoff.passed() or errors):  # after one failure the step cannot be whole: stop
            try:
                job = todo.get_nowait()
            except queue.Empty:
                return
            try:
                job(report)
            except BaseException as exc:  # noqa: BLE001 - any failure of a job is reported by the caller, not lost
                errors.append(exc)
            finally:
                finished.release()

    for _ in range(max(1, min(threads, len(jobs)))):
        context = contextvars.copy_context()
        threading.Thread(target=context.run, args=(worker,), name="spotguard-xfer", daemon=True).start()
    try:
        for done in range(len(jobs)):
            while not finished.acquire(timeout=cutoff.check_within(_CHECK_EVERY_S)):
                if cutoff.passed():
                    raise DeadlineExceeded(f"{len(jobs) - done} of {len(jobs)} transfers unfinished at the deadline")
            if errors:
                described = "; ".join(f"{type(e).__name__}: {e}" for e in errors[:3])
                raise OSError(f"{len(errors)} of {len(jobs)} transfers failed: {described}") from errors[0]
    finally:
        answered.set()


def upload(
    store: ObjectStore,
    items: Iterable[tuple[Path, str]],
    *,
    threads: int,
    cutoff: Deadline | None = None,
    progress: Progress | None = None,
) -> None:
    """Upload each (local file, key) pair in parallel, by `cutoff` if given.

    Uploads abandoned at the cutoff or after a failure are cancelled in stores that can (S3),
    so they stop taking bandwidth and threads from what comes next.
    """
    jobs = [lambda report, p=path, k=key: store.put_file(p, k, progress=report) for path, key in items]
    try:
        _run_all(jobs, threads, cutoff or Deadline(), progress)
    except OSError:  # at the cutoff, or after a failure: what still runs is of no use
        cancel = getattr(store, "cancel_transfers", None)
        if cancel is not None:
            cancel()
        raise


def download(
    store: ObjectStore,
    items: Iterable[tuple[str, Path]],
    *,
    threads: int,
    cutoff: Deadline | None = None,
    progress: Progress | None = None,
) -> None:
    """Download each (key, local file) pair in parallel, by `cutoff` if given."""
    jobs = [lambda report, k=key, p=path: store.get_file(k, p, progress=report) for key, path in items]
    _run_all(jobs, threads, cutoff or Deadline(), progress)


def within(call: Callable[[], T], cutoff: Deadline) -> T:
    """`call()`'s result (or its exception), waited for until `cutoff`: DeadlineExceeded then, and
    the call is abandoned on its daemon thread, as `_run_all` abandons transfers. The thread runs in
    a copy of the caller's context: store deadlines set with `calls_until` hold there too."""
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
    context = contextvars.copy_context()
    threading.Thread(target=context.run, args=(run,), name="spotguard-xfer", daemon=True).start()
    while not done.wait(cutoff.check_within(_CHECK_EVERY_S)):
        if cutoff.passed():
            raise DeadlineExceeded("no answer before the deadline")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]
