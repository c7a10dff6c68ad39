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
from datetime import datetime
from pathlib import Path

from cloud_adapters.notice import parse_iso8601
from cloud_adapters.retry import calls_until
from cloud_adapters.storage import LocalStore, ObjectStore
from spotguard.checkpoint.catalog import STEP_PREFIX, committed_manifests, scan, step_of_key
from spotguard.checkpoint.commit import is_committed
from spotguard.checkpoint.layout import MANIFEST_NAME, manifest_key, parse_leftover, parse_step_dir, step_dir_name
from spotguard.checkpoint.manifest import Manifest

log = logging.getLogger(__name__)

STALE_AFTER_S = 600.0
RETENTION_TIMEOUT_S = 30.0


def keep_last(store: ObjectStore, keep: int, *, timeout_s: float = RETENTION_TIMEOUT_S) -> list[int]:
    """Delete committed steps committed before the newest `keep` (>= 1, checked by the Checkpointer)
    committed ones; return the deleted steps.

    Committed means what it means to resume and `ls`: a step whose manifest is malformed, unsafe
    or contradicted by the listing neither counts (a bad newer step must not cost a good older
    one) nor is deleted (it is left for a person to look at). A store error stops it all.
    """
    with calls_until(time.monotonic() + timeout_s):
        steps = scan(store)
        newest_first = sorted(committed_manifests(store, steps), key=_commit_order, reverse=True)
        doomed = [m.step for m in newest_first[keep:]]
        for step in doomed:
            store.delete([manifest_key(step)])
            if isinstance(store, LocalStore):
                store.delete_tree(step_dir_name(step))
            else:
                store.delete([f"{step_dir_name(step)}/{name}" for name in steps[step] if name != MANIFEST_NAME])
            log.info("retention: deleted %s/%s (keeping the newest %d)", store.url, step_dir_name(step), keep)
    return doomed


def _commit_order(manifest: Manifest) -> tuple[datetime, int]:
    # created_at is validated when the manifest is read; the step breaks a tie within a millisecond.
    return parse_iso8601(manifest.created_at), manifest.step


def remove_abandoned(store: ObjectStore, *, timeout_s: float = RETENTION_TIMEOUT_S) -> list[int]:
    """Right after a commit: delete uploads of uncommitted steps older than the newest committed one,
    and abort our unfinished multipart uploads (none of this job's is in flight then). Returns the
    steps deleted."""
    with calls_until(time.monotonic() + timeout_s):
        steps = scan(store)
        committed = [s for s, files in steps.items() if MANIFEST_NAME in files]
        newest = max(committed, default=-1)
        doomed = sorted(s for s, files in steps.items() if MANIFEST_NAME not in files and s < newest)
        for step in doomed:
            store.delete([f"{step_dir_name(step)}/{name}" for name in steps[step]])
            log.info("retention: removed the abandoned upload %s/%s", store.url, step_dir_name(step))
        abort = getattr(store, "abort_multipart_uploads", None)  # S3 keeps (and bills) unfinished parts
        if abort is not None:
            abort(STEP_PREFIX, select=lambda key: step_of_key(key) is not None)
    return doomed


def remove_leftovers(root: Path, *, older_than_s: float = STALE_AFTER_S) -> list[str]:
    """Remove stale staging/download siblings and manifest-less step directories under `root`."""
    removed = []
    if not root.is_dir():
        return removed
    now = time.time()
    for entry in root.iterdir():
        leftover = parse_leftover(entry.name) is not None
        uncommitted = parse_step_dir(entry.name) is not None and not is_committed(entry)
        if not (leftover or uncommitted) or entry.is_symlink() or not entry.is_dir():
            continue  # a symlink is never followed: what it points to is not ours to delete
        try:
            age = now - entry.stat().st_mtime
        except FileNotFoundError:
            continue
        if age >= older_than_s:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
            log.info("retention: removed leftover %s (%.0f s old)", entry, age)
    return removed
