"""Progress of long transfers (bytes done, rate and percentage, reported at most every few seconds),
and durations as the timeline shows them."""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import TextIO

log = logging.getLogger(__name__)


def seconds(value: float | None) -> str:
    """A duration for a timeline entry: `12.3`, or `n/a` when unknown."""
    return "n/a" if value is None else f"{value:.1f}"


class TransferProgress:
    """A `Progress` callback (bytes moved since the last call) that reports as it goes.

    Reports go to a stream (the CLI: one line rewritten in place on a terminal) or,
    without one, to the log (training jobs). Thread-safe: parallel transfers share it.
    """

    def __init__(self, label: str, total_bytes: int, *, every_s: float = 2.0, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = total_bytes
        self.every_s = every_s
        self.stream = stream
        self.done = 0
        self._started = self._last = time.monotonic()
        self._lock = threading.Lock()

    def __call__(self, delta: int) -> None:
        with self._lock:
            self.done += delta
            now = time.monotonic()
            if now - self._last < self.every_s:
                return
            self._last = now
        self._report(now)

    def finish(self) -> None:
        self._report(time.monotonic(), final=True)

    def line(self, now: float | None = None) -> str:
        elapsed = max((now or time.monotonic()) - self._started, 1e-9)
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        return (
            f"{self.label}: {self.done / 1e6:.1f} / {self.total / 1e6:.1f} MB{pct}, "
            f"{self.done / 1e6 / elapsed:.0f} MB/s"
        )

    def _report(self, now: float, final: bool = False) -> None:
        text = self.line(now)
        if self.stream is None:
            log.info("%s", text)
        elif self.stream.isatty():
            self.stream.write("\r" + text + ("\n" if final else ""))
            self.stream.flush()
        else:
            self.stream.write(text + "\n")
            self.stream.flush()


def cli_progress(label: str, total_bytes: int) -> TransferProgress:
    return TransferProgress(label, total_bytes, every_s=0.5, stream=sys.stderr)
