"""Commit a staged step on a filesystem: manifest last, fsync, atomic rename, fsync the parent."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from cloud_adapters.storage import fsync_path, write_durably
from spotguard.checkpoint.format.layout import MANIFEST_NAME, sibling_name, step_dir_name
from spotguard.checkpoint.format.manifest import Manifest
from spotguard.checkpoint.format.runs import RunClaim, SharedDirectory

log = logging.getLogger(__name__)


def is_committed(step_dir: Path) -> bool:
    return (step_dir / MANIFEST_NAME).is_file()


def set_aside(step_dir: Path, step: int) -> None:
    """Move an uncommitted `step-N` out of the way (kept as a hidden leftover for retention)."""
    os.rename(step_dir, step_dir.parent / sibling_name(step, "stale"))


def commit_dir(stage_dir: Path, manifest: Manifest, claim: RunClaim | None = None) -> tuple[Path, bool]:
    """Write the manifest into `stage_dir` and rename it to `step-N` beside it.

    Returns (the step directory, whether this call created it). A committed step of the same
    number is kept, and the new copy discarded, when resume would load it; when `claim` says it
    would not, the existing copy is set aside (a hidden leftover, for retention) and the new one
    committed: a step reported saved must be one that resume loads. SharedDirectory when another
    run committed it since this one started.
    """
    final = stage_dir.parent / step_dir_name(manifest.step)
    if is_committed(final):
        refusal, why = claim.judge(str(final.parent), _readable_manifest(final)) if claim else (None, None)
        if refusal is not None:
            shutil.rmtree(stage_dir, ignore_errors=True)
            raise SharedDirectory(refusal)
        if why is None:
            log.warning("step %d is already committed at %s; keeping it, not the new copy", manifest.step, final)
            shutil.rmtree(stage_dir, ignore_errors=True)
            return final, False
        log.warning("%s is committed, but resume would not load it (%s): replacing it", final, why)
        set_aside(final, manifest.step)
    # DCP already fsynced the data files (sync_files=True); write_durably fsyncs the manifest and the directory.
    write_durably(stage_dir / MANIFEST_NAME, manifest.to_bytes())
    if final.exists():
        log.warning("found an uncommitted %s (no manifest); setting it aside", final)
        set_aside(final, manifest.step)
    os.rename(stage_dir, final)
    fsync_path(final.parent)
    return final, True


def _readable_manifest(step_dir: Path) -> Manifest | None:
    """The manifest of a committed step, or None when it cannot be read."""
    try:
        return Manifest.from_bytes((step_dir / MANIFEST_NAME).read_bytes())
    except (OSError, ValueError):  # ManifestError is a ValueError
        return None
