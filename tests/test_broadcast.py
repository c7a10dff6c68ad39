"""The store broadcast: every rank's listener gets every event, in order; an idle listener
blocks on its inbox instead of polling; stores without queues fall back to polling."""

import json
import queue
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from cloud_adapters.notice import INTERRUPTION, Notice, deadline_after, utc_now
from spotguard.broadcast import Broadcast, inbox_connection, listener_store
from tests.servers import free_port

WORLD = 2


def tcp_store():
    return dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30))


def file_store(tmp_path):
    return dist.FileStore(str(tmp_path / "store"), 1)


def notice(n=0):
    now = utc_now()
    return Notice("aws", INTERRUPTION, "terminate", deadline_after(120, now), now, "test", f"n{n}")


class Ranks:
    """One Broadcast per rank, all in this process, each listening on its own store connection."""

    def __init__(self, store, prefix="run/", poll_s=0.05, tick_s=5.0):
        self.got = [queue.Queue() for _ in range(WORLD)]
        self.broadcasts = [
            Broadcast(
                store,
                listener_store(store),
                prefix,
                lambda i, e, q=self.got[rank]: q.put((i, e)),
                inbox=inbox_connection(store),
                rank=rank,
                world_size=WORLD,
                poll_s=poll_s,
                tick_s=tick_s,
            )
            for rank in range(WORLD)
        ]
        self.count_calls = [0] * WORLD
        for rank, b in enumerate(self.broadcasts):  # count the listener's reads of the log
            b._listen_log.count = lambda log=b._listen_log, r=rank: (self._counted(r), type(log).count(log))[1]

    def _counted(self, rank):
        self.count_calls[rank] += 1

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


def test_an_idle_listener_blocks_on_its_inbox_and_wakes_at_once():
    with Ranks(tcp_store()) as ranks:
        assert all(b.uses_inbox for b in ranks.broadcasts)
        time.sleep(1.0)
        assert ranks.count_calls == [0, 0]  # no polling while nothing happens
        published = time.monotonic()
        ranks.broadcasts[0].request_checkpoint("manual")
        ranks.next_events(1)
        assert time.monotonic() - published < 5  # a hang bound; delivery is immediate
        assert all(c >= 1 for c in ranks.count_calls)
    assert not any(t.is_alive() for b in ranks.broadcasts for t in b._threads)  # stop() woke and joined them


def test_an_event_published_before_a_listener_starts_is_delivered():
    store = tcp_store()
    ranks = Ranks(store)
    ranks.broadcasts[0].request_checkpoint("early")
    with ranks:
        for events in ranks.next_events(1):
            assert events[0][1]["reason"] == "early"


def test_stores_without_queues_are_polled(tmp_path):
    with Ranks(file_store(tmp_path), poll_s=0.02) as ranks:
        assert not any(b.uses_inbox for b in ranks.broadcasts)
        ranks.broadcasts[1].publish_interruption(notice())
        for events in ranks.next_events(1):
            assert events[0][1]["type"] == "emergency"
    assert not any(t.is_alive() for b in ranks.broadcasts for t in b._threads)


def test_an_event_whose_publisher_died_before_ringing_is_found_at_the_next_tick():
    store = tcp_store()
    with Ranks(store, tick_s=0.2) as ranks:
        store.add("run/seq", 1)  # what append() does before it rings the inboxes...
        store.set("run/event/1", json.dumps({"type": "checkpoint", "reason": "orphan"}))  # ...and no ring
        for events in ranks.next_events(1):
            assert events[0] == (1, {"type": "checkpoint", "reason": "orphan"})


@pytest.mark.parametrize("make_store", [tcp_store, dist.HashStore])
def test_only_the_inbox_connection_waits_long(make_store):
    store = make_store()
    store.set_timeout(timedelta(seconds=30))
    listen, inbox = listener_store(store), inbox_connection(store)
    assert store.timeout == listen.timeout == timedelta(seconds=30)  # the agreement keeps real timeouts
    assert inbox.timeout == (timedelta(hours=24) if isinstance(store, dist.TCPStore) else timedelta(seconds=30))


def test_a_store_without_queues_gets_no_inbox_and_keeps_working(tmp_path):
    store = file_store(tmp_path)
    assert inbox_connection(store) is None
    store.set("still", "usable")
    assert store.get("still") == b"usable"


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
        publisher = Broadcast(
            job_store, job_store, "run/", lambda *_: None, inbox=None, rank=0, world_size=1, publish_timeout_s=2.0
        )
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
