"""A guard's snapshots: when it takes them, and a resume that weighs them against the durable tier.

The tier itself (`spotguard.snapshots`) stands on the checkpoint layer; this is the guard's side of
it: the tier made at its first need, the step count or the timer (fixed or adaptive) that decides a
snapshot, a failed snapshot never reaching the training loop, and the resume that loads the newest
whole snapshot when it is as new as the durable checkpoints, else the durable path.
"""

from __future__ import annotations

import functools
import logging
import secrets
import sys
import time
from collections.abc import Callable, Collection, Mapping, MutableMapping
from typing import Any

import torch.distributed as dist

from spotguard.checkpoint import Checkpointer, CheckpointError
from spotguard.goodput.recorder import GoodputRecorder
from spotguard.job.topology import location_key
from spotguard.options import SnapshotOptions
from spotguard.snapshots.loading import HeldHere
from spotguard.snapshots.shard_file import SnapshotLoadError
from spotguard.snapshots.tier import SnapshotTier
from spotguard.wiring.kept import MEMORY, Kept, fits, load_kept, load_own

log = logging.getLogger(__name__)

SNAPSHOT = "snapshot"  # the reason of an agreed step that is a snapshot's, not a save's
EMERGENCY_WAIT_S = 60.0  # the longest an emergency waits for the snapshot of its step
EMERGENCY_MARGIN_S = 5.0  # the time before the deadline that snapshot leaves alone
JOIN_WAIT_S = 60.0  # the longest a rank waits for the snapshot a joining node loads
FINAL_REPLICAS_WAIT_S = 10.0  # when the job goes on without some ranks: the longest a rank waits for their copies
# Rank 0 could not list the committed steps: no snapshot is newer than this, so none is loaded.
_UNKNOWN_STEP = sys.maxsize


class GuardSnapshots:
    """One guard's snapshots of its state for `checkpoint_dir`; `context()` gives the guard's Checkpointer
    (its process group and checkpoint location), the job's store and the guard's prefix in it, when
    the tier is made."""

    def __init__(
        self,
        options: SnapshotOptions,
        checkpoint_dir: str,
        context: Callable[[], tuple[Checkpointer, dist.Store, str]],
    ) -> None:
        self.options = options
        self.every = options.snapshot_every or 0  # step-counted snapshots (0: none, or timed)
        self.cadence = options.cadence()
        self.tier: SnapshotTier | None = None
        self._checkpoint_dir = checkpoint_dir
        self._context = context
        self._owner: tuple[str, str | None, str] | None = None  # (run, job, attempt): rank 0's, once made
        self._closed = 0  # a guard started again is a new attempt too
        self.resharded: tuple[int, int] | None = None  # (world size taken at, now) of the last resume, if it changed

    @property
    def timed(self) -> bool:
        return self.options.snapshot_interval_s is not None

    def made(self) -> SnapshotTier | None:
        """The tier when snapshots are asked for, made at its first need (a collective: the first
        snapshot or resume, on every rank)."""
        if self.tier is None and self.options.enabled:
            ckpt, store, prefix = self._context()
            if self._owner is None:  # once per guard: a retry after a failed tier is one rank's alone
                self._owner = ckpt.comm.broadcast(self._read_owner(ckpt))
            ckpt.stamp_job(self._owner[1])  # a lost identity file is re-adopted from the steps (format/identity.py)
            self.tier = SnapshotTier(
                run=self._owner[0],
                job=self._owner[1],
                attempt=f"{self._owner[2]}.{self._closed}",
                snapshot_dir=self.options.snapshot_dir,
                replicas=self.options.snapshot_replicas,
                comm=ckpt.comm,
                store=store,
                prefix=prefix,
                cadence=self.cadence,
            )
        return self.tier

    def _read_owner(self, ckpt: Checkpointer) -> tuple[str, str | None, str] | None:
        """(the location's key, its job identity, a new attempt identity) on rank 0: one read of the
        checkpoint location, not one per rank, and one key for the job wherever the location resolves
        differently."""
        if not ckpt.comm.is_coordinator:
            return None
        attempt = secrets.token_hex(8)
        try:
            return location_key(self._checkpoint_dir), ckpt.job_identity(), attempt
        except Exception as exc:  # noqa: BLE001 - no identity, no snapshots: the tier says so
            log.warning("the job identity in %s cannot be read or written (%s: %s)", self._checkpoint_dir,
                        type(exc).__name__, exc)  # fmt: skip
            return location_key(self._checkpoint_dir), None, attempt

    def take(self, step: int, state: Mapping[str, Any]) -> None:
        try:
            self.made().snapshot(step, state)  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - invariant 3: a failed snapshot never crashes the training loop
            log.exception("the snapshot of step %d was not taken", step)

    def skip(self, step: int, why: str, *, quiet: bool = False) -> None:
        """Say that the snapshot due at `step` is not taken, and why (the tier's record of it too, when
        there is a tier: what its `wait()` returns next). `quiet`: said already."""
        if self.tier is not None:
            self.tier.skip(step, why, quiet=quiet)
        elif not quiet:
            log.warning("the snapshot of step %d was not taken: %s", step, why)

    def keep_emergency(
        self, step: int, state: Mapping[str, Any], seconds_left: float | None, leaving: Collection[int] = ()
    ) -> None:
        """After the emergency's durable save, a snapshot of the same step (a collective): the job that
        starts next, at whatever world size, then reads it from the nodes' memory, not from storage.
        Taken only by a tier that has taken one already (its room agreed), never through the store (a
        rank that leaves first may take it down), and only when its last stall fits before
        EMERGENCY_MARGIN_S ahead of the deadline; waited for (its replicas too) until then at most. No replica
        goes to the `leaving` ranks: the job goes on without them, in its processes."""
        started = time.monotonic()
        budget = EMERGENCY_WAIT_S if seconds_left is None else min(EMERGENCY_WAIT_S, seconds_left - EMERGENCY_MARGIN_S)
        tier = self.tier
        if tier is None:
            log.warning("the snapshot of the emergency's step %d was not taken: no snapshot was taken before it", step)
            return
        if not tier.has_room:
            tier.skip(step, "the emergency's: snapshots are off for this run (the first snapshot said why)")
            return
        if tier.in_flight and tier.wait(timeout=max(0.0, budget)) is None:  # the one before still replicating
            tier.skip(step, f"the emergency's: the one before was still under way after {budget:.0f} s")
            return
        stall = tier.last.stall_s if tier.last is not None else 0.0
        if budget - (time.monotonic() - started) <= stall:
            left = budget - (time.monotonic() - started)
            tier.skip(step, f"the emergency's: {left:.1f} s left before the deadline's margin, its stall {stall:.1f} s")
            return
        try:
            tier.snapshot(step, state, final=True, leaving=leaving)
        except Exception:  # noqa: BLE001 - invariant 3, as for any snapshot
            log.exception("the snapshot of the emergency's step %d was not taken", step)
            return
        if tier.wait(timeout=max(0.0, budget - (time.monotonic() - started))) is None and tier.in_flight:
            log.warning("the snapshot of the emergency's step %d did not finish in %.0f s", step, budget)
            return
        wait_s = min(FINAL_REPLICAS_WAIT_S, max(0.0, budget - (time.monotonic() - started)))
        try:
            replicated = not leaving or tier.everyone_replicated(step, wait_s)
        except Exception as exc:  # noqa: BLE001 - invariant 3: the store may be gone with the job's end
            replicated = False
            log.warning("the copies of the emergency's step %d could not be counted (%s: %s)", step,
                        type(exc).__name__, exc)  # fmt: skip
        if not replicated:
            log.warning("not every rank's copy of the emergency's step %d reached a survivor in %.0f s", step, wait_s)

    def keep_for_join(self, step: int, state: Mapping[str, Any]) -> str | None:
        """The snapshot of `step` that nodes joining the running job load their state from (a collective,
        waited for, its replicas too): None once every rank's is taken, else why not (the same on every rank)."""
        if not self.options.enabled:
            return "snapshots are off (a joining node takes its state from the snapshot in the nodes' memory)"
        why = None
        ckpt = self._context()[0]
        try:
            ckpt.wait()  # a background save's collectives run on the same group as the ones below
        except Exception:  # noqa: BLE001 - that save's failure is logged; the snapshot does not need it
            log.warning("the background save before the snapshot of step %d failed", step)
        try:
            tier = self.made()
            assert tier is not None  # snapshots are on
            tier.snapshot(step, state)
            done = tier.wait(timeout=JOIN_WAIT_S)
            if done is None:
                why = f"rank {tier.rank}'s snapshot was not done in {JOIN_WAIT_S:.0f} s"
            elif not done.ok:
                why = f"rank {tier.rank}'s snapshot failed: {done.skipped or done.error}"
        except Exception as exc:  # noqa: BLE001 - invariant 3: the job trains on without the join
            why = f"{type(exc).__name__}: {exc}"
        problems = [w for w in ckpt.comm.all_gather(why) if w]
        return problems[0] if problems else None

    def interval(self, goodput: GoodputRecorder, run_hours: float) -> float:
        """The snapshot timer's interval: fixed, or the snapshot cadence's choice now."""
        if self.cadence is None:
            return self.options.snapshot_interval_s  # type: ignore[return-value]
        return goodput.next_interval(run_hours, self.cadence)

    def resume(
        self,
        state: MutableMapping[str, Any],
        ckpt: Checkpointer,
        *,
        coordinator: bool,
        ask_for_save: Callable[[str], None],
        kept: Kept | None = None,
    ) -> tuple[int | None, str | None]:
        """Load the newest whole snapshot if it is as new as every durable step, else the newest durable
        step that loads: (the step, "snapshot" or "durable"), or (None, None) for a fresh start. A
        collective. After an in-process recovery (`kept` given, on every rank), what the ranks kept in their
        own memory first: (the agreed step, "memory") when each kept it whole (`wiring/kept.py`). When nodes
        joined (their ranks kept nothing), they read the snapshot of the step, and a rank that kept it loads
        it from its own memory instead ("memory" there).

        The snapshot is weighed against what actually loads: when the newest durable step turns out
        damaged and an older one loads, a whole snapshot newer than that one is loaded over it. After
        a snapshot newer than every durable step, rank 0 asks for a durable save at once: the
        snapshot lives only in the nodes' memory, and losing more nodes than it is replicated to
        would lose it. Afterwards each node deletes its snapshots of later steps: they belong to a
        past that will not happen.
        """
        tier = self.made()
        self.resharded = None
        own = None
        if kept is not None:
            fit = fits(kept, state)
            if (step := load_kept(kept, state, ckpt.comm, fit)) is not None:
                if tier is not None:
                    tier.forget_after(step)
                if coordinator and not kept.durable:  # it lives only in the processes' memory
                    ask_for_save("snapshot-resume")
                return step, MEMORY
            if fit:  # nodes joined, holding nothing: they read the snapshot of the step, this rank not
                own = HeldHere(kept.step, functools.partial(load_own, kept, state))  # type: ignore[arg-type]
        newest = self._newest_durable(ckpt, coordinator) if tier is not None else None
        step, failed = self._restore(tier, state, newest, coordinator, ask_for_save, own=own)
        source = MEMORY if own is not None and step == own.step else "snapshot"
        if step is None:
            step, source = self._durable(state, ckpt, failed), "durable"
            # The newest durable step may be damaged and an older one loaded (rank 0 knows which).
            if step is not None and tier is not None and ckpt.comm.broadcast(newest != step):
                newer, failed = self._restore(tier, state, step, coordinator, ask_for_save, newer=True)
                if newer is not None:
                    step, source = newer, "snapshot"
                elif failed is not None:
                    step = self._durable(state, ckpt, failed)
        if tier is not None:
            tier.forget_after(step)
        if source == "durable" or step is None:  # (a rank that kept the step: the snapshot's, resharded for others)
            self.resharded = None
        return step, source if step is not None else None

    def _restore(
        self,
        tier: SnapshotTier | None,
        state: MutableMapping[str, Any],
        durable: int | None,
        coordinator: bool,
        ask_for_save: Callable[[str], None],
        *,
        newer: bool = False,
        own: HeldHere | None = None,
    ) -> tuple[int | None, SnapshotLoadError | None]:
        """(the step of the newest whole snapshot as new as the durable step `durable` (rank 0's word) at
        least, or with `newer` newer than it, loaded, or None; why one did not load whole, in which case
        the state may be overwritten in part). `own`: as `SnapshotTier.restore`."""
        if tier is None:
            return None, None
        try:
            plan = tier.restore(state, durable + 1 if newer and durable is not None else durable, own)
        except SnapshotLoadError as exc:  # on every rank
            log.error("%s; loading the durable checkpoint over it", exc)
            return None, exc
        if plan is None:
            return None, None
        if plan.world_size != tier.world_size:
            self.resharded = (plan.world_size, tier.world_size)
        if coordinator:
            mine = " (this rank from its own memory)" if own is not None and own.step == plan.step else ""
            how = f", resharded {plan.world_size} -> {tier.world_size}" if self.resharded else ""
            log.info("resumed from the snapshot of step %d in the nodes' memory%s (durable: %s)%s", plan.step, mine,
                     durable, how)  # fmt: skip
            if durable is None or plan.step > durable:
                ask_for_save("snapshot-resume")
        return plan.step, None

    @staticmethod
    def _durable(state: MutableMapping[str, Any], ckpt: Checkpointer, failed: SnapshotLoadError | None) -> int | None:
        """The newest durable step that loads, loaded; after a snapshot that did not load whole (`failed`),
        there must be one."""
        step = ckpt.resume(state)
        if step is None and failed is not None:
            raise CheckpointError(f"{failed}, and there is no durable checkpoint to load over it") from None
        return step

    @staticmethod
    def _newest_durable(ckpt: Checkpointer, coordinator: bool) -> int | None:
        """Rank 0's newest committed step (the others: None); a step no snapshot reaches when the
        committed steps cannot be listed."""
        if not coordinator:
            return None
        try:
            return ckpt.newest_committed()
        except Exception as exc:  # noqa: BLE001 - the durable path says so again, and decides
            log.warning("the committed steps cannot be listed (%s: %s): no snapshot is loaded without "
                        "knowing they are older", type(exc).__name__, exc)  # fmt: skip
            return _UNKNOWN_STEP

    def close(self, *, wait: bool) -> None:
        """Stop the tier (with `wait`, after its snapshot in flight); a later start makes a new one."""
        tier, self.tier = self.tier, None
        self._closed += 1
        if tier is None:
            return
        try:
            tier.close(wait=wait)
        except Exception:  # noqa: BLE001 - logged by the tier; the snapshot before it stays
            log.exception("the last snapshot failed")
