"""Signals that arrive between two generations, when no guard watches them.

A guard handles its signals (SIGTERM: "you are being stopped") while it runs, and gives the process's
handlers back as it closes. Between two generations there is none: a SIGTERM then (systemd stopping the
unit, a second notice for this VM) would end the process at once, with the default action, and the other
members' next generation would wait for it in vain. Held, it is sent again once the next generation's
guard watches it, and is a notice there like any other; a process that ends instead lets it go.

The next guard's handlers go in over the holder's (each guard puts back what it found), so once it has
sent them on, the holder passes any later signal to the handler it found itself.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType

log = logging.getLogger("spotguard.inprocess")


class HeldSignals:
    """`signals` caught from now on (in the main thread: elsewhere none can be), until `resend` or `let_go`."""

    def __init__(self, signals: tuple[signal.Signals, ...]) -> None:
        self.caught: list[int] = []
        self._holding = True
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._catch)

    def _catch(self, signum: int, frame: FrameType | None) -> None:
        if self._holding:
            self.caught.append(signum)
            return
        previous = self._previous[signum]  # after `resend`, reached only through a later guard's hand-back
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _stop(self) -> list[int]:
        """Stop holding: the handlers found given back where none went in over them; each signal caught, once."""
        self._holding = False
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._catch:
                signal.signal(sig, previous)  # type: ignore[arg-type]
        return list(dict.fromkeys(self.caught))

    def resend(self) -> None:
        """Send this process each signal caught (once), for the guard that runs now."""
        for signum in self._stop():
            log.warning("%s came between two generations: handled now", signal.Signals(signum).name)
            os.kill(os.getpid(), signum)

    def let_go(self) -> None:
        """Stop holding: the process ends anyway (a signal caught is only said)."""
        for signum in self._stop():
            log.info("%s came as the process ends in-process recovery: not sent again", signal.Signals(signum).name)
