"""The watcher against real emulators: one report per notice, faults logged once and retried,
one failing source never stops the others, stale advisories ignored but never an interruption,
interruption sources back on their interval as soon as a fault ends."""

import collections
import email.utils
import json
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest

from cloud_adapters.aws.emulator import AWSMetadataEmulator
from cloud_adapters.aws.metadata import notice_sources as aws_sources
from cloud_adapters.azure.emulator import AzureMetadataEmulator
from cloud_adapters.azure.metadata import ScheduledEventsSource
from cloud_adapters.gcp.emulator import GCPMetadataEmulator
from cloud_adapters.notice import Notice, utc_now
from cloud_adapters.sources import cloud_sources
from spotguard.watcher import Watcher
from tests.servers import FaultProxy


def closed_port_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def aws():
    with AWSMetadataEmulator() as emu:
        yield emu


def watch(sources, interval_s=0.05, **kw):
    got = queue.Queue()
    return Watcher(sources, got.put, interval_s=interval_s, max_backoff_s=0.2, **kw), got


@pytest.mark.parametrize(
    "emulator_cls,cloud", [(AWSMetadataEmulator, "aws"), (GCPMetadataEmulator, "gcp"), (AzureMetadataEmulator, "azure")]
)
def test_each_cloud_reports_an_interruption_once(emulator_cls, cloud):
    with emulator_cls() as emu:
        watcher, got = watch(cloud_sources(cloud, emu.url), interval_s=0.1)
        with watcher:
            time.sleep(0.3)
            emu.raise_notice()
            notice = got.get(timeout=10)
            assert notice.cloud == cloud and notice.is_interruption
            assert notice.deadline is not None and notice.seconds_left() > 0
            time.sleep(0.6)  # several more polls see the same notice
            assert got.empty()


def test_errors_are_logged_once_retried_and_recovery_logged(aws, caplog):
    caplog.set_level(logging.WARNING, logger="spotguard.watcher")
    aws.set_fault("error", count=6, status=500)
    source = aws_sources(aws.url)[0]  # spot/instance-action only
    watcher, got = watch([source])
    with watcher:
        time.sleep(0.2)
        aws.raise_notice()
        assert got.get(timeout=10).action == "terminate"
    failures = [r for r in caplog.records if "poll failed" in r.getMessage()]
    assert len(failures) == 1, [r.getMessage() for r in failures]
    assert "500" in failures[0].getMessage()
    assert any("recovered after" in r.getMessage() for r in caplog.records)


def test_a_dead_source_never_stops_the_others(aws, caplog):
    caplog.set_level(logging.WARNING, logger="spotguard.watcher")
    dead = aws_sources(closed_port_url())[0]
    alive = aws_sources(aws.url)[0]
    watcher, got = watch([dead, alive])
    with watcher:
        aws.raise_notice()
        assert got.get(timeout=10).source == alive.name
    assert any("poll failed" in r.getMessage() for r in caplog.records)


def test_malformed_answers_are_retried(aws, caplog):
    caplog.set_level(logging.WARNING, logger="spotguard.watcher")
    aws.raise_notice()
    aws.set_fault("malformed", count=4)
    watcher, got = watch(aws_sources(aws.url)[:1])
    with watcher:
        assert got.get(timeout=10).is_interruption
    assert any("poll failed" in r.getMessage() for r in caplog.records)


def test_a_stale_advisory_is_ignored(aws, caplog):
    caplog.set_level(logging.WARNING, logger="spotguard.watcher")
    old = (utc_now() - timedelta(hours=1)).strftime("%d %b %Y %H:%M:%S GMT")
    event = {"NotBefore": old, "Code": "system-reboot", "EventId": "instance-event-1", "State": "active"}
    aws.set_metadata("events/maintenance/scheduled", json.dumps([event]))
    watcher, got = watch(aws_sources(aws.url)[3:])
    with watcher:
        time.sleep(0.5)
    assert got.empty()
    assert sum("stale" in r.getMessage() for r in caplog.records) == 1


def test_an_interruption_is_never_dropped_as_stale():
    with AWSMetadataEmulator(clock_offset_s=-730) as aws:  # the host clock 730 s fast: the notice looks 10 min old
        aws.raise_notice()
        watcher, got = watch(aws_sources(aws.url)[:1])
        with watcher:
            notice = got.get(timeout=10)
        assert notice.is_interruption and notice.seconds_left() > 100


def test_after_a_fault_an_interruption_source_is_back_on_its_interval():
    with AzureMetadataEmulator() as azure:
        got = queue.Queue()
        with Watcher([ScheduledEventsSource(azure.url, timeout_s=0.5)], got.put, interval_s=0.2):  # max_backoff_s=30
            time.sleep(0.5)
            azure.set_fault("error", status=500)
            time.sleep(4)  # long enough for an exponential backoff to reach 3.2 s
            azure.raise_notice()
            azure.set_fault(None)
            cleared = time.monotonic()
            assert got.get(timeout=10).is_interruption
            assert time.monotonic() - cleared < 1.5


def test_a_failing_callback_gets_the_notice_again_at_the_next_poll(aws, caplog):
    caplog.set_level(logging.WARNING, logger="spotguard.watcher")
    calls = []

    def callback(notice):
        calls.append(notice.kind)
        if calls.count(notice.kind) == 1:
            raise RuntimeError("store hiccup while publishing")

    with Watcher(aws_sources(aws.url), callback, interval_s=0.05):
        aws.raise_notice()
        deadline = time.monotonic() + 10
        while calls.count("interruption") < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # more polls: the delivered notice is not delivered again
    assert calls.count("interruption") == 2  # failed once, then delivered once
    assert sum("notice callback failed" in r.getMessage() for r in caplog.records) == 1


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_stop_returns_while_a_gcp_hanging_get_is_open():
    """stop() waits at most its timeout in all, though each source's thread sits in a hanging GET
    (60 s); those threads are daemons, so they never hold up the exit, and each ends once its
    request does: here, when the metadata server goes away."""
    before, proxy = set(threading.enumerate()), None
    try:
        with GCPMetadataEmulator() as emu:
            proxy = FaultProxy(emu.url)  # to see the requests as they arrive
            sources = cloud_sources("gcp", proxy.url)
            watcher, _ = watch(sources)
            watcher.start()
            threads = [t for t in threading.enumerate() if t.name.startswith("spotguard") and t not in before]
            assert len(threads) == len(sources) == 2

            def hanging() -> set[str]:  # the keys whose hanging GET reached the emulator
                seen = [path for _, path, _ in list(proxy.seen)]
                if emu.requests_seen < len(seen):  # one is still on its way through the proxy
                    return set()
                return {path.split("?")[0] for path in seen if "wait_for_change=true" in path}

            wait_until(lambda: len(hanging()) == len(sources))
            started = time.monotonic()
            watcher.stop(timeout_s=1.0)
            assert time.monotonic() - started < 2.0  # its 1 s timeout, and nothing waits on a hanging GET
            assert all(t.daemon for t in threads if t.is_alive())
        for thread in threads:  # the server's end ends their requests, and stopped watchers poll no more
            thread.join(10)
        assert not [t for t in threads if t.is_alive()]
    finally:
        if proxy is not None:  # after the emulator: its requests through the proxy ended with it
            proxy.close()


@pytest.mark.parametrize("interval", [0, -1.0, float("nan"), float("inf")])
def test_interval_must_be_finite_and_positive(interval):
    with pytest.raises(ValueError, match="^interval_s must be a finite number of seconds > 0"):
        Watcher([], print, interval_s=interval)


@pytest.mark.parametrize("setting", ["interval_s", "max_backoff_s"])
def test_a_wait_past_the_bound_is_refused(setting):
    """interval_s=1e10 was accepted and each source's thread then died on its first wait (past
    threading.TIMEOUT_MAX)."""
    with pytest.raises(ValueError, match=rf"^{setting} must be at most 30 days \(2592000 s\), got 10000000000.0$"):
        Watcher([], print, **{setting: 1e10})


def test_advisories_announced_long_ahead_are_polled_less_often(aws):
    polls = collections.Counter()
    sources = aws_sources(aws.url)
    for source in sources:
        source.poll = lambda original=source.poll, path=source.path: (polls.update([path]), original())[1]
    watcher, _ = watch(sources, interval_s=0.02)
    with watcher:
        time.sleep(1.5)
    spot, asg = polls["spot/instance-action"], polls["autoscaling/target-lifecycle-state"]
    rebalance, maintenance = polls["events/recommendations/rebalance"], polls["events/maintenance/scheduled"]
    assert min(spot, asg) >= 2 * rebalance > 0, polls  # rebalance: every 5th interval
    assert 1 <= maintenance <= 3, polls  # scheduled maintenance: every 30th (0.6 s here)


class _Scripted:
    """A source that answers what the test scripts: one notice, its deadline moving."""

    name = "scripted"
    blocking = False

    def __init__(self):
        self.deadline_s = 60.0
        self.t0 = utc_now()

    def poll(self):
        return Notice(
            cloud="aws",
            kind="interruption",
            action="terminate",
            deadline=self.t0 + timedelta(seconds=self.deadline_s),
            detected_at=utc_now(),
            source=self.name,
            key="scripted:one",
        )

    def close(self):
        pass


def test_the_same_notice_again_is_never_a_second_notice_and_only_an_earlier_deadline_updates_it(caplog):
    source = _Scripted()
    updates = queue.Queue()
    watcher, got = watch([source], interval_s=0.05, on_update=updates.put)
    with watcher:
        first = got.get(timeout=10)
        source.deadline_s = 90.0  # later: the first deadline stands, nothing delivered
        time.sleep(0.3)
        source.deadline_s = 59.5  # earlier by less than the clocks' jitter: no update
        time.sleep(0.3)
        assert updates.empty()
        source.deadline_s = 30.0
        updated = updates.get(timeout=10)
        time.sleep(0.3)
    assert got.empty() and updates.empty()  # one notice, one update, however many polls
    assert updated.key == first.key and updated.detected_at == first.detected_at
    assert round((first.deadline - updated.deadline).total_seconds()) == 30
    assert sum("deadline moved earlier" in r.getMessage() for r in caplog.records) == 1


def test_a_maintenance_time_already_past_is_logged_as_due_now(caplog):
    caplog.set_level(logging.WARNING, logger="spotguard.watcher")
    with AzureMetadataEmulator() as azure:
        past = email.utils.format_datetime(utc_now() - timedelta(seconds=31), usegmt=True)
        azure.raise_notice(event_type="Reboot", not_before=past)  # Scheduled, its NotBefore passed
        watcher, got = watch([ScheduledEventsSource(azure.url, timeout_s=2.0)], interval_s=0.1)
        with watcher:
            notice = got.get(timeout=20)
    assert notice.seconds_left() < 0
    line = next(r.getMessage() for r in caplog.records if "notice from" in r.getMessage())
    assert "due now (passed 3" in line and "in -" not in line
