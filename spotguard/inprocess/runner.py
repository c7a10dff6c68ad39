"""`spotguard.run`: a training function run in one process for as long as the process stays in the job.

    def train(ctx):                       # everything bound to a process group is made in here
        ...
        start = ctx.resume(state)
        for step in range(start, total_steps):
            train_step()
            if ctx.step(step, state):
                break

    spotguard.run(train, "s3://bucket/run-7")

The runner forms the job's process group (generation 0) and runs `train` under a Guard. When a node
announces its departure, every rank agrees on a step and the emergency checkpoint is committed as
always (the leaving ranks hand their shards over); then, instead of every worker exiting for the
launcher to start the job again, the leaving ranks exit 0 and the survivors keep their processes.
When a node goes silent, the survivors leave the collective it holds up (their groups' connections
shut down: the guard's health side) and `train` raises: caught here. Either way their guard closes,
the group of the old generation is dropped, the survivors form the next generation's group among
themselves, and `train` runs again in the same process, its `ctx.resume` loading the agreed step, or
after a loss the newest whole snapshot (from the nodes' memory when snapshots are on). Whatever this
cannot do safely ends as it would without it (`ending/going_on.py`, or the new group cannot be
formed): the exit code, the exit file, the launcher's restart.

A node launched with SPOTGUARD_JOIN=HOST:PORT (the job's store) joins the running job the same way
(`joining.py`): rank 0 has every rank stop at an agreed step and take a snapshot of it, `train`
returns, and the next generation is formed with the joining ranks last; their `ctx.resume` loads the
step from the live peers' memory.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from spotguard.ending.exit_policy import ExitPolicy
from spotguard.guard import Guard
from spotguard.inprocess import join_address, joining
from spotguard.inprocess.context import Context, Recovery
from spotguard.inprocess.generation import Generation, drop, form
from spotguard.inprocess.held_signals import holding
from spotguard.job.topology import ranks_per_node
from spotguard.wiring.kept import Kept

log = logging.getLogger("spotguard.inprocess")
T = TypeVar("T")


def run(
    train: Callable[[Context], T],
    checkpoint_dir: str,
    cloud: str | None = None,
    *,
    backend: str | None = None,
    timeout: timedelta | None = None,
    **options: Any,
) -> T:
    """Run `train(ctx)` under a Guard for `checkpoint_dir` (`cloud` and `options` as the Guard takes them),
    forming the job's process group first (`backend`: gloo, with NCCL for CUDA tensors where CUDA is
    available; `timeout`: its operations', 30 minutes by default), and again in-process after a node's
    departure or loss, and when nodes join. Returns what the last run of `train` returned; on the ranks that
    leave, the process exits (0 when the job goes on without them). Launch it as any torchrun script; with one
    process it runs `train` once. With $SPOTGUARD_JOIN set to the running job's store (HOST:PORT), this
    process's node joins that job instead (`joining.py`; JoinError when it is refused or not taken in)."""
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "spotguard.run forms the job's process group itself (and again after a recovery): call it without "
            "calling torch.distributed.init_process_group() first"
        )
    joining_at = os.environ.get(joining.JOIN_ENV)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not joining_at:
        with Guard(checkpoint_dir, cloud, **options) as guard:
            return train(Context(guard, Generation(0, (0,), 0)))
    backend = backend or ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    recoveries: tuple[Recovery, ...] = ()
    since: float | None = None
    kept = Kept()
    founders = None  # generation 0's world size: rank 0 of the job numbers the nodes that join
    if joining_at:  # a node joining the running job: its store is the job's
        base, generation, answer = joining.knock(joining_at)
        since = time.monotonic()
        form(generation, base, backend, timeout)
        recoveries = (_recovery("join", answer.world_before, generation, None, (), since),)
    else:
        base, rank, world_size = next(dist.rendezvous("env://"))  # the launcher's store, kept for every generation
        generation = Generation(0, tuple(range(world_size)), rank)
        founders = world_size if rank == 0 else None
        form(generation, base, backend, timeout)
    with join_address.advertising(base, founders is not None) as advertised, holding() as held:
        while True:
            guard = Guard(checkpoint_dir, cloud, in_process=True, **options)
            held.hold(guard.options.notices.signals)  # under each guard's handlers: what comes while none runs
            ctx = Context(guard, generation, recoveries, since, kept)
            kept = Kept()  # the context's until its resume: held no longer than that
            result: Any = None  # what a run of `train` that raised returns to a rank that leaves
            try:
                with guard:  # its close ends the process after an emergency, unless the job goes on in it
                    held.resend()  # what came since the last generation's guard began to close: a notice now
                    with _door(guard, base, founders, advertised):
                        result = train(ctx)
            except Exception:
                if not guard.goes_on:
                    raise
                # A node was lost: its collective failed (its sockets shut down), as the guard meant it to.
                log.info("the training function left its step: a node was lost and the job goes on", exc_info=True)
            # A loss concluded as nodes were to join goes first: they are asked for again in the next generation.
            nodes = () if guard.goes_on else guard.joining
            staying = tuple(range(generation.world_size)) if nodes else guard.goes_on
            if generation.rank not in staying:  # the job ended, or goes on without this rank (exit_code=None)
                drop()
                return result
            since = ctx.last_step_at if ctx.last_step_at is not None else time.monotonic()
            kept = ctx.kept  # the survivors' own tensors of the agreed step: all the next generation may need
            step = guard.last_save.step if guard.interrupted and guard.last_save is not None else None
            cause = "join" if nodes else "interruption" if guard.interrupted else "peer-lost"
            left = tuple(r for r in range(generation.world_size) if r not in staying)
            exiting = guard.options.exiting
            fallback = ExitPolicy.on(guard.topology, exiting.exit_code, exiting.lost_exit_code)
            # Nothing of the old generation may outlive it: its wrappers (DDP's reducer, FSDP's mesh) hold its group,
            # and its model and optimizer the memory the next generation's are built in; only the tensors `kept` stay.
            result = guard = ctx = None  # type: ignore[assignment]
            gc.collect()
            try:
                drop()
                following = joining.take_in(base, generation, nodes, founders) if nodes else generation.without(staying)
                following = _formed(following, generation, base, backend, timeout, joined=bool(nodes))
            except Exception as exc:  # noqa: BLE001 - anything that fails here ends as without in-process recovery
                _fall_back(fallback, step, f"{type(exc).__name__}: {exc}", cause)
            recoveries = (*recoveries, _recovery(cause, generation.world_size, following, step, left, since))
            generation = following


def _formed(
    following: Generation, current: Generation, base: dist.Store, backend: str, timeout: timedelta | None, *,
    joined: bool,
) -> Generation:  # fmt: skip
    """`following` formed; when nodes were to join it and one did not come (it died while it waited), the
    generation after it, of `current`'s members alone: the job goes on without the node, which finds itself
    fenced out should it come late."""
    try:
        form(following, base, backend, timeout)
        return following
    except Exception as exc:  # noqa: BLE001 - said, and the job's own members try once more
        if not joined:
            raise
        log.warning("generation %d with the joining node(s) was not formed (%s: %s): going on without them",
                    following.number, type(exc).__name__, exc)  # fmt: skip
    drop()
    again = Generation(following.number + 1, current.members, current.me)
    form(again, base, backend, timeout)
    return again


def _recovery(
    cause: str, world_before: int, following: Generation, step: int | None, left: tuple[int, ...], since: float
) -> Recovery:
    """The recovery that formed `following` (its first ranks after the `world_before` ones of the one before it
    joined, if any), measured from `since` (monotonic)."""
    joined = tuple(range(world_before, following.world_size))
    return Recovery(cause, following.number, world_before, following.world_size, step, left,
                    formed_s=time.monotonic() - since, joined=joined)  # fmt: skip


@contextlib.contextmanager
def _door(
    guard: Guard, base: dist.Store, founders: int | None, advertised: join_address.Advertised | None
) -> Iterator[None]:
    """On rank 0 of the job (`founders` given), while the training function runs: nodes that ask to join are
    asked for at the next step every rank agrees on (`joining.Door`); whether a node booting later finds the job
    (`advertised`) follows what the door would say to a node like the job's own; once the job ends, those still
    waiting are refused, and no node booting later is to find it."""
    if founders is None:
        yield
        return

    def refusal(ranks: int) -> str | None:
        tier = guard.snapshots
        if not guard.options.snapshots.enabled:
            return "the job takes no snapshots (a joining node loads its state from the nodes' memory)"
        if tier is not None and tier.no_room is not None:
            return f"the job's snapshots are off ({tier.no_room}): a joining node loads its state from them"
        if ranks != ranks_per_node():
            return f"it runs {ranks} rank(s); the job's nodes run {ranks_per_node()}"
        return None

    def takes_nodes() -> bool:  # like the job's own: what a node booting later would be
        return refusal(ranks_per_node()) is None

    door = joining.Door(base, guard.admit, refusal).start()
    if advertised is not None:
        advertised.takes = takes_nodes
    try:
        yield
    finally:
        door.close()
        if advertised is not None:  # through the pause as it was at the end (the guard itself goes with its generation)
            taking = takes_nodes()
            advertised.takes = lambda: taking
        if not guard.goes_on and not guard.joining:  # the job ends (here, or as the guard closes)
            if advertised is not None:
                advertised.withdraw()
            try:
                joining.refuse_waiting(base, "the job has ended")
            except Exception as exc:  # noqa: BLE001 - the job's own end comes first; a waiting node times out
                log.warning("the nodes waiting to join were not told that the job ends: %s: %s", type(exc).__name__,
                            exc)  # fmt: skip


def _fall_back(policy: ExitPolicy, step: int | None, why: str, cause: str) -> NoReturn:
    """End as the job would without in-process recovery, with the exit file's record: after a departure the
    checkpoint of `step` is committed, so `exit_code` (the launcher restarts the job from it); after a node
    lost without a notice, or a join (`step` None), `lost_exit_code`: the launcher restarts the job, which
    resumes from the nodes' memory."""
    saved = step is not None and policy.exit_code is not None
    code = policy.exit_code if saved else policy.lost_exit_code
    log.error("in-process recovery failed (%s): ending as without it", why)
    policy.record(code, committed=saved, step=step, leaving=False, cause=cause)  # type: ignore[arg-type]
    policy.exit(code, saved=saved)  # type: ignore[arg-type]
    raise AssertionError("unreachable: exit() raises SystemExit")
