"""Every rank decides to save at the same step, or none does (invariant 1).

The protocol of JAX's preemption sync manager and TF's PreemptionCheckpointHandler, run
on the listener threads so the training hot path stays a lock and a comparison, with a
constant number of store requests per rank (the last one to arrive does a few more):

1. On an event, each rank freezes its step counter (holds the lock the hot path takes),
   appends the last step it has finished and its node to the round's one `steps` key,
   and counts itself in with `add` on the round's `arrived` key.
2. The rank whose `add` answers N (the world size) arrived last. It reads `steps` in one
   request and proposes `max(steps) + 1`; for an interruption the proposal also names the
   leaving ranks, every rank of a node that has claimed an interruption by then.
3. Every other rank blocks on the round's decision key until the round's deadline, and then
   proposes "abort". Proposals are written with `compare_set` on the decision key: the first
   wins, and every rank reads that one.
4. It releases the lock. The hot path fires when it reaches the decided step.

Since nobody's counter moves while the steps are gathered, the decided step lies ahead of
every rank, so every rank reaches it. A dead or frozen rank never arrives, so nobody is
last: the others all read "abort" at the deadline, never hang.

The rank that decided a round also removes the keys no rank reads any more: that round's
steps and counter, and what earlier rounds left. Every rank
tracks the same list (they all see the same outcomes), so whichever rank decides knows it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from spotguard.job.kvstore import Connection

log = logging.getLogger(__name__)

ABORT = "abort"
DECIDE_GRACE_S = 5.0  # how long past the round's timeout a rank keeps trying to reach the store to decide


@dataclasses.dataclass(frozen=True)
class Decision:
    round: int
    step: int
    event: dict[str, Any]
    leaving: tuple[int, ...] = ()  # ranks whose node is being reclaimed (interruptions only)


class StepAgreement:
    """The agreement rounds of one rank. `store` is the connection the listener thread blocks on
    (a plain Store is given a connection of its own)."""

    def __init__(
        self,
        store: dist.Store | Connection,
        prefix: str,
        rank: int,
        world_size: int,
        *,
        node: str = "local",
        last_step: int = -1,
    ) -> None:
        self.conn = store if isinstance(store, Connection) else Connection.of(store)
        self.prefix = prefix
        self.rank = rank
        self.world_size = world_size
        self.node = node
        self._lock = threading.Lock()
        self._last_step = last_step
        self._pending: list[Decision] = []
        self._stale: list[str] = []  # keys of finished rounds no rank reads once the next round is decided

    # ---- hot path (training thread) ---------------------------------------------
    def reached(self, step: int) -> list[Decision]:
        """Record that `step` is finished; return the decisions due at it (usually none)."""
        with self._lock:
            self._last_step = step
            if not self._pending or step < self._pending[0].step:
                return []
            due = [d for d in self._pending if d.step <= step]
            self._pending = [d for d in self._pending if d.step > step]
            return due

    def reset(self, last_step: int) -> None:
        """After a resume: the next step the loop will report is `last_step + 1`."""
        with self._lock:
            self._last_step = last_step

    # ---- listener thread ------------------------------------------------------
    def agree(
        self,
        round_id: int,
        event: dict[str, Any],
        timeout_s: float,
        leaving_nodes: Callable[[], set[str]] | None = None,
    ) -> Decision | None:
        """Run one round; returns the decision, or None when the round was aborted.

        `leaving_nodes()`, for an interruption, tells which nodes are being reclaimed (the last
        rank to arrive asks it).
        """
        base = f"{self.prefix}agree/{round_id}/"
        keys = [base + "steps", base + "arrived"]
        with self._lock:  # freezes this rank's step counter for the whole round
            started = time.monotonic()
            proposal, decided = self._round(base, timeout_s, leaving_nodes)
            elapsed_ms = (time.monotonic() - started) * 1000
            if decided in (ABORT, None):
                self._stale += [*keys, base + "decision"]
                log.error(
                    "round %d: %s; no save in this round, resume will use the last committed checkpoint",
                    round_id,
                    f"not every rank answered within {timeout_s:.1f} s (a rank is gone?)"
                    if decided == ABORT
                    else "the store cannot be reached to learn the decision",
                )
                return None
            removable, self._stale = self._stale + keys, [base + "decision"]
            parsed = json.loads(decided)
            decision = Decision(round_id, int(parsed["step"]), event, tuple(parsed["leaving"]))
            self._pending.append(decision)
            self._pending.sort(key=lambda d: d.step)
        log.info(
            "round %d: all %d ranks agreed on step %d (%s) in %.1f ms%s",
            round_id,
            self.world_size,
            decision.step,
            event.get("type"),
            elapsed_ms,
            f"; leaving: ranks {list(decision.leaving)}" if decision.leaving else "",
        )
        if decided == proposal:  # this rank decided: every rank has left the earlier rounds and read this one
            self._remove(removable)
        return decision

    def _round(
        self, base: str, timeout_s: float, leaving_nodes: Callable[[], set[str]] | None
    ) -> tuple[str | None, str | None]:
        """(this rank's proposal or None, the decision or None when the store cannot tell it)."""
        deadline = time.monotonic() + timeout_s
        store = self.conn.store
        try:
            store.append(base + "steps", json.dumps([self.rank, self._last_step, self.node]) + "\n")
            last = int(store.add(base + "arrived", 1)) == self.world_size
            proposal = self._propose(base + "steps", leaving_nodes) if last else None
        except Exception as exc:  # noqa: BLE001 - a rank that cannot reach the store cannot vouch for a step
            log.warning("store error while gathering steps (%s); proposing to abort", exc)
            proposal = ABORT
        if proposal is None:
            try:
                decided = self.conn.get(base + "decision", deadline - time.monotonic())
            except Exception as exc:  # noqa: BLE001 - retried below, as a proposal to abort
                log.warning("store error while waiting for the decision (%s)", exc)
                decided = None
            if decided is not None:
                return None, decided.decode()
            proposal = ABORT  # the deadline passed: a rank never arrived
        return proposal, self._decide(base + "decision", proposal, deadline + DECIDE_GRACE_S)

    def _propose(self, steps_key: str, leaving_nodes: Callable[[], set[str]] | None) -> str:
        answers = [json.loads(line) for line in self.conn.store.get(steps_key).decode().splitlines()]
        if len({rank for rank, _, _ in answers}) != self.world_size:
            raise RuntimeError(f"{len(answers)} answers from {self.world_size} ranks do not match")
        gone = leaving_nodes() if leaving_nodes else set()
        step = max(last for _, last, _ in answers) + 1
        return json.dumps({"step": step, "leaving": sorted(r for r, _, node in answers if node in gone)})

    def _decide(self, key: str, proposal: str, deadline: float) -> str | None:
        """Propose; the first proposal wins and is returned. Store errors are retried until `deadline`."""
        while True:
            try:
                return self.conn.store.compare_set(key, "", proposal).decode()
            except Exception as exc:  # noqa: BLE001 - retried below, then reported as unknown
                if time.monotonic() >= deadline:
                    log.warning("cannot reach the store to decide (%s)", exc)
                    return None
                time.sleep(0.1)

    def abort(self, store: dist.Store, round_id: int) -> None:
        """Decide round `round_id` "abort" if no rank has decided it yet (any thread, on `store`): the
        ranks waiting in it for a rank that will never arrive leave it now. A round decided already keeps
        its decision."""
        store.compare_set(f"{self.prefix}agree/{round_id}/decision", "", ABORT)

    def _remove(self, keys: list[str]) -> None:
        """Remove keys no rank reads any more, so that a long run keeps only the last round's in the store."""
        try:
            for key in keys:
                self.conn.store.delete_key(key)
        except Exception as exc:  # noqa: BLE001 - a leftover key costs a few bytes, not a round
            log.debug("could not clean up earlier rounds' keys: %s", exc)
