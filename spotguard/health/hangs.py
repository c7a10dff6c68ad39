"""Whether the training loop still steps: `guard.step()` is its heartbeat.

A daemon thread on every rank looks at the count of `guard.step()` calls every few seconds. When it has
not moved for the hang timeout, the loop is stuck: in a collective that one rank never joins, or in
user code (a data loader that never returns) on the rank that holds everyone up. The clock starts at the
first `guard.step()` (a resume, a first step that compiles, are never timed), stops while spotguard
itself holds the loop (a save, a snapshot), and a phase the training code declares long
(`guard.long_phase(seconds)`) is allowed its seconds on top. Before it declares a hang, the watch asks
`job_progress()` whether another rank declared a phase or beat since (the ranks that wait for an
evaluating rank in their next collective are not hung).

`"auto"` learns from the gaps between steps: five times the longest seen, never under 7 minutes (an
evaluation of 5 minutes between two steps must not end a job) and never over 9.5 minutes (NCCL's own
timeout is 10, and the stacks and the exit need a few seconds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

AUTO = "auto"
AUTO_FLOOR_S = 420.0
AUTO_CEILING_S = 570.0
AUTO_GAP_FACTOR = 5.0
MAX_CHECK_S = 5.0  # how late a hang may be seen, at most, past its timeout
JOB_ASK_S = 30.0  # a stalled rank asks the job again at least this often (and every quarter of its timeout)
FRAMEWORK_PHASE_S = 3600.0  # a framework's own work between two steps (its checkpoint, its end): not timed before


@dataclasses.dataclass(frozen=True)
class HangSeen:
    """No step for longer than the timeout (crosses from the hang thread to the guard's)."""

    last_step: int | None  # the step this rank last reported
    stalled_s: float  # since its last sign of progress
    timeout_s: float


class HangWatch:
    """The hang timer of one rank. `beats()` counts the loop's `guard.step()` calls, `last_step()` is the
    step it last reported; `on_hang` is called once, on the watch's thread."""

    def __init__(
        self,
        timeout: float | str,
        *,
        beats: Callable[[], int],
        last_step: Callable[[], int | None],
        on_hang: Callable[[HangSeen], None],
        job_progress: Callable[[], float | None] = lambda: None,
        on_phase_over: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fixed = None if timeout == AUTO else float(timeout)
        self.beats = beats
        self.last_step = last_step
        self.on_hang = on_hang
        self.job_progress = job_progress
        self.on_phase_over = on_phase_over  # a step ended the phase this rank declared (on the watch's thread)
        self.clock = clock
        self.longest_gap_s = 0.0  # between two steps, phases declared long and spotguard's own work left out
        self._seen = 0  # beats at the last look
        self._progress_at = 0.0  # when progress was last seen
        self._excused = False  # the current gap holds spotguard's work or a declared phase: not learned from
        self._busy = 0
        self._allowed_until = 0.0
        self._allowed_after = 0  # the beats when the phase was declared: the next step after them ends it
        self._declared = False  # this rank declared a phase that no step has ended yet
        self._job_said: float | None = None  # until when the job's phases and heartbeats allow, as last asked
        self._job_asked_at = -math.inf
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def timeout_s(self) -> float:
        if self.fixed is not None:
            return self.fixed
        return min(AUTO_CEILING_S, max(AUTO_FLOOR_S, AUTO_GAP_FACTOR * self.longest_gap_s))

    # ---- the training thread ---------------------------------------------------------------------
    def allow(self, seconds: float) -> None:
        """The next `seconds` are a long phase (an evaluation): no hang before they have passed, plus the
        timeout, or before the next step, which ends the phase."""
        with self._lock:
            self._allowed_until = max(self._allowed_until, self.clock() + seconds)
            self._allowed_after = self.beats()
            self._excused = self._declared = True

    def alive(self) -> None:
        """The loop works without a training step (an evaluation batch): the timer starts again. Before the
        first step it arms nothing (a sanity check before training is not the training)."""
        with self._lock:
            if self._seen:
                self._progress_at = self.clock()
                self._excused = True  # a gap with evaluation in it is no step's length

    @contextlib.contextmanager
    def phase(self) -> Iterator[None]:
        """Around a phase declared with `allow`: its end counts as a step, and ends what is left of its allowance."""
        try:
            yield
        finally:
            with self._lock:
                self._allowed_until, self._declared = 0.0, False
                self._progress_at = self.clock()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """spotguard's own work on the training thread (a save, a snapshot): never timed."""
        with self._lock:
            self._busy += 1
            self._excused = True
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
                self._progress_at = self.clock()

    # ---- the watch's thread ----------------------------------------------------------------------
    def check(self) -> HangSeen | None:
        """One look: a HangSeen when the loop has not stepped for the timeout, else None."""
        now = self.clock()
        beats = self.beats()
        with self._lock:
            if beats != self._seen:
                if self._seen and not self._excused:
                    self.longest_gap_s = max(self.longest_gap_s, now - self._progress_at)
                self._seen, self._progress_at, self._excused = beats, now, False
                self._job_asked_at = -math.inf  # what the job said was about the step before
                over = beats > self._allowed_after and self._declared
                if beats > self._allowed_after:  # a step after the phase was declared ends it
                    self._allowed_until, self._declared = 0.0, False
                stalled = None
            elif self._busy:  # spotguard holds the loop: its time is not the loop's
                self._progress_at = now
                return None
            elif not beats:  # not stepping yet: a resume, a first step that compiles
                return None
            else:
                stalled = now - max(self._progress_at, self._allowed_until)
        if stalled is None:  # it stepped
            if over:
                self.on_phase_over()  # outside the lock: it queues a store write
            return None
        timeout = self.timeout_s
        if stalled < timeout:
            return None
        if now - self._job_asked_at >= min(timeout / 4, JOB_ASK_S):  # asked only while stalled, and not each look
            self._job_said, self._job_asked_at = self.job_progress(), now
        if self._job_said is not None and now - self._job_said < timeout:
            with self._lock:
                self._excused = True  # another rank's phase is no step's length to learn from
            return None
        return HangSeen(last_step=self.last_step(), stalled_s=round(now - self._progress_at, 3), timeout_s=timeout)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="spotguard-hang-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _run(self) -> None:
        while not self._stop.wait(min(MAX_CHECK_S, self.timeout_s / 10)):
            seen = self.check()
            if seen is not None:
                self.on_hang(seen)  # first: a log write can block (a full output pipe), the end must not
                log.error(
                    "no training step for %.1f s (hang_timeout_s=%s): the loop is stuck (last step %s)",
                    seen.stalled_s,
                    "auto: %.0f s" % seen.timeout_s if self.fixed is None else f"{seen.timeout_s:g}",
                    seen.last_step,
                )
                return
