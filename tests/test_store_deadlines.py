"""Every store call ends by its deadline, even when an attempt hangs inside the SDK: a blackholed
network, a frozen (SIGSTOP) server. Real servers on 127.0.0.1, a fault-injecting proxy in front."""

from __future__ import annotations

import logging
import os
import time

import pytest

from cloud_adapters.deadline import Deadline
from cloud_adapters.retry import calls_until
from cloud_adapters.storage import Unreachable
from tests.conftest import CLOUD_STORE_KINDS, Backend, start_server
from tests.servers import FaultProxy

MiB = 1 << 20
PART = 5 * MiB
SLACK_S = 1.5  # a deadline is checked every 0.2 s; the rest is this shared 2-core VM


@pytest.fixture
def proxied(cloud_backend: Backend):
    proxy = FaultProxy(cloud_backend.server.url)
    store = cloud_backend.store(endpoint=proxy.url, part_size=PART)
    yield cloud_backend.kind, store, proxy
    proxy.close()


def stalls(caplog) -> list[str]:
    """The stall warnings (the final error says it too)."""
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    return [w for w in warnings if "no progress for" in w]


def test_a_blackholed_upload_gives_up_at_its_deadline_and_says_it_stalled(proxied, tmp_path, caplog):
    _, store, proxy = proxied
    store.retry_deadline_s = 4.0
    proxy.blackhole = True
    big = tmp_path / "big"
    big.write_bytes(os.urandom(2 * PART))
    caplog.set_level(logging.WARNING)
    started = time.monotonic()
    with pytest.raises(Unreachable, match="upload step-0000000001/__0_0.distcp"):
        store.put_file(big, "step-0000000001/__0_0.distcp")
    took = time.monotonic() - started
    assert took < 4.0 + SLACK_S, f"a blackholed upload took {took:.1f} s against a 4 s deadline"
    assert len(stalls(caplog)) == 1, stalls(caplog)  # logged once, naming the transfer
    assert "upload step-0000000001/__0_0.distcp" in stalls(caplog)[0]


@pytest.mark.parametrize("kind", CLOUD_STORE_KINDS)
def test_a_frozen_server_holds_no_call_past_its_deadline(kind, monkeypatch, tmp_path):
    server = start_server(kind)
    try:
        store = Backend(kind, server, monkeypatch, tmp_path).store(retry_deadline_s=2.0)
        store.put_bytes("step-0000000001/spotguard.json", b"{}")
        server.freeze()
        for call in (store.list, lambda: store.get_bytes("step-0000000001/spotguard.json")):
            started = time.monotonic()
            with pytest.raises(Unreachable):
                call()
            took = time.monotonic() - started
            assert took < 2.0 + SLACK_S, f"a call to a frozen {kind} server took {took:.1f} s against 2 s"
    finally:
        server.stop()


def test_calls_until_brings_the_deadline_of_calls_in_its_scope_forward(proxied):
    _, store, proxy = proxied
    assert store.retry_deadline_s == 60.0
    proxy.blackhole = True
    started = time.monotonic()
    with calls_until(Deadline.after(2.0)), pytest.raises(Unreachable):
        store.list()
    assert time.monotonic() - started < 2.0 + SLACK_S
    started = time.monotonic()  # GCS deletes on a pool of threads: the scope holds there too
    with calls_until(Deadline.after(2.0)), pytest.raises(Unreachable):
        store.delete(["step-1/a", "step-1/b"])
    assert time.monotonic() - started < 2.0 + SLACK_S


def test_a_deadline_brought_forward_reaches_the_store_calls_already_running(proxied):
    """An emergency takes the window over from a background save: bringing the save's Deadline forward
    ends the store calls it has in flight (on other threads too), not only the ones it makes next."""
    import threading

    _, store, proxy = proxied
    proxy.blackhole = True
    deadline = Deadline.after(60.0)
    ended: list[float] = []

    def background_save() -> None:
        with calls_until(deadline), pytest.raises(Unreachable):
            store.list()
        ended.append(time.monotonic())

    thread = threading.Thread(target=background_save, daemon=True)
    thread.start()
    time.sleep(1.0)  # the call is in flight, blocked on the blackhole
    taken_over = time.monotonic()
    deadline.bring_forward(taken_over)
    thread.join(20)
    assert ended and ended[0] - taken_over < SLACK_S
    assert store.retry_deadline_s == 60.0  # the store's own limit was never touched


def test_a_slow_upload_that_keeps_moving_outlives_its_deadline(storage_servers, monkeypatch, tmp_path):
    from tests.conftest import backend_for

    backend = backend_for("s3", storage_servers, monkeypatch, tmp_path)
    proxy = FaultProxy(backend.server.url)
    # Per request: 6 parts one at a time, plus the start and the end, take ~8 s, twice the deadline;
    # each request stays well inside it, even on a loaded machine.
    proxy.slow_s = 1.0
    try:
        store = backend.store(endpoint=proxy.url, part_size=PART, max_concurrency=1, retry_deadline_s=4.0)
        big = tmp_path / "big"
        big.write_bytes(os.urandom(6 * PART))
        started = time.monotonic()
        store.put_file(big, "step-0000000001/__0_0.distcp")
        took = time.monotonic() - started
        assert [o.size for o in store.list()] == [6 * PART]
    finally:
        proxy.close()
    assert took > 4.0, f"took {took:.1f} s: too fast to show that progress extends the deadline"


def test_a_call_raced_against_a_deadline_keeps_the_store_deadline_of_its_scope(proxied):
    """The Uploader races single calls (the manifest, an exists) with `within`, on a thread of its own:
    the save's store deadline (`calls_until`) must hold on that thread too, not the store's 60 s."""
    from spotguard.checkpoint.io.transfer import within

    _, store, proxy = proxied
    proxy.blackhole = True
    started = time.monotonic()
    with calls_until(Deadline.after(2.0)), pytest.raises(Unreachable):
        within(store.list, Deadline.after(30.0))
    assert time.monotonic() - started < 2.0 + SLACK_S
