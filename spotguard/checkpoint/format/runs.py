"""One job per checkpoint_dir: every run (one start of the job: one Checkpointer, on every rank
alike) has an id, written into each manifest it commits.

A step that a different run committed *after* this one started means another job is writing into
the same directory, whether or not it resumed from this directory's steps: each would resume,
overwrite, or (retention) delete the other's steps. The first sign of it stops this run's saves
and retention there, with a message that says which run and what to do. Steps committed before
this run started (an earlier start of the same job, an earlier job) are no sign of it.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable
from datetime import datetime

from cloud_adapters.notice import parse_iso8601
from cloud_adapters.storage import ObjectStore
from spotguard.checkpoint.errors import CheckpointError
from spotguard.checkpoint.format.auth import signature_problem
from spotguard.checkpoint.format.layout import MANIFEST_NAME
from spotguard.checkpoint.format.listing import committed_manifests, scan
from spotguard.checkpoint.format.manifest import Manifest

log = logging.getLogger(__name__)


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
    """Tells steps committed by another run since this one started; looks for them after each save.

    "Since this one started" is read from the directory, not from clocks: the steps committed
    when this run's Checkpointer started (`baseline`) are earlier ones,
    whatever time their manifests give (another host's clock may be days off). Only when that
    listing failed is the manifest's time compared with this host's clock.
    """

    def __init__(self, started_at: datetime) -> None:
        self.started_at = started_at
        self._seen: set[int] = set()  # steps whose manifests were already read (listing new ones only)
        self._before: set[int] | None = None  # steps committed when this run first looked

    def baseline(self, stores: Iterable[ObjectStore]) -> None:
        """Note the steps committed now (once; a listing per store, no manifest read)."""
        if self._before is not None:
            return
        try:
            self._before = {s for store in stores for s, files in scan(store).items() if MANIFEST_NAME in files}
        except Exception as exc:  # noqa: BLE001 - then the clocks decide, as a fallback
            log.warning("could not list the steps committed before this run (%s); comparing commit times", exc)

    def is_concurrent(self, manifest: Manifest, run: str) -> bool:
        """Committed by another run since this one started: another job writes here."""
        if not is_other_run(manifest, run):
            return False
        if self._before is not None:
            return manifest.step not in self._before
        return parse_iso8601(manifest.created_at) >= self.started_at

    def check(self, store: ObjectStore, run: str) -> None:
        """SharedDirectory when a step new to this watch was committed by another run after it started."""
        listing = scan(store)
        fresh = {step: files for step, files in listing.items() if step not in self._seen}
        for manifest in committed_manifests(store, fresh):
            self._seen.add(manifest.step)
            if self.is_concurrent(manifest, run):
                raise refuse(store.url, manifest, run)


class RunClaim:
    """This run's claim on its checkpoint directory, judged on rank 0: its id, the steps that were
    there when it started (`RunWatch`), the steps its resume found bad, and, once another job's
    step has been seen, why no more saves go there (`refusal`).

    It keeps two rules: a step reported saved is one that resume loads (`unusable` tells a
    committed copy that must be replaced), and no job overwrites or deletes another's steps.
    """

    def __init__(self, run: str, started_at: datetime, key: bytes | None = None) -> None:
        self.run = run
        self.watch = RunWatch(started_at)
        self.key = key
        self.rejected: set[int] = set()  # steps this run's resume found bad: never kept over a new save
        self.refusal: str | None = None  # why saves here stopped: another run committed in this directory

    def unusable(self, existing: Manifest | None) -> str | None:
        """Why resume would not load the committed copy of a step this run saves again (None: it
        would, and it is kept)."""
        if existing is None:
            return "its manifest cannot be read"
        if existing.step in self.rejected:
            return "this run's resume found it bad"
        if self.key is not None and (problem := signature_problem(existing, self.key)):
            return problem
        return None

    def judge(self, where: str, existing: Manifest | None) -> tuple[str | None, str | None]:
        """For a committed copy of a step this run saves again: (why this run must not write it,
        another run's; why resume would not load it). Both None: the copy is kept."""
        if existing is not None and self.watch.is_concurrent(existing, self.run):
            self.refusal = str(refuse(where, existing, self.run))
            return self.refusal, None
        return None, self.unusable(existing)

    def check(self, store: ObjectStore) -> None:
        """After a save: look for steps another run committed in `store`; the first one found ends
        this run's saves there (logged once)."""
        if self.refusal is not None:
            return
        try:
            self.watch.check(store, self.run)
        except SharedDirectory as exc:
            self.refusal = str(exc)
            log.error("%s", exc)
        except Exception as exc:  # noqa: BLE001 - looked for again after the next save
            log.warning("could not look for other runs' steps in %s: %s", store.url, exc)
