"""Signals while no guard watches them, between two generations of an in-process job
(spotguard.inprocess.held_signals), with real signals sent to this process: held under the guards' handlers,
sent to the next guard's, and given back to the process's own when the run ends."""

from __future__ import annotations

import os
import signal

import pytest

from spotguard.inprocess.held_signals import holding

SIG = signal.SIGUSR1  # its default action ends the process: a signal that slipped through fails the run


@pytest.fixture
def own():
    """The process's own handler for SIG, recording what reaches it."""
    got: list[int] = []
    original = signal.signal(SIG, lambda signum, frame: got.append(signum))
    yield got
    signal.signal(SIG, original)


class Guard:
    """A guard's signal handling as `SignalSource` does it: its handler over what it found, given back at close."""

    def __init__(self) -> None:
        self.got: list[int] = []
        self.found = signal.signal(SIG, lambda signum, frame: self.got.append(signum))

    def close(self) -> None:
        signal.signal(SIG, self.found)


def test_signals_between_guards_and_in_a_guard_s_teardown_reach_the_next_guard(own):
    with holding() as held:
        for generation in range(3):  # the holder stays under every guard, whatever the number of generations
            held.hold((SIG,))
            guard = Guard()
            held.resend()
            assert guard.got == ([SIG] if generation else [])  # the one that came after the previous guard closed
            os.kill(os.getpid(), SIG)
            assert guard.got[-1] == SIG
            guard.close()
            os.kill(os.getpid(), SIG)  # no guard now: held, not the default action
            os.kill(os.getpid(), SIG)
            assert held.caught == [SIG, SIG] and own == []
        held.caught.clear()
    assert own == []
    os.kill(os.getpid(), SIG)
    assert own == [SIG]  # the process's own handler is back


def test_a_run_that_returns_passes_what_it_held_to_the_process_s_handler(own):
    with holding() as held:
        held.hold((SIG,))
        os.kill(os.getpid(), SIG)
        assert own == []
    assert own == [SIG]


def test_a_run_that_raises_only_says_what_it_held_and_keeps_a_handler_put_in_since(own):
    with pytest.raises(SystemExit), holding() as held:
        held.hold((SIG,))
        os.kill(os.getpid(), SIG)
        signal.signal(SIG, signal.SIG_IGN)  # a leaving rank's SIGTERM ignored as it exits (`keep_sigterm_away`)
        raise SystemExit(0)
    assert own == [] and signal.getsignal(SIG) == signal.SIG_IGN
