"""Checkpointer: the save/resume object the Guard drives.

A save is one protocol on every rank, in the same order:
  1. DCP writes the shards into a fresh hidden sibling `.step-N.tmp-<random>` (`save`);
  2. every rank checksums its own files and sends the records to rank 0;
  3. rank 0 writes the manifest last and renames the sibling to `step-N` (`commit`; `runs.RunClaim`
     says whether an existing step of that number is kept or replaced);
  4. for an object store, every rank uploads its own files, then rank 0 uploads the manifest
     last, create-only (`durable`; with S3 / Azure / GCS each shard file streams up while step 1
     writes it, `streaming`: this step then only waits for those uploads and sends what did not);
  5. retention (`retention.after_commit`; not in a save with a deadline: the next save cleans up).
Async saves (wait=False) copy the state into host buffers reused from save to save
(`staging.Stager`: the training thread pays a memcpy) and run the same protocol on one
background thread, one save at a time.
An emergency in which only some nodes are reclaimed (a `Departure`) runs the protocol on the
survivors alone (`departing`): a leaving rank only hands the shards that exist nowhere else to a
survivor's memory, and is then free to go; the survivors write everything and commit. A save with
a deadline (an emergency) takes over from a background save in flight: that one's upload is
abandoned at once, its committed local copy kept, and it is waited for only until the deadline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import SavePlanner

from cloud_adapters import validation as check
from cloud_adapters.notice import Notice, isoformat_z, utc_now
from cloud_adapters.storage import LocalStore, ObjectStore, PartsStore
from cloud_adapters.stores import open_store
from spotguard.checkpoint import departing, retention
from spotguard.checkpoint.auth import KEY_ENV, CheckpointKey, resolve_key, sign
from spotguard.checkpoint.comm import FAILURES, Comm, describe
from spotguard.checkpoint.commit import commit_dir
from spotguard.checkpoint.departure import Departure
from spotguard.checkpoint.durable import Uploader
from spotguard.checkpoint.errors import CheckpointError
from spotguard.checkpoint.handoff import ReceivePool
from spotguard.checkpoint.layout import manifest_key, sibling_name, step_dir_name
from spotguard.checkpoint.manifest import REASONS, FileRecord, Manifest, versions
from spotguard.checkpoint.outcome import LocalCommit, SaveEvents, SaveOutcomes, SaveReport, SurvivorsOutcome
from spotguard.checkpoint.resume import load_newest
from spotguard.checkpoint.runs import RunClaim, SharedDirectory, new_run_id
from spotguard.checkpoint.save import write_shards
from spotguard.checkpoint.staging import Stager
from spotguard.checkpoint.state import to_dcp
from spotguard.checkpoint.streaming import ShardStreams
from spotguard.checkpoint.transfer import Cutoff
from spotguard.timeline import seconds

log = logging.getLogger(__name__)

# Kept free before a deadline: the manifest upload and the process exit happen in it.
DEADLINE_RESERVE_S = 3.0


@dataclasses.dataclass(frozen=True)
class _InFlight:
    """The background save running now."""

    step: int
    future: Future
    cutoff: Cutoff


class Checkpointer:
    """Sharded, atomically committed checkpoints of one training job.

    `checkpoint_dir` is a path, file://, s3://, gs:// or az:// location. With an object
    store (or a `local_dir` different from a filesystem `checkpoint_dir`) steps are staged
    and committed in `local_dir` first, then uploaded. `group` carries every checkpoint
    collective (a dedicated gloo group); without an initialized process group this is a
    single process. `keep_last` keeps that many newest committed steps. With a
    `checkpoint_key` (default: $SPOTGUARD_CHECKPOINT_KEY), saves are signed and resume
    loads only steps signed with it (`auth`); every node needs the same key. With
    `stream_uploads` and a store that takes parts (S3, Azure, GCS), shard files upload while they are written.
    """

    def __init__(
        self,
        checkpoint_dir: str,
        *,
        local_dir: str | None = None,
        group: dist.ProcessGroup | None = None,
        keep_last: int | None = None,
        write_threads: int | None = None,
        thread_count: int = 4,
        on_event: SaveEvents | None = None,
        on_outcome: SaveOutcomes | None = None,
        checkpoint_key: CheckpointKey | None = None,
        stream_uploads: bool = True,
    ) -> None:
        self.keep_last = check.optional(check.count, "keep_last", keep_last)
        self.write_threads = check.optional(check.count, "write_threads", write_threads) or default_write_threads()
        self.thread_count = check.count("thread_count", thread_count)
        self.remote: ObjectStore = open_store(checkpoint_dir)
        self.stream_uploads = stream_uploads
        self._key = resolve_key(checkpoint_key)
        self.comm = Comm(group)
        remote_root = Path(self.remote.url) if isinstance(self.remote, LocalStore) else None
        if local_dir is None and remote_root is None:
            local_dir = str(
                Path(tempfile.gettempdir())
                / "spotguard-staging"
                / hashlib.sha256(self.remote.url.encode()).hexdigest()[:16]
            )
            log.info(
                "staging checkpoints for %s in %s (set local_dir to choose a fast local disk)",
                self.remote.url,
                local_dir,
            )
        local_root = Path(local_dir).expanduser().resolve() if local_dir is not None else None
        # Stage in the checkpoint directory itself only when it is a filesystem and no other local_dir is given.
        self.local_root: Path | None = None if local_root in (None, remote_root) else local_root
        self.stage_root: Path = self.local_root or remote_root  # type: ignore[assignment]
        if remote_root is not None:
            _writable_dir(remote_root, "checkpoint_dir")
        if self.local_root is not None:
            _writable_dir(self.local_root, "local_dir")
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spotguard-ckpt")
        self._pending: _InFlight | None = None
        self._stager = Stager()  # background saves copy into its buffers, reused from save to save
        self._receive_pool: ReceivePool | None = None  # set by expect_handoff, used by the next survivor save
        self.last_report: SaveReport | None = None  # of the last save that committed, background ones too
        self._uploads_abandoned = False  # an emergency is coming: background saves commit locally only
        # This run's id (every rank the same: one start of the job), in each manifest it commits.
        self.run: str = self.comm.broadcast(new_run_id() if self.comm.is_coordinator else None)
        self._claim = RunClaim(self.run, utc_now(), self._key)  # judged on rank 0
        self._note_earlier_steps()
        # The store's own retry limit; a save with a deadline lowers it for its duration.
        self._retry_deadline_s: float | None = getattr(self.remote, "retry_deadline_s", None)
        self.on_event = on_event
        self.on_outcome = on_outcome
        self._uploader = Uploader(self.remote, self._claim, self.thread_count, on_event)

    # -- public API -------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        reason: str,
        notice: Notice | None = None,
        deadline: datetime | None = None,
        wait: bool = True,
        departure: Departure | None = None,
    ) -> SaveReport | None:
        """Save `state` as `step` on every rank (a collective: all ranks call it in the same order).

        wait=True returns the SaveReport once committed (raises CheckpointError when
        nothing could be committed). wait=False copies the state into reused host buffers and
        returns None at once; `wait()` collects the result. With a `deadline`, the upload
        and the store's retries end `DEADLINE_RESERVE_S` before it, and a background save
        in flight gives up its upload at once. With a `departure` (wait=True only), the
        survivors save without the leaving ranks, which only hand over what exists nowhere else.
        """
        if reason not in REASONS:
            raise ValueError(f"reason must be one of {REASONS}, not {reason!r}")
        step_dir_name(step)  # validates the step
        called = time.monotonic()
        try:
            report = self._start(step, state, reason, notice, deadline, wait, departure, called)
        except Exception as exc:
            self._tell(step, reason, None, exc)
            raise
        if report is not None:
            report = self.last_report = dataclasses.replace(report, stall_s=time.monotonic() - called)
            self._tell(step, reason, report, None)
        return report

    def _start(
        self,
        step: int,
        state: Mapping[str, Any],
        reason: str,
        notice: Notice | None,
        deadline: datetime | None,
        wait: bool,
        departure: Departure | None,
        called: float,
    ) -> SaveReport | None:
        """save()'s body: the report of a save waited for, None once a background one is on its way."""
        cutoff = Cutoff()
        if deadline is not None:
            cutoff.bring_forward(time.monotonic() + (deadline - utc_now()).total_seconds() - DEADLINE_RESERVE_S)
        elif departure is not None:  # the ranks wait on each other: never without a bound
            cutoff.bring_forward(time.monotonic() + departing.NO_DEADLINE_WAIT_S)
        self._finish_pending(cutoff)
        if reason == "emergency":
            self._uploads_abandoned = False  # the emergency they made way for is here: later saves upload again
        state_dict = to_dcp(state)
        started_at = utc_now()
        if not wait and self._uploads_abandoned:
            cutoff.bring_forward(time.monotonic())
        if departure is not None and departure.survivors():
            if not wait:
                raise ValueError("a save with a departure is an emergency: it needs wait=True")
            if dist.get_rank() in departure.leaving:
                self.last_report = departing.leave(step, state_dict, departure, cutoff, started_at)
                return self.last_report
            pool, self._receive_pool = self._receive_pool, None  # this emergency's, used once
            return departing.survive(
                step,
                state_dict,
                departure,
                cutoff,
                pool,
                lambda comm, planner, on_commit: self._save(
                    step,
                    state_dict,
                    reason,
                    notice,
                    None,
                    Cutoff(),
                    started_at,
                    comm=comm,
                    planner=planner,
                    leaving=tuple(sorted(departure.leaving)),
                    on_commit=on_commit,
                ),
            )
        if wait:
            if self._stager.speeds_up(state_dict):  # the previous background save is finished: buffers are free
                state_dict = self._stager.stage(state_dict)
            return self._save(step, state_dict, reason, notice, deadline, cutoff, started_at)
        snapshot = self._stager.stage(state_dict)
        stall_s = time.monotonic() - called  # the training thread is free once the job is queued
        future = self._worker.submit(
            self._save, step, snapshot, reason, notice, deadline, cutoff, started_at, stall_s=stall_s
        )
        future.add_done_callback(lambda done: self._tell_done(step, reason, done))
        self._pending = _InFlight(step, future, cutoff)
        return None

    def _tell_done(self, step: int, reason: str, done: Future) -> None:
        error = done.exception()
        self._tell(step, reason, None if error else done.result(), error)

    def _tell(self, step: int, reason: str, report: SaveReport | None, error: BaseException | None) -> None:
        if self.on_outcome is None:
            return
        try:
            self.on_outcome(step, reason, report, None if error is None else str(error) or type(error).__name__)
        except Exception:  # noqa: BLE001 - a listener's failure never fails a save
            log.exception("the save outcome listener failed")

    def expect_handoff(self, nbytes: int) -> None:
        """About `nbytes` of a leaving rank's shards will be handed to this rank in the coming
        emergency: touch that much memory for them now, on a thread of its own (any thread may call
        this; see `handoff.ReceivePool`)."""
        self._receive_pool = ReceivePool(nbytes) if nbytes > 0 else None

    def abandon_background_uploads(self) -> None:
        """An emergency has been agreed (called from any thread, on every rank alike): the background
        save in flight, and any started before the emergency step, stop uploading at once and keep
        their local commit, so no upload stands between the notice and the emergency save."""
        self._uploads_abandoned = True
        pending = self._pending
        if pending is not None and not pending.future.done():
            log.warning("an emergency is coming: the background save of step %d stops uploading", pending.step)
            pending.cutoff.bring_forward(time.monotonic())
            self._limit_retries(pending.cutoff)

    def wait(self, timeout: float | None = None) -> SaveReport | None:
        """Finish the in-flight async save; its report, or None when none was in flight.

        Raises CheckpointError if it failed, TimeoutError if it is still running after `timeout`.
        """
        pending = self._pending
        if pending is None:
            return None
        report = pending.future.result(timeout)
        self._pending = None
        return report

    def resume(self, state: MutableMapping[str, Any]) -> int | None:
        """Load the newest good committed step into `state` (a collective); its step, or None."""
        self._finish_pending()
        step = load_newest(
            state,
            remote=self.remote,
            local_root=self.local_root,
            comm=self.comm,
            threads=self.thread_count,
            read_threads=self.write_threads,  # files are read as many at a time as they are written
            key=self._key,
            bad=self._claim.rejected,
        )
        return step

    def _note_earlier_steps(self) -> None:
        """Rank 0 (which judges other runs' steps): note what is committed as this run starts, so
        that those steps never count as another job's, whatever their hosts' clocks said."""
        if self.comm.is_coordinator:
            local = [LocalStore(self.local_root)] if self.local_root is not None and self.local_root.is_dir() else []
            self._claim.watch.baseline([self.remote, *local])

    def close(self) -> None:
        """Finish the in-flight save, stop the worker thread, release the store's connections.

        Uploads abandoned at a deadline are not waited for.
        """
        self._finish_pending()
        self._worker.shutdown(wait=True)
        close_store = getattr(self.remote, "close", None)
        if callable(close_store):
            close_store()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def upload_bytes_per_s(self) -> float | None:
        """The upload rate measured on earlier saves (None before the first upload)."""
        return self._uploader.bytes_per_s

    # -- the save protocol --------------------------------------------------------------------

    def _finish_pending(self, cutoff: Cutoff | None = None) -> None:
        """Let the previous async save finish first (its collectives must not interleave with ours).

        When the next save has a deadline (`cutoff`), the background save's upload is
        abandoned now, on every rank alike, so that it only runs its remaining
        collectives, and it is waited for until `cutoff` at most: CheckpointError then.
        """
        pending = self._pending
        if pending is None:
            return
        timeout = None
        if cutoff is not None and cutoff.at is not None and not pending.future.done():
            log.warning(
                "a save with a deadline takes over from the background save of step %d: its upload stops now "
                "(its committed local copy is kept)",
                pending.step,
            )
            pending.cutoff.bring_forward(time.monotonic())
            self._limit_retries(pending.cutoff)
            timeout = max(0.0, cutoff.left())
        try:
            self.wait(timeout)
        except TimeoutError as exc:  # still in its collectives: ours must not start (its own finally restores retries)
            raise CheckpointError(
                f"the background save of step {pending.step} was still finishing at the deadline; not saving again"
            ) from exc
        except Exception as exc:  # the next save goes ahead regardless
            log.error("the previous background save failed: %s", exc)
        self._pending = None
        self._limit_retries(Cutoff())

    def _limit_retries(self, cutoff: Cutoff) -> None:
        """Let the store's retries end by `cutoff`; without one, restore the store's own limit."""
        if self._retry_deadline_s is None:  # a store without retries (a filesystem)
            return
        left = cutoff.left()
        self.remote.retry_deadline_s = (  # type: ignore[attr-defined]
            self._retry_deadline_s if left is None else max(0.0, min(self._retry_deadline_s, left))
        )

    @contextlib.contextmanager
    def _streams(self, step: int, cutoff: Cutoff) -> Iterator[ShardStreams | None]:
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
            self.remote, step_dir_name(step), manifest_key(step), threads=self.thread_count, cutoff=cutoff
        )
        try:
            yield streams
        finally:
            streams.close()

    @contextlib.contextmanager
    def _retries_until(self, cutoff: Cutoff) -> Iterator[None]:
        """The store's retries end by `cutoff` inside, and get their own limit back after."""
        self._limit_retries(cutoff)
        try:
            yield
        finally:
            self._limit_retries(Cutoff())

    def _save(
        self,
        step: int,
        state_dict: dict[str, Any],
        reason: str,
        notice: Notice | None,
        deadline: datetime | None,
        cutoff: Cutoff,
        started_at: datetime,
        *,
        comm: Comm | None = None,
        planner: SavePlanner | None = None,
        leaving: tuple[int, ...] = (),
        on_commit: Callable[[SurvivorsOutcome], None] | None = None,
        stall_s: float = 0.0,
    ) -> SaveReport:
        """The save protocol on `comm`'s ranks; `on_commit` hears of the local commit on its rank 0."""
        with self._retries_until(cutoff), self._streams(step, cutoff) as streams:
            comm = comm or self.comm
            t0 = time.monotonic()
            stage_name, refusal = comm.broadcast(
                (sibling_name(step, "tmp"), self._claim.refusal) if comm.is_coordinator else None
            )
            if refusal:
                raise SharedDirectory(refusal)
            stage = self.stage_root / stage_name
            records: list[FileRecord] = []
            error = None
            try:
                stage.parent.mkdir(parents=True, exist_ok=True)
                records = write_shards(
                    stage,
                    state_dict,
                    comm,
                    threads=self.write_threads,
                    planner=planner,
                    sha256=self._key is not None,
                    tee=streams.open if streams is not None else None,
                )
            except FAILURES as exc:
                error = describe(exc, comm.rank)
            t_written = time.monotonic()
            gathered = comm.gather((records, error))
            commit = self._commit(step, reason, notice, stage, gathered, comm, leaving) if comm.is_coordinator else None
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
                    durable, upload_error, uploaded = self._uploader.upload(
                        step, commit, records, stage, final, deadline, cutoff, comm, streams
                    )
                    durable_at = utc_now() if durable else None
                    if uploaded:  # streamed uploads began with the write: their rate counts from there
                        began = t0 if streams is not None and streams.streamed_bytes else t_committed
                        self._uploader.bytes_per_s = commit.bytes / max(time.monotonic() - began, 1e-9)
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
                    key=self._key,
                    claim=self._claim,
                )
            if comm.is_coordinator:
                log.info(
                    "checkpoint step %d (%s) %s: %.1f MB in %d files, write %.2fs commit %.2fs upload %.2fs "
                    "(rank 0 streamed %.1f MB during the write)%s",
                    step,
                    reason,
                    "durable at " + report.location if durable else "committed locally only at " + str(final),
                    report.bytes / 1e6,
                    report.files,
                    report.write_s,
                    report.commit_s,
                    report.upload_s,
                    report.streamed_bytes / 1e6,
                    f", {report.margin_s:.1f}s before the deadline" if report.margin_s is not None else "",
                )
            self.last_report = report
            return report

    def _commit(
        self,
        step: int,
        reason: str,
        notice: Notice | None,
        stage: Path,
        gathered: list,
        comm: Comm,
        leaving: tuple[int, ...],
    ) -> LocalCommit:
        """The saving group's rank 0: write the manifest last and rename the staging directory into place."""
        errors = [err for _, err in gathered if err]
        if self._key is not None:  # a rank without the key left its files unhashed: signing would vouch for them blind
            errors += [
                f"rank {comm.members[i]}: no checkpoint key (set {KEY_ENV} on every node)"
                for i, (recs, _) in enumerate(gathered)
                if any(r.sha256 is None for r in recs)
            ]
        if errors:
            return LocalCommit(error="; ".join(errors))
        try:
            manifest = Manifest(
                step=step,
                reason=reason,
                world_size=self.comm.world_size,
                created_at=isoformat_z(utc_now()),
                files=tuple(sorted((r for recs, _ in gathered for r in recs), key=lambda r: r.name)),
                notice=notice.to_json() if isinstance(notice, Notice) else notice,
                versions=versions(),
                saved_by=tuple(comm.members),
                leaving=leaving,
                run=self.run,
            )
            final, created = commit_dir(
                stage, sign(manifest, self._key) if self._key is not None else manifest, self._claim
            )
        except SharedDirectory as exc:
            return LocalCommit(error=str(exc))
        except Exception as exc:  # returned, not raised: every rank waits for this outcome
            return LocalCommit(error=f"commit: {type(exc).__name__}: {exc}")
        return LocalCommit(path=str(final), created=created, bytes=manifest.total_bytes, files=len(manifest.files))

    def _emit(self, comm: Comm, event: str, **detail: Any) -> None:
        if self.on_event is not None and comm.is_coordinator:
            self.on_event(event, **detail)


def _writable_dir(path: Path, argument: str) -> None:
    """Make `path` a directory this process can write in, or fail now, in one line: not at the first save."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{argument}: cannot create {path}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{argument}: {path} is not writable by this process")


def default_write_threads() -> int:
    """Files each rank writes (and resume reads) in parallel: this node's cores shared among its ranks, 2 to 16.

    Two were fastest with 2 cores and 2 ranks; on one H100 with 16 cores, an 8 GB emergency save
    from staged host buffers took 3.9 s with 16 writers against 4.2 s with 8.
    """
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(2, min(16, (os.cpu_count() or 2) // max(1, ranks_here)))
