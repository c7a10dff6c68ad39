"""Signals between two generations of an in-process job (spotguard.inprocess.held_signals), with real signals
sent to this process: held while no guard watches them, then sent to the next guard's handler."""

from __future__ import annotations

import os
import signal

import pytest

from spotguard.inprocess.held_signals import HeldSignals

SIG = signal.SIGUSR1  # its default action ends the process: a signal that slipped through fails the run


@pytest.fixture
def before():
    """The process's own handler for SIG (what a guard found and gave back), recording what reaches it."""
    got: list[int] = []
    original = signal.signal(SIG, lambda signum, frame: got.append(signum))
    yield got
    signal.signal(SIG, original)


def test_a_signal_between_generations_is_held_then_reaches_the_next_guard_and_later_ones_the_process(before):
    held = HeldSignals((SIG,))
    os.kill(os.getpid(), SIG)
    os.kill(os.getpid(), SIG)
    assert held.caught == [SIG, SIG] and before == []  # the process's handler saw nothing: no guard watched
    guard: list[int] = []
    found = signal.signal(SIG, lambda signum, frame: guard.append(signum))  # the next guard starts
    held.resend()
    assert guard == [SIG]  # once, for its notice
    signal.signal(SIG, found)  # the guard closes, giving back what it found: the holder, which passes it on
    os.kill(os.getpid(), SIG)
    assert before == [SIG] and guard == [SIG]


def test_a_process_that_ends_lets_a_held_signal_go_and_gets_its_handler_back(before):
    held = HeldSignals((SIG,))
    os.kill(os.getpid(), SIG)
    held.let_go()
    assert before == []
    os.kill(os.getpid(), SIG)
    assert before == [SIG]
    assert signal.getsignal(SIG) is not None and signal.getsignal(SIG) != held._catch
