"""Termination signals as a notice source (Kubernetes and Slurm send SIGTERM; Slurm's
`--signal` can send SIGUSR1 ahead of the time limit).

The handler only records: it writes one byte to a non-blocking pipe and returns.
`poll()` waits on that pipe from the watcher thread, so no lock, store call or
collective ever runs inside the handler. Python runs handlers on the main thread
between bytecodes, so a main thread inside a long C call (a collective) sees the
signal when that call returns; the metadata notices are the early path.
"""

from __future__ import annotations

import os
import select
import signal
import threading
from types import FrameType

from cloud_adapters import validation as check
from cloud_adapters.notice import INTERRUPTION, Notice, deadline_after, utc_now

DEFAULT_SIGNALS = (signal.SIGTERM,)


UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)
_WAKE = 0  # the byte `wake()` writes to the pipe: no signal has number 0


def parse_signal(name: str | int) -> signal.Signals:
    """`"SIGUSR1"`, `"USR1"`, `"10"` or 10 -> signal.SIGUSR1; ValueError for anything else."""
    if isinstance(name, int) or str(name).isdigit():
        try:
            sig = signal.Signals(int(name))
        except ValueError as exc:
            raise ValueError(f"unknown signal number {name}") from exc
    else:
        text = str(name).upper()
        text = text if text.startswith("SIG") else "SIG" + text
        try:
            sig = signal.Signals[text]
        except KeyError as exc:
            raise ValueError(f"unknown signal {name!r}") from exc
    if sig in UNCATCHABLE:
        raise ValueError(f"{sig.name} cannot be caught, so it cannot announce an interruption")
    return sig


class SignalSource:
    """Turns the first of `signals` into an interruption with deadline = arrival + `grace_s`.

    `install()` must run on the main thread (Python's rule for signal handlers).
    Later signals of the same kind are recorded but do not make a new notice.
    """

    name = "signal"
    blocking = True

    def __init__(
        self, signals: tuple[signal.Signals, ...] = DEFAULT_SIGNALS, grace_s: float = 25.0, wait_s: float = 1.0
    ) -> None:
        self.signals = tuple(signals)
        self.grace_s = check.seconds("grace_s", grace_s)  # a NaN grace would turn a signal into no deadline at all
        self.wait_s = check.seconds("wait_s", wait_s)
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous: dict[signal.Signals, object] = {}
        self._notice: Notice | None = None
        self._lock = threading.Lock()
        self._closed = False

    def install(self) -> None:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        try:
            os.write(self._write_fd, bytes([signum]))
        except (BlockingIOError, OSError):
            pass  # the pipe is full of earlier signals: one is enough

    def poll(self) -> Notice | None:
        # Always wait on the pipe, also once a notice exists, so a blocking poller never spins.
        ready, _, _ = select.select([self._read_fd], [], [], self.wait_s)
        with self._lock:
            if ready:
                signums = [b for b in os.read(self._read_fd, 64) if b != _WAKE]
                if signums and self._notice is None:
                    self._notice = self._make_notice(signal.Signals(signums[0]))
            return self._notice

    def wake(self) -> None:
        """End a `poll()` waiting now (a stopping watcher's), without a signal."""
        with self._lock:
            if self._closed:  # its descriptor's number may belong to another file by now
                return
            try:
                os.write(self._write_fd, bytes([_WAKE]))
            except BlockingIOError:
                pass  # the pipe is full: a poll is due at once

    def _make_notice(self, sig: signal.Signals) -> Notice:
        now = utc_now()
        return Notice(
            cloud="signal",
            kind=INTERRUPTION,
            action=sig.name,
            deadline=deadline_after(self.grace_s, now),
            detected_at=now,
            source=f"signal:{sig.name}",
            key=f"signal:{sig.name}:{now.timestamp():.3f}",
            detail={"signal": int(sig), "grace_s": self.grace_s},
        )

    def close(self) -> None:
        self.uninstall()
        with self._lock:
            self._closed = True
        for fd in (self._read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
