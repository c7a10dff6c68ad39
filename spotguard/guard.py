"""Guard: the one object a training loop touches.

    with spotguard.Guard("s3://bucket/run-7") as guard:
        start = guard.resume(state)
        for step in range(start, total_steps):
            train_step()
            if guard.step(step, state):
                break

Entering starts the watcher (cloud metadata on each node's local rank 0, signals
on every rank) and the broadcast listener; `step()` is a lock and a comparison
until all ranks have agreed on a step to save at; at that step every rank saves
its shards, the checkpoint is committed, and `step()` returns True. When only some
nodes of the job are reclaimed, the survivors save without them (see
`spotguard.checkpoint.checkpointer`). Leaving the block after an emergency exits with
`exit_code` (143) when its checkpoint was committed, `lost_exit_code` (75) when it was not.
A node that goes silent, or a loop that stops stepping, ends the process with `lost_exit_code`
(`spotguard.health`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, MutableMapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from cloud_adapters import validation as check
from cloud_adapters.notice import Notice
from cloud_adapters.stores import check_location
from spotguard.checkpoint import Checkpointer, CheckpointError, CheckpointUnavailable, SaveReport
from spotguard.checkpoint.comm import new_gloo_group
from spotguard.checkpoint.format.auth import resolve_key
from spotguard.checkpoint.format.manifest import REASONS
from spotguard.ending import elastic
from spotguard.ending.exit_policy import (  # noqa: F401 - re-exported: where these lived before
    DEFAULT_EXIT_CODE,
    DEFAULT_LOST_EXIT_CODE,
    EXIT_FILE_ENV,
    UNAVAILABLE_EXIT_CODE,
    ExitPolicy,
)
from spotguard.goodput.recorder import GoodputRecorder
from spotguard.goodput.timeline import Timeline
from spotguard.job import topology
from spotguard.job.agreement import Decision
from spotguard.job.coordination import Coordination
from spotguard.options import (
    CoordinationOptions,
    ExitOptions,
    GuardOptions,
    HealthOptions,
    NoticeOptions,
    SaveOptions,
    SnapshotOptions,
    StorageOptions,
    former_attribute,
)
from spotguard.snapshots.tier import SnapshotTier
from spotguard.watcher import Watcher, add_sources
from spotguard.wiring.end import end
from spotguard.wiring.health import GuardHealth
from spotguard.wiring.kept import Kept
from spotguard.wiring.rounds import EmergencyOutcome, GuardParts, Rounds
from spotguard.wiring.snapshots import SNAPSHOT, GuardSnapshots

log = logging.getLogger(__name__)
REQUESTABLE = tuple(r for r in REASONS if r not in ("emergency", "snapshot-resume"))  # a resume's own request


class Guard:
    """Watches for interruptions and saves every rank's state at one agreed step.

    Args:
        checkpoint_dir: where committed checkpoints live: a local or shared path, file://,
            s3://bucket/prefix, gs://bucket/prefix or az://container/prefix.
        cloud: "aws", "gcp", "azure", "none" (signals only) or "auto" (detect); a shortcut for
            `NoticeOptions.cloud`.
        notices: where notices come from (`NoticeOptions`).
        saving: when to save besides an interruption, how many saves to keep (`SaveOptions`).
        storage: how saves are written, moved and signed (`StorageOptions`).
        exiting: how the process ends after an emergency (`ExitOptions`).
        coordination: this process's place in the job, the agreement's timeout (`CoordinationOptions`).
        snapshots: snapshots in the nodes' memory for losses without a notice (`SnapshotOptions`; off by
            default, or `$SPOTGUARD_SNAPSHOT_EVERY`).
        health: failures without a notice, a node gone silent or a loop that stopped stepping (`HealthOptions`;
            on by default, or `$SPOTGUARD_PEER_TIMEOUT` and `$SPOTGUARD_HANG_TIMEOUT`).
        in_process: set by `spotguard.run` (in-process recovery): after a departure, or a node lost without a
            notice, the survivors' `close()` returns instead of exiting (`goes_on` says with whom), and a
            departure's leaving ranks exit 0.
        **options: any field of those groups by its name, e.g. `keep_last=3`, `save_interval_s=600`,
            `exit_code=None`, `store=..., rank=..., world_size=...` (see the configuration reference).
            `poll_interval` and `thread_count` are the deprecated names of `poll_interval_s` and
            `transfer_threads`.
    """

    def __init__(
        self,
        checkpoint_dir: str,
        cloud: str | None = None,
        *,
        notices: NoticeOptions | None = None,
        saving: SaveOptions | None = None,
        storage: StorageOptions | None = None,
        exiting: ExitOptions | None = None,
        coordination: CoordinationOptions | None = None,
        snapshots: SnapshotOptions | None = None,
        health: HealthOptions | None = None,
        in_process: bool = False,
        **options: Any,
    ) -> None:
        if cloud is not None:
            options["cloud"] = cloud
        groups = {"notices": notices, "saving": saving, "storage": storage, "exiting": exiting,
                  "coordination": coordination, "snapshots": snapshots, "health": health}  # fmt: skip
        self.options = GuardOptions.build(groups, options)
        self._in_process = in_process  # set by spotguard.run: the survivors of a loss go on in their processes
        self.checkpoint_dir = check_location(checkpoint_dir)
        self._checkpoint_key = resolve_key(self.options.storage.checkpoint_key)  # kept out of reprs and logs
        self._min_nodes = elastic.min_nodes(self.options.exiting.min_nodes)
        self._goodput = GoodputRecorder(self.options.saving.cadence())
        # The tier is made at its first need: after the Checkpointer (its group), once the store is known.
        self._snapshots = GuardSnapshots(
            self.options.snapshots,
            self.checkpoint_dir,
            lambda: (self._checkpointer(), self._coordination.store, self._coordination.prefix),
        )

        self._emergency = EmergencyOutcome()  # what an emergency left for the end
        self.timeline = Timeline()
        self.resumed_from: str | None = None  # the last resume's tier: "snapshot", "durable"; None: a fresh start
        self._started = False
        self._ckpt: Checkpointer | None = None
        self._last_step: int | None = None  # the last step the loop reported (for the ledger)
        self._health: GuardHealth | None = None
        self._coordination: Coordination | _NotStarted = _NotStarted()
        self._rounds: Rounds | None = None

    def __getattr__(self, name: str) -> Any:
        """The settings were attributes of the guard before they were grouped in `guard.options`:
        reading one by its former name still works, with a DeprecationWarning."""
        if name.startswith("_") or name == "options":  # not set yet: never a setting
            raise AttributeError(f"'Guard' object has no attribute {name!r}")
        return former_attribute(self.options, name)

    @property
    def notice(self) -> Notice | None:
        """The interruption being handled, once one arrives (`notice.node`: the node being reclaimed)."""
        return self._coordination.notice

    @property
    def interrupted(self) -> bool:
        """Whether step() returned True for an emergency."""
        return self._emergency.interrupted

    @property
    def emergency_saved(self) -> bool:
        """Whether the emergency's checkpoint was committed where a new VM finds it."""
        return self._emergency.saved

    @property
    def leaving(self) -> bool:
        """Whether this node was the one the emergency reclaimed."""
        return self._emergency.leaving

    @property
    def goes_on(self) -> tuple[int, ...]:
        """Under `spotguard.run`, after a departure or a node lost without a notice: the ranks the job goes on
        with in their processes (this generation's ranks, in order), else ()."""
        return self._emergency.goes_on

    @property
    def joining(self) -> tuple[int, ...]:
        """Under `spotguard.run`, after the step agreed for nodes waiting to join: their join numbers, else ()."""
        return self._emergency.joining

    # ---- lifecycle -------------------------------------------------------------
    def start(self) -> Guard:
        """Start watching: signal handlers, the watcher and listener threads, the coordination
        through the store (what entering `with guard:` does). Returns the guard."""
        if self._started:
            raise RuntimeError("this Guard is started already: start a Guard once at a time")
        stated = self.options.coordination.stated
        self.topology = topology.explicit(*stated) if stated else topology.current()
        self._exit = ExitPolicy.on(self.topology, self.options.exiting.exit_code, self.options.exiting.lost_exit_code)
        self._group = self._ckpt = self._watcher = self._rounds = self._health = None
        self._last_step = None  # a guard entered again times nothing before its first step
        self.resumed_from = None  # ... and has resumed from nothing yet
        self._coordination = _NotStarted()
        self._goodput.reset()
        self._started_at = time.monotonic()  # the timers' run hours count from here
        try:
            self._start()
        except BaseException:
            self._teardown()  # never leave a signal handler, a thread or a group behind
            raise
        self._started = True
        return self

    __enter__ = start  # the same frame depth either way: warnings point at the caller's line

    def _start(self) -> None:
        has_group = dist.is_available() and dist.is_initialized()
        if self.topology.distributed and has_group:
            self._group = new_gloo_group(timeout=timedelta(minutes=10), at_once=self._in_process)
        if has_group or not self.topology.distributed:
            self._checkpointer()  # now, so that a checkpoint_dir that cannot work fails here
        # The default group's store (a private accessor, present since torch 1.x) is the one every rank shares.
        store = self.options.coordination.store or (
            dist.distributed_c10d._get_default_store() if self.topology.distributed else dist.HashStore()
        )
        health = self._health = GuardHealth(
            self.topology,
            self.options.health,
            timeline=self.timeline,
            goodput=self._goodput,
            exit_policy=self._exit,
            min_nodes=self._min_nodes,
            last_step=lambda: self._last_step,
            ledger_store=lambda: self._ckpt.remote if self._ckpt is not None else None,
            outcome=self._emergency,
            in_process=self._in_process,
        )
        parts = GuardParts(
            topology=self.topology,
            options=self.options,
            timeline=self.timeline,
            goodput=self._goodput,
            snapshots=self._snapshots,
            exit_policy=self._exit,
            min_nodes=self._min_nodes,
            make_checkpointer=self._checkpointer,
            checkpointer_if_made=lambda: self._ckpt,
            coordination=lambda: self._coordination,  # type: ignore[arg-type,return-value]  # set just below
            watcher=lambda: self._watcher,  # type: ignore[arg-type,return-value]  # set before any notice
            busy=self._busy,
            in_process=self._in_process,
        )
        rounds = self._rounds = Rounds(parts, self._emergency, started_at=self._started_at)
        coordination = self._coordination = Coordination(
            store,
            topology.run_prefix(store, self._group, self.topology, self.checkpoint_dir),
            self.topology,
            timeout_s=self.options.coordination.agreement_timeout_s,
            on_agreed=rounds.on_agreed,
            on_silent=health.monitor.on_event,
        )
        coordination.start()
        health.start(store, coordination)
        notices = self.options.notices
        self._watcher = Watcher(
            [], rounds.on_notice, interval_s=notices.poll_interval_s, on_update=rounds.on_notice_update
        )
        add_sources(self._watcher.sources, notices, node_leader=self.topology.is_node_leader)
        self._watcher.start()
        rounds.start_timers()

    def _checkpointer(self) -> Checkpointer:
        """The Checkpointer (and rank 0's ledger), made at the first need: with a stated topology and no
        process group yet, that is the first resume or save."""
        if self._ckpt is not None:
            return self._ckpt
        if self.topology.distributed and not (dist.is_available() and dist.is_initialized()):
            raise CheckpointError(
                f"saving or resuming at world_size={self.topology.world_size} needs torch.distributed "
                "initialised (init_process_group) first"
            )
        if self.topology.distributed and self._group is None:
            topology.explicit(self.topology.rank, self.topology.world_size)  # the group must be the stated one
            self._group = new_gloo_group(timeout=timedelta(minutes=10), at_once=self._in_process)
        storage, saving = self.options.storage, self.options.saving
        self._ckpt = Checkpointer(
            self.checkpoint_dir,
            local_dir=storage.local_dir,
            group=self._group,
            keep_last=saving.keep_last,
            write_threads=storage.write_threads,
            transfer_threads=storage.transfer_threads,
            stream_uploads=storage.stream_uploads,
            on_event=self.timeline.add,
            on_outcome=self._goodput.saved,
            checkpoint_key=self._checkpoint_key,
        )
        if self.topology.is_coordinator:
            self._goodput.open(self._ckpt.remote, lambda: self._last_step, self.topology, saving)
        return self._ckpt

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.close(exc)

    def close(self, error: BaseException | None = None) -> None:
        """Stop watching and release everything `start` took (what leaving `with guard:` does).

        After an emergency, and unless `exit_code` is None or `error` (the exception that ended
        the training, if any) is given, this exits the process: `exit_code` when the emergency
        checkpoint was committed, `lost_exit_code` when not. Closing a guard not started does nothing.
        """
        if not self._started:
            return
        if self._health is not None:
            self._health.monitor.hold_if_ending()
        self._started = False
        try:
            self._end(error)
        finally:
            if self._health is not None and self.goes_on:  # back from the step the lost node held up
                self._health.monitor.recovered()

    def _end(self, error: BaseException | None) -> None:
        end(
            self._exit,
            self._emergency,
            self._goodput,
            error=error,
            last_save=self.last_save,
            last_step=self._last_step,
            teardown=self._teardown,
        )

    def _teardown(self, saves_done: Callable[[], None] = lambda: None) -> None:
        """Stop everything the guard started; `saves_done` runs once the last save has ended."""
        if self._health is not None:
            self._health.stop()  # first: what follows may take longer than a step, and closes connections
        if self._rounds is not None:
            self._rounds.stop()
        if self._watcher is not None:
            self._watcher.stop()  # also restores the signal handlers
            self._exit.keep_sigterm_away()
        if isinstance(self._coordination, Coordination):
            self._coordination.stop()
        if self._ckpt is not None:
            try:
                self._ckpt.wait()
            except Exception:  # noqa: BLE001 - a failed background save is already logged; leave cleanly
                log.exception("the last background checkpoint failed")
            saves_done()  # the ledger's exit record comes after the last save's
            self._goodput.close()  # after the last save's record, before the store closes
            self._ckpt.close()
        self._snapshots.close(wait=not self._emergency.interrupted)  # after an emergency, leave without the snapshot
        if self._group is not None:
            dist.destroy_process_group(self._group)

    @property
    def started(self) -> bool:
        """Whether the guard is started (entered, or `start()`ed) and not closed yet."""
        return self._started

    @property
    def snapshots(self) -> SnapshotTier | None:
        """The snapshot tier while it runs (`snapshots.last`: the last snapshot's measurements), else None."""
        return self._snapshots.tier

    @property
    def last_save(self) -> SaveReport | None:
        """The report of the last save that committed, a background one too (None before any)."""
        return self._ckpt.last_report if self._ckpt is not None else None

    # ---- the training loop's calls ----------------------------------------------
    def resume(self, state: MutableMapping[str, Any], *, kept: Kept | None = None) -> int:
        """Load the newest committed checkpoint into `state`; returns the step to start from (0 if none).
        `kept`: under `spotguard.run`, what this rank kept in memory of the step the job goes on from."""
        self._require_started("resume")
        started = time.monotonic()
        try:
            step, tier = self._snapshots.resume(
                state,
                self._checkpointer(),
                coordinator=self.topology.is_coordinator,
                ask_for_save=self._started_rounds("resume").request,
                kept=kept,
            )
        except CheckpointUnavailable as exc:
            if self._exit.exit_code is None:
                raise
            # Committed work exists but cannot be read now: starting afresh would throw it away.
            log.error("%s; exiting with code %d (start again once the storage answers)", exc, UNAVAILABLE_EXIT_CODE)
            raise SystemExit(UNAVAILABLE_EXIT_CODE) from None
        next_step = 0 if step is None else step + 1
        self.resumed_from = None if step is None else tier
        resharded = self._snapshots.resharded
        took = time.monotonic() - started
        self._goodput.resumed(step, next_step, took, self._ckpt.run, tier=tier, resharded=resharded)
        if step is None:
            self.timeline.add("fresh-start", checkpoint_dir=self.checkpoint_dir)
            return 0
        self._coordination.reset(step)
        self.timeline.add(
            "resumed", step=step, next_step=next_step, tier=tier, **({"resharded": resharded} if resharded else {})
        )
        return next_step

    def step(self, step: int, state: Mapping[str, Any]) -> bool:
        """Call after every training step; True once the emergency checkpoint of `step` is committed (under
        `spotguard.run`, also once the snapshot that joining nodes load is taken: return then).

        A step reported again (a loop that counts optimizer steps, called at every micro-batch of a
        gradient accumulation) is not saved again.
        """
        if type(step) is not int or step < 0:  # the fast path is one comparison; anything else is checked
            step = _as_step(step)
        again = step == self._last_step
        due = self._coordination.reached(step)  # raises unless the guard is started: then these are set
        rounds, health = self._rounds, self._health
        health.beats += 1  # type: ignore[union-attr]
        self._last_step = step
        rounds.last_state = state  # type: ignore[union-attr]  # for the listener to size a coming handoff
        if due:
            return rounds.run(step, state, due, again)  # type: ignore[union-attr]
        every = self.options.saving.save_every
        if every and step % every == 0 and not again:
            rounds.save(step, state, reason="periodic", wait=False)  # type: ignore[union-attr]
        snapshot_every = self._snapshots.every
        if snapshot_every and step % snapshot_every == 0 and not again:
            rounds.snapshot(step, state)  # type: ignore[union-attr]
        return False

    def heartbeat(self) -> None:
        """The loop works, though it makes no training step (an evaluation batch, a data shuffle's chunk):
        the hang timeout counts from now. Any thread; cheap enough to call per batch."""
        if self._health is not None:
            self._health.monitor.alive()

    def long_phase(self, seconds: float, what: str = "a long phase") -> contextlib.AbstractContextManager[None]:
        """Say that the next `seconds` pass without a `step()` (an evaluation, a data shuffle): the hang
        timeout counts from their end. As a context manager, leaving it also counts as a step:

            with guard.long_phase(600, "evaluation"):
                evaluate(model)
        """
        self._require_started("long_phase")
        seconds = check.seconds("seconds", seconds)
        self.timeline.add("long-phase", what=what, seconds=seconds)
        assert self._health is not None
        self._health.monitor.allow(seconds)
        return self._health.monitor.phase()

    def request_checkpoint(self, reason: str = "manual") -> None:
        """Ask every rank, from this one (any thread), to save at the next step they all agree on, in the
        background, as an interval save does: unlike `save()`, the other ranks need not call anything.
        `reason` names the save in its manifest and the ledger: "manual" (the default), "periodic",
        "interval" or "rebalance" ("snapshot" and "emergency" are reserved)."""
        rounds = self._started_rounds("request_checkpoint")
        if reason in (SNAPSHOT, "emergency"):  # the snapshot timer's (it takes no save), and a notice's
            raise ValueError(f"request_checkpoint: reason {reason!r} is reserved; give another")
        if reason not in REQUESTABLE:  # the manifest records one of its reasons: another would fail the save
            raise ValueError(f"request_checkpoint: reason must be one of {REQUESTABLE}, not {reason!r}")
        rounds.request(reason)

    def save(self, step: int, state: Mapping[str, Any]) -> SaveReport | None:
        """Save now, on demand. With several ranks, every rank must call it at the same step."""
        return self._started_rounds("save").save(_as_step(step), state, reason="manual", wait=True)

    def record_recovery(self, **fields: Any) -> None:
        """`spotguard.run`'s word that this guard's run follows an in-process recovery (`fields`: those of
        the ledger's `recovered` record), for the goodput ledger."""
        self._goodput.recovered(**fields)

    def admit(self, nodes: list[int], on_failed: Callable[[list[int], str], None]) -> None:
        """`spotguard.run`'s rank 0, any thread: ask every rank to stop at the next step they agree on, so that
        the joining `nodes` (their join numbers) enter the job after it; `on_failed(nodes, why)` if they cannot."""
        if not self._in_process:
            raise RuntimeError("Guard.admit() is spotguard.run's: nodes join a job run by it")
        self._started_rounds("admit").request_join(nodes, on_failed)

    # ---- internals ---------------------------------------------------------------
    def _busy(self) -> contextlib.AbstractContextManager[None]:
        """spotguard's own work on the training thread: the hang timeout does not count it."""
        return self._health.busy() if self._health is not None else contextlib.nullcontext()

    def _require_started(self, what: str) -> None:
        if not self._started:
            raise RuntimeError(_not_started(what))

    def _started_rounds(self, what: str) -> Rounds:
        self._require_started(what)
        assert self._rounds is not None  # made by start()
        return self._rounds


def _not_started(what: str) -> str:
    return f"Guard.{what}() needs the guard started: use `with Guard(...) as guard:` or `guard.start()`"


class _NotStarted:
    """Stands in for the coordination until the guard is started, so a misuse gets a clear error."""

    notice = None

    def reached(self, step: int) -> list[Decision]:
        raise RuntimeError(_not_started("step"))


def _as_step(step: Any) -> int:
    """`step` as an int (numpy integers and 0-dim integer tensors too), or a one-line error at the call."""
    return check.count("step", step, minimum=0)
