"""One type for "this work must finish by time T": a `Deadline`.

Everything that races a deadline takes one: the transfers of a save, the handoff, the store
calls (through `cloud_adapters.retry.calls_until`). It is a time.monotonic() moment, or none yet,
and it can only be brought forward, also while work runs against it: an emergency save takes
the window over from a background save in flight, and the calls already running see it.
"""

from __future__ import annotations

import threading
import time


class Deadline:
    """A time.monotonic() moment after which the work is abandoned (None: no limit yet)."""

    def __init__(self, at: float | None = None) -> None:
        self._at = at
        self._lock = threading.Lock()

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds)

    @property
    def at(self) -> float | None:
        return self._at

    def left(self) -> float | None:
        """Seconds until the deadline (negative once passed), or None without one."""
        at = self._at
        return None if at is None else at - time.monotonic()

    def passed(self) -> bool:
        left = self.left()
        return left is not None and left <= 0

    def check_within(self, most_s: float) -> float:
        """How long to wait before looking at the deadline again: `most_s` at most, 0 once passed."""
        left = self.left()
        return most_s if left is None else max(0.0, min(left, most_s))

    def bring_forward(self, at: float) -> None:
        with self._lock:
            self._at = at if self._at is None else min(self._at, at)

    def __repr__(self) -> str:
        left = self.left()
        return "Deadline(none)" if left is None else f"Deadline(in {left:.2f} s)"
