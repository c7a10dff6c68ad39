"""Signals as notices, through real signals sent to real processes."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from cloud_adapters.signals import SignalSource, parse_signal
from cloud_adapters.validation import MAX_SECONDS
from spotguard.watcher import Watcher


def start_watch(*flags):
    proc = subprocess.Popen(
        [sys.executable, "-m", "spotguard.cli", "watch", "--cloud", "none", "--json", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # The handler is installed before "watching" is logged.
    for line in proc.stderr:
        if "watching" in line:
            break
    return proc


@pytest.mark.parametrize("sig,flags", [(signal.SIGTERM, []), (signal.SIGUSR1, ["--signals", "SIGTERM,USR1"])])
def test_a_signal_becomes_one_interruption(sig, flags):
    proc = start_watch("--once", "--grace", "20", *flags)
    sent = time.time()
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    lines = out.splitlines()
    assert len(lines) == 1
    notice = json.loads(lines[0])
    assert notice["cloud"] == "signal" and notice["kind"] == "interruption"
    assert notice["action"] == sig.name
    detected = notice["detected_at"]
    assert detected.endswith("Z") and notice["deadline"].endswith("Z")
    from cloud_adapters.notice import parse_iso8601

    grace = (parse_iso8601(notice["deadline"]) - parse_iso8601(detected)).total_seconds()
    assert abs(grace - 20) < 0.01
    assert abs(parse_iso8601(detected).timestamp() - sent) < 5


def test_a_signal_at_the_longest_grace_still_becomes_an_interruption():
    """--grace 1e12 was accepted and the SIGTERM then lost: its deadline (now + grace) overflowed
    datetime in the watcher's poll, after the signal had been read from the pipe."""
    proc = start_watch("--once", "--grace", str(MAX_SECONDS))
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    notice = json.loads(out)
    assert notice["action"] == "SIGTERM" and notice["detail"]["grace_s"] == MAX_SECONDS


@pytest.mark.parametrize("grace", [1e12, MAX_SECONDS + 1])
def test_a_grace_past_the_bound_is_refused(grace):
    with pytest.raises(ValueError, match=r"^grace_s must be at most 30 days \(2592000 s\), got "):
        SignalSource(grace_s=grace)


def test_a_signal_ends_the_watch_service_after_printing_it():
    proc = start_watch()  # no --once: a service, stopped by systemctl/docker with SIGTERM
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert [json.loads(line)["action"] for line in out.splitlines()] == ["SIGTERM"]


def test_source_in_process_records_only_and_restores_handlers():
    before = signal.getsignal(signal.SIGUSR2)
    source = SignalSource((signal.SIGUSR2,), grace_s=5, wait_s=0.05)
    source.install()
    try:
        assert source.poll() is None
        os.kill(os.getpid(), signal.SIGUSR2)
        notice = source.poll()
        assert notice is not None and notice.action == "SIGUSR2"
        os.kill(os.getpid(), signal.SIGUSR2)
        assert source.poll() == notice  # repeated signals: the same notice, not a new one
    finally:
        source.close()
    assert signal.getsignal(signal.SIGUSR2) == before


def test_a_stopping_watcher_wakes_the_signal_source_without_making_a_notice():
    """The signal source waits for a signal inside poll(): a watcher that stops ends that wait at once (every
    in-process recovery stops one), not after the source's whole wait, and the wake is no interruption."""
    notices = []
    source = SignalSource((signal.SIGUSR2,), grace_s=5, wait_s=60)
    source.install()
    watcher = Watcher([source], notices.append).start()
    time.sleep(0.2)  # inside its poll
    started = time.monotonic()
    watcher.stop(timeout_s=30)
    assert time.monotonic() - started < 10  # a bound for a hang: the wait it ends is 60 s
    assert not any(t.name.startswith("spotguard-watch-signal") for t in threading.enumerate())
    assert notices == []


@pytest.mark.parametrize(
    "text,expected",
    [("SIGTERM", signal.SIGTERM), ("usr1", signal.SIGUSR1), ("15", signal.SIGTERM), (10, signal.SIGUSR1)],
)
def test_parse_signal(text, expected):
    assert parse_signal(text) == expected
