"""Checkpointer: the save/resume object the Guard drives, a facade over the pieces of `checkpoint`.

A save runs `protocol.SaveProtocol` (write, checksum, commit, upload, retention) on every rank.
Async saves (wait=False) copy the state into host buffers reused from save to save
(`staging.Stager`: the training thread pays a memcpy) and run the same protocol in the
background (`background.BackgroundSaves`), one save at a time. An emergency in which only some
nodes are reclaimed (a `Departure`) runs the protocol on the survivors alone (`departing`): a
leaving rank only hands the shards that exist nowhere else to a survivor's memory, and is then
free to go; the survivors write everything and commit. A save with a deadline (an emergency)
takes over from a background save in flight: that one's upload is abandoned at once, its
committed local copy kept, and it is waited for only until the deadline.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Mapping, MutableMapping, Sequence
from concurrent.futures import Future
from datetime import datetime
from pathlib import Path
from typing import Any

import torch.distributed as dist

from cloud_adapters import validation as check
from cloud_adapters.deadline import Deadline
from cloud_adapters.notice import Notice, utc_now
from cloud_adapters.storage import LocalStore, ObjectStore
from cloud_adapters.stores import open_store
from spotguard.checkpoint.comm import Comm
from spotguard.checkpoint.format.auth import CheckpointKey, resolve_key
from spotguard.checkpoint.format.identity import job_identity
from spotguard.checkpoint.format.layout import step_dir_name
from spotguard.checkpoint.format.manifest import REASONS
from spotguard.checkpoint.format.runs import RunClaim, new_run_id
from spotguard.checkpoint.io.staging import Stager
from spotguard.checkpoint.moves import departing
from spotguard.checkpoint.moves.durable import Uploader
from spotguard.checkpoint.moves.handoff import ReceivePool, sharded_nbytes
from spotguard.checkpoint.outcome import SaveEvents, SaveOutcomes, SaveReport
from spotguard.checkpoint.resume.newest import candidate_steps, load_newest
from spotguard.checkpoint.save.background import BackgroundSaves
from spotguard.checkpoint.save.protocol import SaveProtocol
from spotguard.checkpoint.state import to_dcp
from spotguard.job.departure import Departure, senders_to
from spotguard.job.topology import ranks_per_node

log = logging.getLogger(__name__)

# Kept free before a deadline: the manifest upload and the process exit happen in it.
DEADLINE_RESERVE_S = 3.0


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
    `transfer_threads`: parallel uploads, downloads and verifications per rank (formerly `thread_count`,
    still accepted with a DeprecationWarning).
    """

    def __init__(
        self,
        checkpoint_dir: str,
        *,
        local_dir: str | None = None,
        group: dist.ProcessGroup | None = None,
        keep_last: int | None = None,
        write_threads: int | None = None,
        transfer_threads: int = 4,
        on_event: SaveEvents | None = None,
        on_outcome: SaveOutcomes | None = None,
        checkpoint_key: CheckpointKey | None = None,
        stream_uploads: bool = True,
        thread_count: int | None = None,
    ) -> None:
        if thread_count is not None:
            warnings.warn(
                "Checkpointer(thread_count=...) is deprecated: use transfer_threads=", DeprecationWarning, stacklevel=2
            )
            transfer_threads = thread_count
        keep_last = check.optional(check.count, "keep_last", keep_last)
        self._write_threads = check.optional(check.count, "write_threads", write_threads) or default_write_threads()
        self._transfer_threads = check.count("transfer_threads", transfer_threads)
        self.remote: ObjectStore = open_store(checkpoint_dir)
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
        self._background = BackgroundSaves()
        self._stager = Stager()  # background saves copy into its buffers, reused from save to save
        self._receive_pool: ReceivePool | None = None  # set by expect_handoff, used by the next survivor save
        self.last_report: SaveReport | None = None  # of the last save that committed, background ones too
        # This run's id (every rank the same: one start of the job), in each manifest it commits.
        self.run: str = self.comm.broadcast(new_run_id() if self.comm.is_coordinator else None)
        self._claim = RunClaim(self.run, utc_now(), self._key)  # judged on rank 0
        self._note_earlier_steps()
        self.on_outcome = on_outcome
        self._uploader = Uploader(self.remote, self._claim, self._transfer_threads, on_event)
        self._protocol = SaveProtocol(
            remote=self.remote,
            stage_root=self.stage_root,
            local_root=self.local_root,
            comm=self.comm,
            run_id=self.run,
            claim=self._claim,
            key=self._key,
            uploader=self._uploader,
            write_threads=self._write_threads,
            transfer_threads=self._transfer_threads,
            stream_uploads=stream_uploads,
            keep_last=keep_last,
            on_event=on_event,
        )

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
        cutoff = Deadline()
        if deadline is not None:
            cutoff.bring_forward(time.monotonic() + (deadline - utc_now()).total_seconds() - DEADLINE_RESERVE_S)
        elif departure is not None:  # the ranks wait on each other: never without a bound
            cutoff.bring_forward(time.monotonic() + departing.NO_DEADLINE_WAIT_S)
        self._background.finish(cutoff)
        if reason == "emergency":
            # the emergency they made way for is here: later saves upload again
            self._background.uploads_abandoned = False
        state_dict = to_dcp(state)
        started_at = utc_now()
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
                    Deadline(),
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
        self._background.submit(
            step,
            lambda cut: self._save(step, snapshot, reason, notice, deadline, cut, started_at, stall_s=stall_s),
            cutoff,
            lambda done: self._tell_done(step, reason, done),
        )
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

    def expect_handoff(self, state: Mapping[str, Any], leaving: Sequence[int]) -> None:
        """At the agreement of an emergency in which `leaving` ranks go (any thread, while the training
        step in flight still runs): a survivor that will take a leaving rank's shards touches memory for
        them now, on a thread of its own (`handoff.receive.ReceivePool`). Sharded state only (a
        replicated one hands nothing over); sized from this rank's own shards of `state`: FSDP-style
        layouts shard every tensor alike on every rank."""
        rank = dist.get_rank() if self.comm.distributed else 0  # `leaving` names global ranks
        world = dist.get_world_size() if self.comm.distributed else 1
        if not leaving or rank in leaving or len(leaving) >= world:
            return
        try:
            nbytes = sharded_nbytes(state) * len(senders_to(leaving, rank, world))
        except Exception:  # noqa: BLE001 - only a head start: the handoff allocates as it goes without it
            log.debug("could not size the coming handoff", exc_info=True)
            return
        self._receive_pool = ReceivePool(nbytes) if nbytes > 0 else None

    def abandon_background_uploads(self) -> None:
        """An emergency has been agreed (called from any thread, on every rank alike): the background
        save in flight, and any started before the emergency step, stop uploading at once and keep
        their local commit, so no upload stands between the notice and the emergency save."""
        self._background.abandon_uploads()

    def wait(self, timeout: float | None = None) -> SaveReport | None:
        """Finish the in-flight async save; its report, or None when none was in flight.

        Raises CheckpointError if it failed, TimeoutError if it is still running after `timeout`.
        """
        return self._background.wait(timeout)

    def resume(self, state: MutableMapping[str, Any]) -> int | None:
        """Load the newest good committed step into `state` (a collective); its step, or None."""
        self._background.finish()
        step = load_newest(
            state,
            remote=self.remote,
            local_root=self.local_root,
            comm=self.comm,
            threads=self._transfer_threads,
            read_threads=self._write_threads,  # files are read as many at a time as they are written
            key=self._key,
            bad=self._claim.rejected,
        )
        return step

    def newest_committed(self) -> int | None:
        """The newest committed step (not verified; steps already found bad left out), or None.
        Raises what the store raises when it cannot list now."""
        steps = candidate_steps(self.remote, self.local_root, self._key)
        return next((s for s in steps if s not in self._claim.rejected), None)

    def job_identity(self) -> str:
        """The job identity the checkpoint location keeps (`job.job_identity`, with this checkpoint key):
        store calls, made by one rank."""
        return job_identity(self.remote, self._key)

    def stamp_job(self, job: str | None) -> None:
        """Write `job`, the location's job identity, into the manifest of every step committed from now on
        (a lost `spotguard-job.json` is re-adopted from them). On every rank: whichever commits stamps."""
        self._protocol.job = job

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
        self._background.finish()
        self._background.shutdown()
        self._protocol.close()
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

    def _save(self, step: int, state_dict: dict[str, Any], reason: str, *args: Any, **kwargs: Any) -> SaveReport:
        report = self._protocol.run(step, state_dict, reason, *args, **kwargs)
        self.last_report = report
        return report


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
    ranks_here = ranks_per_node()
    return max(2, min(16, (os.cpu_count() or 2) // max(1, ranks_here)))
