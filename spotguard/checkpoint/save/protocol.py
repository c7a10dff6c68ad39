"""The save protocol, on every rank of the saving group, in the same order:

1. DCP's planning and writing, step by step (`dcp_steps`), write the shards into a fresh hidden sibling
   `.step-N.tmp-<random>` (`write`);
2. every rank checksums its own files as it writes them and sends the records to rank 0, with where its
   items went, in one gather; rank 0 writes DCP's `.metadata` from those;
3. rank 0 writes the manifest last and renames the sibling to `step-N` (`commit`; `runs.RunClaim`
   says whether an existing step of that number is kept or replaced);
4. for an object store, every rank uploads its own files, then rank 0 uploads the manifest
   last, create-only (`durable`; with S3 / Azure / GCS each shard file streams up while step 1
   writes it, `streaming`: this step then only waits for those uploads and sends what did not);
5. retention (`retention.after_commit`; not in a save with a deadline: the next save cleans up).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import DefaultSavePlanner

from cloud_adapters.deadline import Deadline
from cloud_adapters.notice import Notice, isoformat_z, utc_now
from cloud_adapters.retry import calls_until
from cloud_adapters.storage import ObjectStore, PartsStore
from spotguard.checkpoint.comm import Comm
from spotguard.checkpoint.errors import CheckpointError
from spotguard.checkpoint.format.auth import KEY_ENV, sign
from spotguard.checkpoint.format.commit import commit_dir
from spotguard.checkpoint.format.layout import manifest_key, sibling_name, step_dir_name
from spotguard.checkpoint.format.manifest import Manifest, versions
from spotguard.checkpoint.format.runs import RunClaim, SharedDirectory
from spotguard.checkpoint.io.progress import seconds
from spotguard.checkpoint.moves.durable import Uploader
from spotguard.checkpoint.moves.streaming import ShardStreams
from spotguard.checkpoint.outcome import LocalCommit, SaveEvents, SaveReport
from spotguard.checkpoint.save import retention
from spotguard.checkpoint.save.indexed_write import MetadataFiles
from spotguard.checkpoint.save.plan_cache import CachedPlanner
from spotguard.checkpoint.save.write import Written, write_shards
from spotguard.job.departure import SurvivorsOutcome

log = logging.getLogger(__name__)


class SaveProtocol:
    """One job's saves: where they are staged and committed, how they are written and moved. `comm`
    is the whole job's; a save runs on it, or on the survivors' when some ranks leave."""

    def __init__(
        self,
        *,
        remote: ObjectStore,
        stage_root: Path,
        local_root: Path | None,
        comm: Comm,
        run_id: str,
        claim: RunClaim,
        key: bytes | None,
        uploader: Uploader,
        write_threads: int,
        transfer_threads: int,
        stream_uploads: bool,
        keep_last: int | None,
        on_event: SaveEvents | None,
    ) -> None:
        self.remote = remote
        self.stage_root = stage_root
        self.local_root = local_root
        self.comm = comm
        self.run_id = run_id
        self.claim = claim
        self.key = key
        self.uploader = uploader
        self.write_threads = write_threads
        self.transfer_threads = transfer_threads
        self.stream_uploads = stream_uploads
        self.keep_last = keep_last
        self.on_event = on_event
        self.job: str | None = None  # the location's job identity, once known: in every manifest committed
        # The whole job's saves share one plan, made by the first and reused while the layout holds
        # (an emergency then finds it made); a save on another group brings its own planner.
        self._planner = CachedPlanner()
        self._kept = MetadataFiles()  # what rank 0 wrote after the shards at the last save with it

    def run(
        self,
        step: int,
        state_dict: dict[str, Any],
        reason: str,
        notice: Notice | None,
        deadline: datetime | None,
        cutoff: Deadline,
        started_at: datetime,
        *,
        comm: Comm | None = None,
        planner: DefaultSavePlanner | None = None,
        leaving: tuple[int, ...] = (),
        on_commit: Callable[[SurvivorsOutcome], None] | None = None,
        stall_s: float = 0.0,
    ) -> SaveReport:
        """The save protocol on `comm`'s ranks; `on_commit` hears of the local commit on its rank 0. Store
        calls inside end by `cutoff`, also once it is brought forward (an emergency takes over)."""
        with calls_until(cutoff), self._streams(step, cutoff) as streams:
            comm = comm or self.comm
            if planner is None and comm is self.comm:
                planner = self._planner
            t0 = time.monotonic()
            stage_name, refusal = comm.broadcast(
                (sibling_name(step, "tmp"), self.claim.refusal) if comm.is_coordinator else None
            )
            if refusal:
                raise SharedDirectory(refusal)
            stage = self.stage_root / stage_name
            mine, gathered = write_shards(
                stage,
                state_dict,
                comm,
                threads=self.write_threads,
                planner=planner,
                sha256=self.key is not None,
                tee=streams.open if streams is not None else None,
                cutoff=cutoff,
                kept=self._kept if planner is self._planner else None,
            )
            records = list(mine.records)
            t_written = time.monotonic()
            commit = None if gathered is None else self._commit(step, reason, notice, stage, gathered, comm, leaving)
            commit = comm.broadcast(commit)
            t_committed = time.monotonic()
            committed_at = utc_now()
            try:
                if commit.error:
                    raise CheckpointError(f"checkpoint of step {step} failed, nothing committed: {commit.error}")
                final = Path(commit.path)
                if on_commit is not None and comm.is_coordinator:
                    on_commit(
                        SurvivorsOutcome(
                            location=str(final),
                            durable=self.local_root is None,
                            bytes=commit.bytes,
                            files=commit.files,
                            committed_at=isoformat_z(committed_at),
                        )
                    )
                self._emit(
                    comm,
                    "committed",
                    step=step,
                    at=str(final),
                    mb=f"{commit.bytes / 1e6:.1f}",
                    mb_per_s=f"{commit.bytes / 1e6 / max(t_written - t0, 1e-9):.0f}",
                )
                durable, upload_error, durable_at = self.local_root is None, None, committed_at
                if self.local_root is not None:
                    durable, upload_error, uploaded = self.uploader.upload(
                        step, commit, records, stage, final, deadline, cutoff, comm, streams
                    )
                    durable_at = utc_now() if durable else None
                    if uploaded:  # streamed uploads began with the write: their rate counts from there
                        began = t0 if streams is not None and streams.streamed_bytes else t_committed
                        self.uploader.bytes_per_s = commit.bytes / max(time.monotonic() - began, 1e-9)
            finally:
                # A copy that was not committed here (failed, or another node's partial copy) is abandoned.
                if comm.is_node_leader and stage.exists():
                    shutil.rmtree(stage, ignore_errors=True)
            t_done = time.monotonic()
            report = SaveReport(
                step=step,
                reason=reason,
                bytes=commit.bytes,
                files=commit.files,
                write_s=t_written - t0,
                commit_s=t_committed - t_written,
                upload_s=t_done - t_committed if self.local_root is not None else 0.0,
                location=f"{self.remote.url}/{step_dir_name(step)}" if durable else str(final),
                durable=durable,
                margin_s=(deadline - durable_at).total_seconds() if deadline and durable_at else None,
                started_at=started_at,
                committed_at=committed_at,
                durable_at=durable_at,
                local_location=str(final) if self.local_root is not None else None,
                error=upload_error,
                stall_s=stall_s,
                streamed_bytes=streams.streamed_bytes if streams is not None else 0,
            )
            if report.durable:
                self._emit(comm, "durable", step=step, at=report.location, margin_s=seconds(report.margin_s))
            else:
                self._emit(comm, "not-durable", step=step, local_copy=str(final), why=upload_error)
            if reason == "emergency" or cutoff.at is not None:
                log.debug("no retention within a deadline: the next save cleans up")
            else:
                retention.after_commit(
                    step,
                    self.remote,
                    self.local_root,
                    comm,
                    keep=self.keep_last,
                    key=self.key,
                    claim=self.claim,
                )
            if comm.is_coordinator:
                log.info(
                    "checkpoint step %d (%s) %s: %.1f MB in %d files, write %.2fs (%s) commit %.2fs upload %.2fs "
                    "(rank 0 streamed %.1f MB during the write)%s",
                    step,
                    reason,
                    "durable at " + report.location if durable else "committed locally only at " + str(final),
                    report.bytes / 1e6,
                    report.files,
                    report.write_s,
                    "plan reused" if planner is self._planner and self._planner.reused else "planned",
                    report.commit_s,
                    report.upload_s,
                    report.streamed_bytes / 1e6,
                    f", {report.margin_s:.1f}s before the deadline" if report.margin_s is not None else "",
                )
            return report

    def _commit(
        self,
        step: int,
        reason: str,
        notice: Notice | None,
        stage: Path,
        gathered: list[Written],
        comm: Comm,
        leaving: tuple[int, ...],
    ) -> LocalCommit:
        """The saving group's rank 0: write the manifest last and rename the staging directory into place."""
        errors = [w.error for w in gathered if w.error]
        if self.key is not None:  # a rank without the key left its files unhashed: signing would vouch for them blind
            errors += [
                f"rank {comm.members[i]}: no checkpoint key (set {KEY_ENV} on every node)"
                for i, w in enumerate(gathered)
                if any(r.sha256 is None for r in w.records)
            ]
        if errors:
            return LocalCommit(error="; ".join(errors))
        try:
            manifest = Manifest(
                step=step,
                reason=reason,
                world_size=self.comm.world_size,
                created_at=isoformat_z(utc_now()),
                files=tuple(sorted((r for w in gathered for r in w.records), key=lambda r: r.name)),
                notice=notice.to_json() if isinstance(notice, Notice) else notice,
                versions=versions(),
                saved_by=tuple(comm.members),
                leaving=leaving,
                run=self.run_id,
                job=self.job,
            )
            final, created = commit_dir(
                stage, sign(manifest, self.key) if self.key is not None else manifest, self.claim
            )
        except SharedDirectory as exc:
            return LocalCommit(error=str(exc))
        except Exception as exc:  # returned, not raised: every rank waits for this outcome
            return LocalCommit(error=f"commit: {type(exc).__name__}: {exc}")
        return LocalCommit(path=str(final), created=created, bytes=manifest.total_bytes, files=len(manifest.files))

    def close(self) -> None:
        """Drop the cached plan (on rank 0 it holds every rank's) and the files made from it."""
        self._planner.forget()
        self._kept = MetadataFiles()

    @contextlib.contextmanager
    def _streams(self, step: int, cutoff: Deadline) -> Iterator[ShardStreams | None]:
        """This rank's streaming uploads for a save (None: the files go up after the commit only); stopped after."""
        if (
            not self.stream_uploads
            or self.local_root is None
            or not isinstance(self.remote, PartsStore)
            or cutoff.passed()  # a background save whose uploads were abandoned before it began
        ):
            yield None
            return
        streams = ShardStreams(
            self.remote, step_dir_name(step), manifest_key(step), threads=self.transfer_threads, cutoff=cutoff
        )
        try:
            yield streams
        finally:
            streams.close()

    def _emit(self, comm: Comm, event: str, **detail: Any) -> None:
        if self.on_event is not None and comm.is_coordinator:
            self.on_event(event, **detail)
