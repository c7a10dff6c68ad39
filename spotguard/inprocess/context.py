"""What a training function run by `spotguard.run` is given: its guard's loop calls, where the job
stands (generation, rank, world size), and the recoveries that kept this process."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Mapping, MutableMapping
from typing import Any

from spotguard.guard import Guard
from spotguard.inprocess.generation import Generation
from spotguard.wiring.kept import Kept, keep

log = logging.getLogger("spotguard.inprocess")


@dataclasses.dataclass(frozen=True)
class Recovery:
    """One in-process recovery, as this rank saw it."""

    cause: str  # "interruption": a node announced its departure; "peer-lost": a node went silent; "join": nodes joined
    generation: int  # the generation it formed
    world_before: int
    world_after: int
    step: int | None  # the step the job goes on from: the agreed one, or (a loss) the one resumed
    left: tuple[int, ...]  # the previous generation's ranks that left
    formed_s: float  # this process's last step -> the new generation's group formed
    paused_s: float | None = None  # this process's last step -> its first step at the new size (done)
    resumed_s: float | None = None  # ... -> its state loaded at the new size: training again
    # where the state came from: "memory" (this process's own tensors), "snapshot" (the nodes') or "durable"
    source: str | None = None
    joined: tuple[int, ...] = ()  # the new generation's ranks that joined

    def line(self) -> str:
        source = {
            "memory": "this process's own memory",
            "snapshot": "the snapshot in the nodes' memory",
            "durable": "the durable checkpoint",
        }.get(self.source or "", "nowhere (the function did not resume)")
        paused, resumed = (f"{s:.2f} s" if s is not None else "?" for s in (self.paused_s, self.resumed_s))
        how = {"interruption": "left after a notice", "join": "joined"}.get(self.cause, "lost without a notice")
        ranks = self.joined if self.cause == "join" else self.left
        what = f"rank(s) {', '.join(map(str, ranks))} {how}" if ranks else "the joining node(s) never came"
        return (
            f"in-process recovery: generation {self.generation}, world {self.world_before} -> {self.world_after}, "
            f"{what}: this process (pid {os.getpid()}) paused {paused} (group formed after {self.formed_s:.2f} s, "
            f"training again after {resumed}), going on from step {self.step} with the state from {source}"
        )


class Context:
    """The guard of one generation, and the loop's calls on it (the same names as the Guard's):

    def train(ctx):
        model, optimizer = build()                   # everything bound to a process group, made here
        state = {"model": model, "optim": optimizer}
        start = ctx.resume(state)
        for step in range(start, total_steps):
            train_step()
            if ctx.step(step, state):
                break
    """

    def __init__(
        self,
        guard: Guard,
        generation: Generation,
        recoveries: tuple[Recovery, ...] = (),
        since: float | None = None,
        kept: Kept | None = None,
    ) -> None:
        """`since`: when the step that ended the previous generation's run was reported (monotonic); `kept`:
        what this rank kept of its state then (after a recovery, on every rank: `Kept()` for nothing)."""
        self.guard = guard
        self.generation = generation.number
        self.rank = generation.rank
        self.world_size = generation.world_size
        self.recoveries = recoveries  # every in-process recovery of this process so far, the newest last
        self.last_step_at: float | None = None  # when the loop last reported a step (monotonic)
        self._since = since if recoveries else None  # the newest recovery's pause ends at the first step
        self._kept = kept if recoveries else None
        self.kept = Kept()  # what this rank keeps for the next generation (after a departure, or as nodes join)

    @property
    def recovered(self) -> Recovery | None:
        """The recovery this run of the training function follows, or None for the first run."""
        return self.recoveries[-1] if self.recoveries else None

    def resume(self, state: MutableMapping[str, Any]) -> int:
        """Load the newest state into `state` (after a recovery: the agreed step, or after a loss the newest whole
        snapshot, from the nodes' memory when snapshots are on); the step to start from. As `Guard.resume`."""
        kept, self._kept = self._kept, None  # loaded once: its tensors are the new state's or are freed
        next_step = self.guard.resume(state, kept=kept)
        if self._since is not None:
            took = time.monotonic() - self._since
            self._amend(source=self.guard.resumed_from, step=next_step - 1 if next_step else None, resumed_s=took)
        return next_step

    def step(self, step: int, state: Mapping[str, Any]) -> bool:
        """As `Guard.step`: True once the job stops at this step; return from the training function then
        (spotguard runs it again, in this process, when the job goes on without a departed or lost node, or
        with nodes that join)."""
        called = time.monotonic()
        if self._since is not None:
            self._amend(paused_s=called - self._since)
            self._since = None
            self._report(self.recoveries[-1])
        self.last_step_at = called
        stop = self.guard.step(step, state)
        joins = bool(self.guard.joining) and not self.guard.goes_on  # every rank stays, the joining ones after them
        if stop and (joins or (self.guard.interrupted and self.rank in self.guard.goes_on)):
            saved = self.guard.last_save  # the agreed step's: the next generation may load it from here
            durable = saved is not None and saved.step == step and saved.durable
            self.kept = keep(step, state, None if joins else self.guard.goes_on, durable=durable)
        return stop

    def _amend(self, **changes: Any) -> None:
        self.recoveries = (*self.recoveries[:-1], dataclasses.replace(self.recoveries[-1], **changes))

    def _report(self, recovery: Recovery) -> None:
        log.warning("%s", recovery.line())
        detail = {k: v for k, v in dataclasses.asdict(recovery).items() if k not in ("left", "joined")}
        ranks = {k: ",".join(map(str, getattr(recovery, k))) for k in ("left", "joined") if getattr(recovery, k)}
        self.guard.timeline.add("recovered", **detail, **ranks)
        self.guard.record_recovery(**detail)

    # ---- the guard's other calls, for the training function's convenience -------------------------
    def save(self, step: int, state: Mapping[str, Any]) -> Any:
        return self.guard.save(step, state)

    def heartbeat(self) -> None:
        self.guard.heartbeat()

    def long_phase(self, seconds: float, what: str = "a long phase") -> contextlib.AbstractContextManager[None]:
        return self.guard.long_phase(seconds, what)
