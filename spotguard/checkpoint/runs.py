"""One job per checkpoint_dir: every run has an id, written into each manifest it commits.

A fresh start takes a new id; `resume()` takes over the id of the step it loaded, so a job that
restarts from its own checkpoint stays the same run. A step committed under another id while this
run is going means two jobs share the directory: each would resume, overwrite, or (retention)
delete the other's steps. The first sign of it stops this run's saves and retention there, with
a message that says which run and what to do. Steps another run committed before this one started
(an earlier job in the same directory) are no sign of it.
"""

from __future__ import annotations

import secrets
from datetime import datetime

from cloud_adapters.notice import parse_iso8601
from cloud_adapters.storage import ObjectStore
from spotguard.checkpoint.catalog import committed_manifests, scan
from spotguard.checkpoint.errors import CheckpointError
from spotguard.checkpoint.manifest import Manifest


class SharedDirectory(CheckpointError):
    """Another run commits steps in this run's checkpoint_dir."""


def new_run_id() -> str:
    return secrets.token_hex(8)


def is_other_run(manifest: Manifest, run: str) -> bool:
    """Committed by a different run (a manifest from before run ids were recorded counts as ours)."""
    return manifest.run is not None and manifest.run != run


def refuse(where: str, manifest: Manifest, run: str) -> SharedDirectory:
    return SharedDirectory(
        f"{where} holds step {manifest.step} committed by run {manifest.run} at {manifest.created_at}, "
        f"not by this run ({run}): two jobs share this checkpoint_dir; give each job its own (no more saves here)"
    )


class RunWatch:
    """Looks, after each save, for steps that another run committed since this one started."""

    def __init__(self, started_at: datetime) -> None:
        self.started_at = started_at
        self._seen: set[int] = set()  # steps whose manifests were already read (listing new ones only)

    def check(self, store: ObjectStore, run: str) -> None:
        """SharedDirectory when a step new to this watch was committed by another run after it started."""
        listing = scan(store)
        fresh = {step: files for step, files in listing.items() if step not in self._seen}
        for manifest in committed_manifests(store, fresh):
            self._seen.add(manifest.step)
            if is_other_run(manifest, run) and parse_iso8601(manifest.created_at) >= self.started_at:
                raise refuse(store.url, manifest, run)
