"""Signals that arrive while no guard watches them, between two generations of an in-process job.

A guard handles its signals (SIGTERM: "you are being stopped") while it runs, and gives back the handlers
it found as it closes. Between two generations there is none: a SIGTERM then (systemd stopping the unit, a
second notice for this VM) would end the process at once with the default action, and the other members'
next generation would wait for it in vain. So for the whole of `spotguard.run` a holder is installed under
the guards: each guard's handlers go in over it and give it back, and what it catches meanwhile (in a
guard's teardown too) is sent again once the next generation's guard watches it, a notice there like any
other. As `run` ends, the process's own handlers come back; what was held then goes to them when `run`
returns, and is only said when it raises (the process is ending: a leaving rank's exit 0 is kept).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType

log = logging.getLogger("spotguard.inprocess")


class HeldSignals:
    """A holder of signals, installed by `hold` (in the main thread: elsewhere none can be) until `let_go`."""

    def __init__(self) -> None:
        self.caught: list[int] = []
        self._previous: dict[int, object] = {}

    def hold(self, signals: tuple[signal.Signals, ...]) -> None:
        """Catch `signals` from now on (the first call installs; later ones change nothing)."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._catch)

    def _catch(self, signum: int, frame: FrameType | None) -> None:
        self.caught.append(signum)

    def _taken(self) -> list[int]:
        taken, self.caught = list(dict.fromkeys(self.caught)), []
        return taken

    def resend(self) -> None:
        """Send this process each signal caught (once), for the guard that runs now."""
        for signum in self._taken():
            log.warning("%s came while no guard watched it (between two generations): handled now",
                        signal.Signals(signum).name)  # fmt: skip
            os.kill(os.getpid(), signum)

    def let_go(self, *, resend: bool) -> None:
        """Give the process its own handlers back (not over one put in since: a leaving rank's SIGTERM ignored
        as it exits); with `resend`, send them what was caught, else only say it."""
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._catch:
                signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()
        for signum in self._taken():
            if resend:
                os.kill(os.getpid(), signum)
            else:
                log.info("%s came as in-process recovery ends: not sent again", signal.Signals(signum).name)


@contextlib.contextmanager
def holding() -> Iterator[HeldSignals]:
    """A holder for `spotguard.run`'s whole run: its catch goes to the process's handlers when the run returns."""
    held = HeldSignals()
    try:
        yield held
    except BaseException:
        held.let_go(resend=False)
        raise
    held.let_go(resend=True)
