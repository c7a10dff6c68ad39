"""Move step files between local disk and an ObjectStore, many at a time."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cloud_adapters.storage import ObjectStore


def _run_all(jobs: list, threads: int) -> None:
    """Run every job; raise one error naming all that failed."""
    if not jobs:
        return
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(jobs))), thread_name_prefix="spotguard-xfer") as pool:
        futures = [pool.submit(job) for job in jobs]
    errors = [f"{type(e).__name__}: {e}" for e in (f.exception() for f in futures) if e is not None]
    if errors:
        raise OSError(f"{len(errors)} of {len(jobs)} transfers failed: " + "; ".join(errors[:3]))


def upload(store: ObjectStore, items: Iterable[tuple[Path, str]], *, threads: int) -> None:
    """Upload each (local file, key) pair in parallel."""
    _run_all([lambda p=path, k=key: store.put_file(p, k) for path, key in items], threads)


def download(store: ObjectStore, items: Iterable[tuple[str, Path]], *, threads: int) -> None:
    """Download each (key, local file) pair in parallel."""
    _run_all([lambda k=key, p=path: store.get_file(k, p) for key, path in items], threads)
