"""Making a committed step durable in the object store: every rank uploads its files (or waits for
those that streamed up while written), then rank 0 the manifest, create-only, within the save's
cutoff; never over a committed copy that resume would load or that another run committed."""

from __future__ import annotations

import logging
from datetime import datetime
from pathlib import Path

from cloud_adapters.deadline import Deadline
from cloud_adapters.storage import AlreadyExists, ObjectStore
from spotguard.checkpoint.comm import Comm
from spotguard.checkpoint.format.layout import MANIFEST_NAME, manifest_key, step_dir_name
from spotguard.checkpoint.format.manifest import FileRecord, Manifest
from spotguard.checkpoint.format.runs import RunClaim
from spotguard.checkpoint.io.progress import TransferProgress, seconds
from spotguard.checkpoint.io.transfer import upload, within
from spotguard.checkpoint.moves.streaming import ShardStreams
from spotguard.checkpoint.outcome import LocalCommit, SaveEvents

log = logging.getLogger(__name__)


class Uploader:
    """Uploads committed steps to `remote` with `threads` transfers per rank; learns the upload rate
    (`bytes_per_s`) to plan the next upload against a deadline."""

    def __init__(self, remote: ObjectStore, claim: RunClaim, threads: int, on_event: SaveEvents | None) -> None:
        self.remote = remote
        self.claim = claim
        self.threads = threads
        self._on_event = on_event  # not a method of the Checkpointer's: no reference cycle keeps it alive
        self.bytes_per_s: float | None = None  # measured on earlier uploads, for the deadline plan

    def _remote_has(self, step: int, cutoff: Deadline) -> bool | str:
        """Whether `step` is already committed in the object store (never upload over a committed step),
        or why this run must not upload it (another run committed it).

        Asked within the save's cutoff: a stalled link must not hold a local commit back.
        """
        try:
            if not within(lambda: self.remote.exists(manifest_key(step)), cutoff):
                return False
            refusal, why = self._judge_remote(step, cutoff)
            if refusal is not None or why is None:
                return refusal or True
            log.warning(
                "step %d is committed in %s but resume would not load it (%s); replacing it", step, self.remote.url, why
            )
            within(lambda: self.remote.delete([manifest_key(step)]), cutoff)  # uncommitted first: never half of each
            return False
        except Exception as exc:  # the upload itself will tell whether the store works
            log.warning("could not check %s for an existing step %d: %s", self.remote.url, step, exc)
            return False

    def _kept_or_refused(self, step: int, cutoff: Deadline) -> str | None:
        """`step` was committed in the object store while this run uploaded it: keep that copy when
        it is this run's and loadable (None), else say why not."""
        try:
            refusal, why = self._judge_remote(step, cutoff)
        except Exception as exc:  # noqa: BLE001 - it is committed there, by whom is unknown: not vouched for
            return f"step {step} was committed in {self.remote.url} meanwhile, by a run not known ({exc})"
        if refusal is None and why is None:
            log.warning("step %d was committed in %s meanwhile; keeping that copy", step, self.remote.url)
            return None
        return refusal or f"step {step} was committed in {self.remote.url} meanwhile; resume would not load it ({why})"

    def _judge_remote(self, step: int, cutoff: Deadline) -> tuple[str | None, str | None]:
        """For the committed `step` in the object store: (why this run must not upload it, why
        resume would not load the copy there); both None: it is kept."""
        data = within(lambda: self.remote.get_bytes(manifest_key(step)), cutoff)
        try:
            existing: Manifest | None = Manifest.from_bytes(data)
        except ValueError:  # ManifestError
            existing = None
        return self.claim.judge(self.remote.url, existing)

    def upload(
        self,
        step: int,
        commit: LocalCommit,
        records: list[FileRecord],
        stage: Path,
        final: Path,
        deadline: datetime | None,
        cutoff: Deadline,
        comm: Comm,
        streams: ShardStreams | None = None,
    ) -> tuple[bool, str | None, bool]:
        """Every rank uploads its files, then rank 0 the manifest, create-only. (durable, error, uploaded).

        Files that streamed up whole while they were written (`streams`) are only waited for; the
        others go up now. The upload uses the whole window but never goes past `cutoff` (`DEADLINE_RESERVE_S`
        before the deadline, or earlier when a later save takes over): what is unfinished
        then is abandoned, no manifest is written, and the committed local copy is what remains.
        """
        if deadline is not None and comm.is_coordinator:
            self._plan(comm, step, commit.bytes, cutoff.left())
        there = comm.broadcast(self._remote_has(step, cutoff) if comm.is_coordinator else None)
        if isinstance(there, str):  # rank 0 has logged why
            return False, there, False
        if there:
            if comm.is_coordinator:
                log.warning("step %d is already committed in %s; not uploading it again", step, self.remote.url)
            return True, None, False
        error = None
        try:
            mine = records
            if not commit.created:  # the step was already committed locally: rank 0 uploads that copy
                mine = (
                    list(Manifest.from_bytes((final / MANIFEST_NAME).read_bytes()).files) if comm.is_coordinator else []
                )
            # Files of this rank are still in the stage dir on another node than rank 0, else in the committed dir.
            items = [
                ((stage / r.name) if (stage / r.name).exists() else (final / r.name), f"{step_dir_name(step)}/{r.name}")
                for r in mine
            ]
            progress = TransferProgress(
                f"uploading {step_dir_name(step)} (rank {comm.rank})",
                sum(p.stat().st_size for p, _ in items),
                every_s=5.0,
            )
            streamed: set[str] = set()
            if streams is not None:  # waited for first, so that no streamed object lands after the uploads below
                # Not created: the committed copy is an earlier one, and what streamed is aborted.
                streamed = streams.finish(progress, complete=commit.created)
            rest = [(p, key) for p, key in items if p.name not in streamed]
            upload(self.remote, rest, threads=self.threads, cutoff=cutoff, progress=progress)
        except Exception as exc:
            error = f"rank {comm.rank}: {exc}"
        errors = comm.gather(error)
        outcome = None
        if comm.is_coordinator:
            outcome = "; ".join(e for e in errors if e) or None
            if outcome is None:
                manifest = (final / MANIFEST_NAME).read_bytes()
                try:
                    within(lambda: self.remote.put_bytes(manifest_key(step), manifest, create_only=True), cutoff)
                except AlreadyExists:
                    outcome = self._kept_or_refused(step, cutoff)
                except Exception as exc:
                    outcome = f"manifest upload: {type(exc).__name__}: {exc}"
            if outcome:
                log.error(
                    "upload of step %d to %s failed (committed locally at %s): %s",
                    step,
                    self.remote.url,
                    final,
                    outcome,
                )
        outcome = comm.broadcast(outcome)
        return outcome is None, outcome, outcome is None

    def _plan(self, comm: Comm, step: int, nbytes: int, window_s: float) -> None:
        """Log (and report) how long the upload should take against the time left."""
        rate = self.bytes_per_s
        expected = nbytes / rate if rate else None
        detail = {
            "step": step,
            "mb": f"{nbytes / 1e6:.1f}",
            "window_s": seconds(window_s),
            "expected_s": seconds(expected),
            "expected_margin_s": seconds(window_s - expected if expected else None),
        }
        if self._on_event is not None and comm.is_coordinator:
            self._on_event("upload-plan", **detail)
        if expected is None:
            log.info(
                "uploading %s (%.1f MB) to %s within %.1f s; no upload measured yet to estimate from",
                step_dir_name(step),
                nbytes / 1e6,
                self.remote.url,
                window_s,
            )
        elif expected > window_s:
            log.warning(
                "uploading %s (%.1f MB) should take %.1f s at %.0f MB/s but only %.1f s are left: trying, "
                "and keeping the committed local copy if it does not finish",
                step_dir_name(step),
                nbytes / 1e6,
                expected,
                rate / 1e6,
                window_s,
            )
        else:
            log.info(
                "uploading %s (%.1f MB) to %s: expected %.1f s at %.0f MB/s, %.1f s margin",
                step_dir_name(step),
                nbytes / 1e6,
                self.remote.url,
                expected,
                rate / 1e6,
                window_s - expected,
            )
