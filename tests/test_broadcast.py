"""The store broadcast: every rank's listener gets every event, in order, with no slot taken and left
empty; an idle listener makes no store request at all and wakes at once; a rank leaving its Guard
stops every listener; HashStore and FileStore work as TCPStore does."""

import json
import logging
import queue
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from cloud_adapters.notice import INTERRUPTION, Notice, deadline_after, utc_now
from spotguard.job.broadcast import Broadcast
from spotguard.job.kvstore import Connection
from tests.counting import Counts, counting_store
from tests.servers import free_port

WORLD = 2


def tcp_store():
    return dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30))


def file_store(tmp_path):
    return dist.FileStore(str(tmp_path / "store"), 1)


def notice(n=0, node="vm-1"):
    now = utc_now()
    return Notice("aws", INTERRUPTION, "terminate", deadline_after(120, now), now, "test", f"n{n}", node=node)


class Ranks:
    """One Broadcast per rank, all in this process, each listening on its own connection."""

    def __init__(self, store, prefix="run/", world=WORLD):
        self.got = [queue.Queue() for _ in range(world)]
        self.broadcasts = [
            Broadcast(store, prefix, lambda i, e, q=self.got[rank]: q.put((i, e)), rank=rank) for rank in range(world)
        ]

    def __enter__(self):
        for b in self.broadcasts:
            b.start()
        return self

    def __exit__(self, *exc):
        for b in self.broadcasts:
            b.stop()

    def next_events(self, n, timeout_s=10):
        return [[q.get(timeout=timeout_s) for _ in range(n)] for q in self.got]


def test_every_rank_gets_every_event_in_order_and_one_claim_wins():
    with Ranks(tcp_store()) as ranks:
        assert ranks.broadcasts[1].publish_interruption(notice(1))
        assert not ranks.broadcasts[0].publish_interruption(notice(0))  # claimed already: harmless
        ranks.broadcasts[0].request_checkpoint("interval")
        for events in ranks.next_events(2):
            assert [(i, e["type"]) for i, e in events] == [(1, "emergency"), (2, "checkpoint")]
            assert events[0][1]["notice"]["key"].endswith("n1")
    assert not any(b._thread.is_alive() for b in ranks.broadcasts)  # stop() woke and joined them


def test_an_idle_listener_makes_no_store_request_and_wakes_at_once():
    counts = Counts()
    with Ranks(counting_store(tcp_store(), counts)) as ranks:
        time.sleep(0.3)
        waiting = counts.snapshot()
        assert waiting == {"get": WORLD}  # each listener is blocked in one get on its own connection
        time.sleep(1.5)
        assert counts.snapshot() == waiting  # no polling, no ticks while nothing happens
        published = time.monotonic()
        ranks.broadcasts[0].request_checkpoint("manual")
        ranks.next_events(1)
        assert time.monotonic() - published < 5  # a hang bound; delivery is immediate


def test_an_event_published_before_a_listener_starts_is_delivered():
    ranks = Ranks(tcp_store())
    ranks.broadcasts[0].request_checkpoint("early")
    with ranks:
        for events in ranks.next_events(1):
            assert events[0][1]["reason"] == "early"


@pytest.mark.parametrize("make_store", [file_store, lambda _: dist.HashStore()], ids=["FileStore", "HashStore"])
def test_stores_without_a_server_work_the_same(make_store, tmp_path):
    """A FileStore's waits poll its file inside torch (there is no server to block on); a HashStore
    blocks in-process. Either way the listener blocks in one call and the events arrive in order."""
    with Ranks(make_store(tmp_path)) as ranks:
        ranks.broadcasts[1].publish_interruption(notice())
        ranks.broadcasts[0].request_checkpoint("interval")
        for events in ranks.next_events(2):
            assert [e["type"] for _, e in events] == ["emergency", "checkpoint"]
    assert not any(b._thread.is_alive() for b in ranks.broadcasts)


def test_concurrent_publishers_fill_consecutive_slots_and_every_listener_reads_them_in_one_order():
    """Publishers race for slots with compare_set: each event is written by the request that takes its
    slot, so there is never a slot taken and left empty (which would stall every listener)."""
    store = tcp_store()
    world, per_publisher = 4, 10
    with Ranks(store, world=world) as ranks:
        threads = [
            threading.Thread(target=lambda b=b: [b.request_checkpoint(f"r{b.rank}-{i}") for i in range(per_publisher)])
            for b in ranks.broadcasts
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seen = ranks.next_events(world * per_publisher)
        assert [i for i, _ in seen[0]] == list(range(1, world * per_publisher + 1))
        orders = [[e["reason"] for _, e in events] for events in seen]
        assert all(order == orders[0] for order in orders)
        assert sorted(orders[0]) == sorted(f"r{r}-{i}" for r in range(world) for i in range(per_publisher))


def test_a_rank_leaving_stops_every_listener(caplog):
    """No agreement can complete without a rank that left its Guard; its `left` event also wakes the
    listeners, which would otherwise block until the store's timeout."""
    store = tcp_store()
    with caplog.at_level(logging.INFO, logger="spotguard.job.broadcast"):
        ranks = Ranks(store).__enter__()
        ranks.broadcasts[0].stop()
        ranks.broadcasts[1]._thread.join(10)
    assert not ranks.broadcasts[1]._thread.is_alive()
    assert "rank 0 left its guard" in caplog.text
    ranks.broadcasts[1].stop()  # nothing left to wake: no second left event
    assert json.loads(store.get("run/event/1"))["type"] == "left" and not store.check(["run/event/2"])


def test_publishing_starts_past_the_slots_already_removed():
    """The agreement removes the slots every rank has read; a slot taken again behind the listeners
    would be an event nobody reads. A publisher searches from its own listener's next slot."""
    store = tcp_store()
    with Ranks(store) as ranks:
        ranks.broadcasts[0].request_checkpoint("one")
        ranks.broadcasts[1].request_checkpoint("two")
        ranks.next_events(2)
        store.delete_key("run/event/1")
        store.delete_key("run/event/2")
        assert ranks.broadcasts[1].request_checkpoint("three") == 3
        for events in ranks.next_events(1):
            assert events[0][0] == 3 and events[0][1]["reason"] == "three"


@pytest.mark.parametrize("make_store", [tcp_store, dist.HashStore], ids=["TCPStore", "HashStore"])
def test_only_the_listener_s_own_connection_waits_long(make_store):
    store = make_store()
    store.set_timeout(timedelta(seconds=30))
    connection = Connection.of(store)
    assert connection.own == isinstance(store, dist.TCPStore)  # a HashStore's clone is itself
    assert connection.get("absent", timeout_s=0.2) is None
    assert store.timeout == timedelta(seconds=30)  # the job's store keeps its timeout
    store.set("present", "yes")
    assert connection.get("present", timeout_s=5) == b"yes"
    assert connection.get_now("absent") is None and connection.get_now("present") == b"yes"


def test_a_wait_on_the_job_s_store_client_does_not_hold_a_notice_up():
    """A c10d store client serves one request at a time, and the job's client is torch's and the training
    code's too (a process group made while a peer is late waits on it). A notice published meanwhile
    reaches every listener at once, not when that wait ends (it once came 9 s late, at the run's end)."""
    store = tcp_store()
    waiting = threading.Thread(target=lambda: _wait_quietly(store, "a-peer-that-is-late", 20), daemon=True)
    with Ranks(store) as ranks:
        waiting.start()
        time.sleep(0.3)  # the job's client is inside the wait
        started = time.monotonic()
        assert ranks.broadcasts[1].publish_interruption(notice())
        for ((index, event),) in ranks.next_events(1, timeout_s=5):
            assert index == 1 and event["type"] == "emergency"
        assert time.monotonic() - started < 3
        assert ranks.broadcasts[0].request_checkpoint("interval") == 2
        assert ranks.broadcasts[0].publish_silent_failure({"cause": "hang"}) == 3  # a hung loop may be the waiter
        store.clone().set("a-peer-that-is-late", "1")  # the wait ends (not through its busy client)
    waiting.join(10)


def test_the_publishing_connection_is_made_at_the_start_not_at_the_first_notice():
    """A new store connection can take seconds (c10d looks up the peer's name for each one, and a resolver
    that drops the query costs its 5 s timeout): made when the guard starts, it never delays a notice."""
    store = counting_store(tcp_store(), Counts())
    made_by = type(store).clone

    def slow_clone(self):
        time.sleep(2.0)
        return made_by(self)

    type(store).clone = slow_clone  # only this store's class: counting_store makes one per store
    publisher = Broadcast(store, "run/", lambda *_: None, rank=0)
    started = time.monotonic()
    assert publisher.publish_interruption(notice())
    assert time.monotonic() - started < 1.0


def test_a_lazy_connection_that_cannot_be_made_is_an_error_tried_again_not_the_job_s_client():
    """A lazy connection (the meeting place of an emergency's ranks, a snapshot's background reports) whose
    clone the server does not take raises, and is tried again at its next use, instead of settling on the
    job's shared client for good."""
    import subprocess
    import sys

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", STORE_SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        job_store = dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=2))
        lazy = Connection.of(job_store, lazy=True)
    finally:
        server.kill()
        server.wait()
    for _ in range(2):
        with pytest.raises(dist.DistError):
            lazy.store.set("k", "v")
        assert lazy._store is None


def _wait_quietly(store, key, seconds):
    try:
        store.wait([key], timedelta(seconds=seconds))
    except Exception:  # noqa: BLE001 - the test ends it by setting the key; a timeout is as good
        pass


STORE_SERVER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)
print("ready", flush=True)
time.sleep(600)
"""


def test_a_frozen_store_never_holds_the_publisher_for_long():
    """The store's host freezes (SIGSTOP): c10d requests have no timeout of their own, so a publish
    fails after `publish_timeout_s` (the watcher retries at its next poll), and the next publish fails
    at once while the first is still unanswered, instead of piling up threads."""
    import os
    import signal
    import subprocess
    import sys

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", STORE_SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        job_store = dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(minutes=30))
        publisher = Broadcast(job_store, "run/", lambda *_: None, rank=0, publish_timeout_s=2.0)
        os.kill(server.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="did not answer within 2 s"):
            publisher.publish_interruption(notice())
        assert time.monotonic() - started < 4
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="still not answered"):
            publisher.request_checkpoint("interval")
        assert time.monotonic() - started < 1
    finally:
        os.kill(server.pid, signal.SIGKILL)
        server.wait()


def test_a_slow_store_s_publish_is_a_warning_with_the_time_it_took(caplog):
    """The store's host stalls for 1.5 s (SIGSTOP, then SIGCONT): the notice goes out when it wakes, and
    the log says how long it took, as a warning (every rank's save waited for it)."""
    import os
    import signal
    import subprocess
    import sys

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", STORE_SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        job_store = dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=30))
        publisher = Broadcast(job_store, "run/", lambda *_: None, rank=0)
        publisher.request_checkpoint("warm")  # a first request, before the stall
        os.kill(server.pid, signal.SIGSTOP)
        threading.Timer(1.5, os.kill, args=(server.pid, signal.SIGCONT)).start()
        with caplog.at_level(logging.INFO, logger="spotguard.job.broadcast"):
            assert publisher.publish_interruption(notice())
        (record,) = [r for r in caplog.records if "interruption notice of node" in r.getMessage()]
        took = float(record.getMessage().rsplit(" in ", 1)[1].removesuffix(" s"))
        assert record.levelno == logging.WARNING and 1.3 <= took < 5, record.getMessage()
    finally:
        os.kill(server.pid, signal.SIGKILL)
        server.wait()
