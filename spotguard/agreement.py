"""Every rank decides to save at the same step, or none does (invariant 1).

The protocol of JAX's preemption sync manager and TF's PreemptionCheckpointHandler,
run on the listener threads so the training hot path stays a lock and a comparison:

1. On an event, each rank freezes its step counter (holds the lock the hot path
   takes) and publishes the last step it has finished, and its node.
2. It waits, with a timeout, until every rank has published.
3. It proposes `max(steps) + 1` if all arrived, else "abort", with `compare_set`
   on one decision key: the first proposal wins and every rank reads that one.
   For an interruption the proposal also names the leaving ranks: every rank of a
   node that has announced an interruption by then (`leaving_nodes`).
4. It releases the lock. The hot path fires when it reaches the decided step.

Since nobody's counter moves while the steps are gathered, the decided step lies
ahead of every rank, so every rank reaches it. A dead rank makes the others give up
cleanly after the timeout (they all read "abort"), never hang.
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

log = logging.getLogger(__name__)

ABORT = "abort"
DECIDE_GRACE_S = 5.0  # how long past the round's timeout a rank keeps trying to read the decision


@dataclasses.dataclass(frozen=True)
class Decision:
    round: int
    step: int
    event: dict[str, Any]
    leaving: tuple[int, ...] = ()  # ranks whose node is being reclaimed (interruptions only)


class StepAgreement:
    def __init__(
        self,
        store: dist.Store,
        prefix: str,
        rank: int,
        world_size: int,
        *,
        node: str = "local",
        last_step: int = -1,
        poll_s: float = 0.002,
    ) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.world_size = world_size
        self.node = node
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._last_step = last_step
        self._pending: list[Decision] = []
        self._finished_rounds: list[str] = []  # key prefixes of this rank's rounds not yet cleaned up

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
        leaving_nodes: Callable[[set[str]], set[str]] | None = None,
    ) -> Decision | None:
        """Run one round; returns the decision, or None when the round was aborted.

        `leaving_nodes(nodes)`, for an interruption, tells which of the job's nodes are being reclaimed.
        """
        decision, done_with = self._round(round_id, event, timeout_s, leaving_nodes)
        self._remove_keys(done_with)  # after the round: the training thread never waits on this
        return decision

    def _round(
        self,
        round_id: int,
        event: dict[str, Any],
        timeout_s: float,
        leaving_nodes: Callable[[set[str]], set[str]] | None,
    ) -> tuple[Decision | None, list[str]]:
        """The round, holding the step counter; also the key prefixes of rounds no rank reads any more."""
        base = f"{self.prefix}agree/{round_id}/"
        with self._lock:  # freezes this rank's step counter for the whole round
            started = time.monotonic()
            deadline = started + timeout_s
            keys = [f"{base}step/{r}" for r in range(self.world_size)]
            try:
                self.store.set(keys[self.rank], json.dumps([self._last_step, self.node]))
                complete = self._wait_for(keys, deadline)
                proposal = self._propose(keys, leaving_nodes) if complete else ABORT
            except Exception as exc:  # noqa: BLE001 - a rank that cannot read the store cannot vouch for a step
                log.warning("round %d: store error while gathering steps (%s); proposing to abort", round_id, exc)
                proposal = ABORT
            decided = self._decide(f"{base}decision", proposal, deadline + DECIDE_GRACE_S)
            elapsed_ms = (time.monotonic() - started) * 1000
            if decided in (ABORT, None):
                self._finished_rounds.append(base)
                done_with: list[str] = []
            else:  # every rank published in this round, so every rank has left the earlier ones
                done_with, self._finished_rounds = self._finished_rounds, [base]
            if decided in (ABORT, None):
                log.error(
                    "round %d: %s; no save in this round, resume will use the last committed checkpoint",
                    round_id,
                    f"not every rank answered within {timeout_s:.1f} s (a rank is gone?)"
                    if decided == ABORT
                    else "the store cannot be reached to learn the decision",
                )
                return None, done_with
            decided = json.loads(decided)
            decision = Decision(round_id, int(decided["step"]), event, tuple(decided["leaving"]))
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
            return decision, done_with

    def _propose(self, keys: list[str], leaving_nodes: Callable[[set[str]], set[str]] | None) -> str:
        answers = [json.loads(self.store.get(k)) for k in keys]
        nodes = [node for _, node in answers]
        gone = leaving_nodes(set(nodes)) if leaving_nodes else set()
        step = max(last for last, _ in answers) + 1
        return json.dumps({"step": step, "leaving": [r for r, node in enumerate(nodes) if node in gone]})

    def _decide(self, key: str, proposal: str, deadline: float) -> str | None:
        """Propose; the first proposal wins and is returned. Store errors are retried until `deadline`."""
        while True:
            try:
                return self.store.compare_set(key, "", proposal).decode()
            except Exception as exc:  # noqa: BLE001 - retried below, then reported as unknown
                if time.monotonic() >= deadline:
                    log.warning("cannot reach the store to decide (%s)", exc)
                    return None
                time.sleep(0.1)

    def _remove_keys(self, rounds: list[str]) -> None:
        """Remove this rank's step key of `rounds` (rank 0: also their decisions), rounds that no rank
        reads any more, so that a long run keeps only the last rounds' keys in the store. The current
        round's keys stay: a slow rank may still be reading them."""
        try:
            for base in rounds:
                self.store.delete_key(f"{base}step/{self.rank}")
                if self.rank == 0:
                    self.store.delete_key(f"{base}decision")
        except Exception as exc:  # noqa: BLE001 - a leftover key costs a few bytes, not a round
            log.debug("could not clean up earlier rounds' keys: %s", exc)

    def _wait_for(self, keys: list[str], deadline: float) -> bool:
        # Polls check() rather than blocking in wait(): a timed-out wait() logs socket
        # errors in torch, and check() is a cheap round trip.
        while True:
            if self.store.check(keys):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(self.poll_s)
