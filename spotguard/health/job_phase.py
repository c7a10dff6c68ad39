"""A long phase declared on one rank, or its heartbeats, are the job's: every rank's hang watch honours them.

The most common evaluation is "rank 0 evaluates, the others wait for it in their next collective": only
rank 0 declares its phase (`guard.long_phase`) or beats (`guard.heartbeat`), yet the others stop stepping
too. So the declaring rank writes to the store until when the job may go without a step (wall clock:
the ranks' monotonic clocks differ) and the step it declared after; a rank about to declare a hang reads
that first. A phase only grows within its step (compare_set: a shorter one declared meanwhile on another
rank never cuts a longer one) and ends, for the job as on the declaring rank, when its `with` block does
or the declaring rank steps on, whichever comes first: a framework's hour-long allowance around its own
save never outlives that save. A rank honours a phase declared at its own last step or the one before
(a rank that waits for the declaring one may have reported one step more: the phase declared before the
loop's `guard.step()`, or an asynchronous backend that blocks a step later), and no older one.

Writes and reads run on a thread of their own, in order: the training thread never waits on the store,
and a read that does not come within READ_WAIT_S (a store that stopped answering) counts as nothing said.
Costs: 2 requests per declaration, heartbeat (at most one per quarter of the hang timeout) or phase end;
2 per look of a rank stalled past its timeout.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from spotguard.job.kvstore import Connection

log = logging.getLogger(__name__)

READ_WAIT_S = 5.0
_STOP = None


@dataclasses.dataclass(frozen=True)
class Said:
    """What a rank told the job: no hang before `until` (wall clock), while no rank is past `step`."""

    until: float
    step: int  # the step it was said after (-1: before any)

    def encode(self) -> str:
        return f"{self.until:.3f} {self.step}"

    @classmethod
    def decode(cls, raw: bytes | None) -> Said | None:
        try:
            until, step = (raw or b"").decode().split(" ")
            return cls(float(until), int(step))
        except ValueError:  # nothing said yet (or not ours): nothing to honour
            return None


class JobPhase:
    """This rank's side of the job's phases, over `connection` (its own store client), keys under `prefix`.
    `last_step()` is the step this rank last reported."""

    def __init__(self, connection: Connection, prefix: str, last_step: Callable[[], int | None]) -> None:
        self._conn = connection
        self._phase, self._alive = prefix + "phase", prefix + "alive"
        self._last_step = last_step
        self._declared: list[str] = []  # the phases this rank declared that have not ended (its thread only)
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="spotguard-job-phase", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._jobs.put(_STOP)

    # ---- the training thread (never waits) -------------------------------------------------------
    def declare(self, seconds: float) -> None:
        mine = Said(time.time() + seconds, self._step())
        self._jobs.put((self._declare, mine))

    def ended(self) -> None:
        """The phases this rank declared are over (as on this rank's own watch): the job goes on from now."""
        self._jobs.put((self._end, Said(time.time(), self._step())))

    def alive(self) -> None:
        self._jobs.put((self._raise, self._alive, Said(time.time(), self._step())))

    # ---- the hang watch's thread -----------------------------------------------------------------
    def latest(self) -> float | None:
        """The latest moment (wall clock) that a phase declared on any rank runs to, or that any rank's loop
        was seen working, at this rank's step; None when nothing such was said (or the store does not answer
        within READ_WAIT_S)."""
        answer: concurrent.futures.Future[list[Said | None]] = concurrent.futures.Future()
        self._jobs.put((self._read, answer))
        try:
            said = answer.result(timeout=READ_WAIT_S)
        except concurrent.futures.TimeoutError:
            return None
        step = self._step()
        current = [s.until for s in said if s is not None and s.step >= step - 1]
        return max(current, default=None)

    # ---- its own thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while (job := self._jobs.get()) is not _STOP:
            call, *args = job
            try:
                call(*args)
            except Exception as exc:  # noqa: BLE001 - this rank's own watch still knows; the others may not
                log.warning("the job's phase could not be told or read (%s: %s)", type(exc).__name__, exc)
                for arg in args:
                    if isinstance(arg, concurrent.futures.Future) and not arg.done():
                        arg.set_result([])

    def _step(self) -> int:
        step = self._last_step()
        return -1 if step is None else step

    def _declare(self, mine: Said) -> None:
        self._declared.append(mine.encode())
        self._raise(self._phase, mine)

    def _raise(self, key: str, mine: Said) -> None:
        """`key` to `mine` unless it already says as much (a later step, or a later end at this one)."""
        current = self._conn.get_now(key)
        for _ in range(8):  # each retry means another rank raised it meanwhile
            held = Said.decode(current)
            if held is not None and (held.step, held.until) >= (mine.step, mine.until):
                return
            expected = "" if current is None else current.decode()
            current = self._conn.store.compare_set(key, expected, mine.encode())
            if current == mine.encode().encode():
                return

    def _end(self, now: Said) -> None:
        if not self._declared:
            return
        current = self._conn.get_now(self._phase)
        if current is not None and current.decode() in self._declared:  # another rank's longer one stays
            self._conn.store.compare_set(self._phase, current.decode(), now.encode())
        self._declared.clear()

    def _read(self, answer: concurrent.futures.Future[list[Said | None]]) -> None:
        answer.set_result([Said.decode(self._conn.get_now(key)) for key in (self._phase, self._alive)])
