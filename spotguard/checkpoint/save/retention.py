"""Delete what is no longer needed: committed steps beyond `keep_last`, and stale leftovers.

Only committed steps older than the newest `keep_last` committed ones are deleted, the
manifest first (so a half-deleted step is simply uncommitted, never mistaken for good).
Older means committed earlier (the manifest's `created_at`), not a lower step number: a job
restarted from scratch, or resumed from an older step, saves low-numbered steps that are its
newest. Uncommitted leftovers on a filesystem (staging siblings, step directories without a
manifest) are removed once they are older than STALE_AFTER_S, so a save that may still be
writing one is never disturbed. In an object store, a step without a manifest that is older
than the newest committed step is an abandoned upload (saves run one at a time, and a resumed
job saves only newer steps): its objects are deleted, and our unfinished multipart uploads are
aborted. Only keys laid out as ours (`step-N/file`) are ever touched, and the store calls of
each cleanup end within RETENTION_TIMEOUT_S: a dead store must not hold a save (or the exit).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Container, Iterable
from pathlib import Path

from cloud_adapters.deadline import Deadline
from cloud_adapters.retry import calls_until
from cloud_adapters.storage import LocalStore, ObjectStore
from spotguard.checkpoint.comm import Comm
from spotguard.checkpoint.format.commit import is_committed
from spotguard.checkpoint.format.layout import (
    MANIFEST_NAME,
    is_step_file,
    manifest_key,
    parse_leftover,
    parse_step_dir,
    step_dir_name,
)
from spotguard.checkpoint.format.listing import STEP_PREFIX, committed_manifests, scan, step_of_key
from spotguard.checkpoint.format.runs import RunClaim

log = logging.getLogger(__name__)

STALE_AFTER_S = 600.0
RETENTION_TIMEOUT_S = 30.0


def keep_last(
    store: ObjectStore,
    keep: int,
    *,
    key: bytes | None = None,
    skip: Container[int] = (),
    saved: int | None = None,
    timeout_s: float = RETENTION_TIMEOUT_S,
) -> list[int]:
    """Delete committed steps below the newest `keep` (>= 1, checked by the Checkpointer) committed
    ones; return the deleted steps.

    Newest means the highest step, the order in which resume tries them, never the time in the
    manifest (written by whichever host committed it, whose clock may be days off). Committed
    means what it means to resume: a step whose manifest is malformed, unsafe, contradicted by the
    listing or (with a `key`) not signed with it, or one of `skip` (steps resume found bad),
    neither counts (a bad newer step must not cost a good older one) nor is deleted. `saved`, the
    step just reported committed, is never deleted, even below `keep` higher ones (a job that
    started again at step 0 beside an older run's steps). A store error stops it all.
    """
    with calls_until(Deadline.after(timeout_s)):
        steps = scan(store)
        newest_first = [m.step for m in committed_manifests(store, steps, key=key) if m.step not in skip]
        doomed = [step for step in newest_first[keep:] if step != saved]
        for step in doomed:
            store.delete([manifest_key(step)])
            if isinstance(store, LocalStore):
                store.delete_tree(step_dir_name(step))
            else:
                store.delete([f"{step_dir_name(step)}/{name}" for name in steps[step] if name != MANIFEST_NAME])
            log.info("retention: deleted %s/%s (keeping the newest %d)", store.url, step_dir_name(step), keep)
    return doomed


def remove_abandoned(store: ObjectStore, *, timeout_s: float = RETENTION_TIMEOUT_S) -> list[int]:
    """Right after a commit: delete uploads of uncommitted steps older than the newest committed one,
    and abort our unfinished multipart uploads (none of this job's is in flight then). Returns the
    steps deleted."""
    with calls_until(Deadline.after(timeout_s)):
        steps = scan(store)
        committed = [s for s, files in steps.items() if MANIFEST_NAME in files]
        newest = max(committed, default=-1)
        doomed = [
            s for s, files in sorted(steps.items()) if MANIFEST_NAME not in files and s < newest and _only_ours(files)
        ]
        for step in doomed:
            store.delete([f"{step_dir_name(step)}/{name}" for name in steps[step]])
            log.info("retention: removed the abandoned upload %s/%s", store.url, step_dir_name(step))
        abort = getattr(store, "abort_multipart_uploads", None)  # S3 keeps (and bills) unfinished parts
        if abort is not None:
            abort(STEP_PREFIX, select=lambda key: step_of_key(key) is not None and _only_ours([key.partition("/")[2]]))
    return doomed


def _only_ours(names: Iterable[str]) -> bool:
    """Every name one that spotguard writes into a step directory: a user's own `step-N` directory
    (their notes in it) is never cleaned up."""
    return all(is_step_file(name) for name in names)


def _holds_only_ours(directory: Path) -> bool:
    entries = list(directory.iterdir())
    return _only_ours(e.name for e in entries) and not any(e.is_dir() for e in entries)


def remove_leftovers(root: Path, *, older_than_s: float = STALE_AFTER_S) -> list[str]:
    """Remove stale staging/download siblings, and step directories that have no manifest and hold
    only files spotguard writes, under `root`."""
    removed = []
    if not root.is_dir():
        return removed
    now = time.time()
    for entry in root.iterdir():
        if entry.is_symlink() or not entry.is_dir():
            continue  # a symlink is never followed: what it points to is not ours to delete
        leftover = parse_leftover(entry.name) is not None
        try:
            uncommitted = parse_step_dir(entry.name) is not None and not is_committed(entry)
            if not (leftover or (uncommitted and _holds_only_ours(entry))):
                continue
            age = now - entry.stat().st_mtime
        except FileNotFoundError:  # removed meanwhile
            continue
        if age >= older_than_s:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
            log.info("retention: removed leftover %s (%.0f s old)", entry, age)
    return removed


def after_commit(
    saved: int,
    remote: ObjectStore,
    local_root: Path | None,
    comm: Comm,
    *,
    keep: int | None,
    key: bytes | None,
    claim: RunClaim,
) -> None:
    """Clean up after committing step `saved` (never inside a deadline); failures are logged, never
    raised. Rank 0 first looks for steps of another run: then nothing is deleted, and the next save
    is refused. Rank 0 keeps `keep` steps (None: all) in `remote`, each node leader in its `local_root`."""
    if comm.is_coordinator:
        claim.check(remote)
    jobs: list[tuple[ObjectStore | None, Path | None]] = []
    if comm.is_coordinator:
        jobs.append((remote if keep else None, Path(remote.url) if isinstance(remote, LocalStore) else None))
    if comm.is_node_leader and local_root is not None:
        jobs.append((LocalStore(local_root) if keep else None, local_root))
    for store, root in jobs:
        try:
            if store is not None and keep and claim.refusal is None:
                keep_last(store, keep, key=key, skip=claim.rejected, saved=saved)
            if root is not None:
                remove_leftovers(root)
        except Exception as exc:  # noqa: BLE001 - the next save tries again
            log.warning("retention in %s failed: %s", store.url if store else root, exc)
    if comm.is_coordinator and claim.refusal is None and local_root is not None and not isinstance(remote, LocalStore):
        try:
            remove_abandoned(remote)
        except Exception as exc:  # noqa: BLE001
            log.warning("cleaning abandoned uploads in %s failed: %s", remote.url, exc)
