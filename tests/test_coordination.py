"""Coordination through the job's store with many real Guards in one process (threads around one
TCPStore, a stated topology each): what every rank does, what it costs the store, and how it fails.

Invariant 1 at scale is in test_scale.py (256 ranks over several processes); here: the store traffic
of a round and of an idle guard, two notices close together, a notice racing a requested save, a
rank that never answers, a store that refuses requests mid-round, and the stores without a server."""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from spotguard.job.agreement import DECIDE_GRACE_S, StepAgreement
from spotguard.job.kvstore import Connection
from tests.counting import Counts, counting_store
from tests.threaded_guards import Job, tcp_server


def test_a_round_costs_each_rank_a_few_requests_and_an_idle_guard_none(tmp_path):
    """No rank reads or polls all N keys: a round is O(1) requests per rank (the last to arrive does a
    few more) and O(N) in all; an idle guard blocks in one request and makes no other."""
    world = 32
    with Job(str(tmp_path), world, per_node=4, nodes_watched=(7,)) as job:
        time.sleep(0.5)
        before = [job.requests(r) for r in range(world)]
        time.sleep(1.5)
        assert [job.requests(r) for r in range(world)] == before  # idle: nothing at all
        job.emulators[7].raise_notice(kind="interruption")
        acted = job.wait_acted()
        assert len(set(acted.values())) == 1 and len(acted) == world
        time.sleep(0.3)  # the deciding rank's clean-up
        used = sorted(job.requests(r) - before[r] for r in range(world))
    # listener get (2 on the server) + append + add + decision get (2); the publisher and the rank
    # that decides do a few more; nothing grows with the world size.
    assert used[-3] <= 8, used
    assert used[-1] <= 20, used
    assert sum(used) <= 6 * world + 30, used


def test_two_nodes_reclaimed_together_act_at_one_step_in_one_order(tmp_path):
    """Two notices close together make one round or two well-ordered rounds: every rank sees the same
    rounds in the same order, and every rank stops at the same step, both nodes leaving where one
    round named both."""
    with Job(str(tmp_path), 6, per_node=2, nodes_watched=(0, 1), step_s=0.02) as job:
        time.sleep(0.3)
        threading.Thread(target=job.emulators[0].raise_notice, kwargs={"kind": "interruption"}).start()
        job.emulators[1].raise_notice(kind="interruption")
        acted = job.wait_acted()
        time.sleep(0.5)  # the second round, when there is one, ends too
        rounds = [job.agreed(r) for r in range(6)]
    assert len(acted) == 6 and len(set(acted.values())) == 1, acted
    assert all(r == rounds[0] for r in rounds) and 1 <= len(rounds[0]) <= 2, rounds
    assert [on for on, _, _ in rounds[0]] == ["emergency"] * len(rounds[0])
    assert [s for _, s, _ in rounds[0]] == sorted(s for _, s, _ in rounds[0])
    due = [leaving for _, s, leaving in rounds[0] if s <= acted[0]]  # the rounds due where the ranks stopped
    assert {r for r, g in job.guards.items() if g.leaving} == set().union(*due) and set().union(*due) <= {0, 1, 2, 3}


def test_an_interruption_racing_a_requested_save_is_ordered_the_same_on_every_rank(tmp_path):
    with Job(str(tmp_path), 4, per_node=2, nodes_watched=(1,), step_s=0.02) as job:
        time.sleep(0.3)
        threading.Thread(target=job.guards[0].request_checkpoint).start()
        job.emulators[1].raise_notice(kind="interruption")
        acted = job.wait_acted()
        time.sleep(0.3)
        rounds = [job.agreed(r) for r in range(4)]
    assert len(acted) == 4 and len(set(acted.values())) == 1
    assert all(r == rounds[0] for r in rounds) and sorted(on for on, _, _ in rounds[0]) == ["checkpoint", "emergency"]
    assert acted[0] == {on: step for on, step, _ in rounds[0]}["emergency"]


def test_a_rank_that_never_answers_makes_the_others_give_up_together(tmp_path, caplog):
    """Rank 3 died before it entered: nobody arrives last, so every live rank reads "abort" at the
    round's deadline (1 s here), saves nothing and trains on; nobody hangs."""
    with caplog.at_level(logging.ERROR, logger="spotguard.job.agreement"):
        with Job(str(tmp_path), 4, per_node=2, nodes_watched=(0,), absent=(3,), agreement_timeout_s=1.0) as job:
            time.sleep(0.3)
            job.emulators[0].raise_notice(kind="interruption")
            time.sleep(3.0)
            assert job.acted == {}
            assert all(job.agreed(r) == [] for r in job.guards)
    assert caplog.text.count("not every rank answered within 1.0 s") == 3


@pytest.mark.parametrize("kind", ["HashStore", "FileStore"])
def test_guards_on_a_store_without_a_server(kind, tmp_path):
    """A HashStore blocks in-process; a FileStore's blocking calls poll its file inside torch (no
    server to block on). Either way the ranks agree and act at one step."""
    store = dist.HashStore() if kind == "HashStore" else dist.FileStore(str(tmp_path / "store"), 1)
    with Job(str(tmp_path), 4, per_node=2, store=store, nodes_watched=(1,)) as job:
        time.sleep(0.3)
        job.emulators[1].raise_notice(kind="interruption")
        acted = job.wait_acted()
    assert len(acted) == 4 and len(set(acted.values())) == 1


class Refusing:
    """A store connection that answers `allowed` requests, then fails every one (the server is gone)."""

    def __init__(self, store: dist.Store, allowed: int) -> None:
        self.store, self.allowed = store, allowed

    def __getattr__(self, name: str):
        call = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.allowed -= 1
            if self.allowed < 0:
                raise dist.DistNetworkError("Connection reset by peer")
            return call(*args, **kwargs)

        return counted


def test_a_store_that_refuses_requests_mid_round_means_no_save_on_every_rank(caplog):
    """Rank 1's connection fails after its step is written: it cannot vouch for its arrival, nobody
    arrives last, and every rank ends the round with no decision to save, logged; none hangs."""
    server, world = tcp_server(), 3
    decisions: dict[int, object] = {}

    def rank(r: int) -> None:
        store = server.clone()
        connection = Connection(Refusing(store, allowed=1), own=False) if r == 1 else Connection.of(store)
        agreement = StepAgreement(connection, "job/", r, world, last_step=5)
        decisions[r] = agreement.agree(1, {"type": "emergency"}, timeout_s=1.0)

    with caplog.at_level(logging.WARNING, logger="spotguard.job.agreement"):
        started = time.monotonic()
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert decisions == {0: None, 1: None, 2: None}
    # Rank 1 tries to reach the store to decide for DECIDE_GRACE_S past the round's 1 s; 3 s more is room for
    # a loaded machine, and a round that waited 10 s (or the store's own timeout) would fail.
    assert time.monotonic() - started < 1.0 + DECIDE_GRACE_S + 3.0
    assert "store error while gathering steps" in caplog.text and "no save in this round" in caplog.text
    assert server.get("job/agree/1/decision") == b"abort"


def test_saving_without_a_process_group_says_what_is_missing(tmp_path, caplog):
    """A stated topology needs no process group to coordinate, but a save does: the emergency is
    agreed, the save fails with a one-line reason, and step() still ends the loop (exit code unset)."""
    with caplog.at_level(logging.ERROR, logger="spotguard.guard"):
        with Job(str(tmp_path), 2, per_node=1, nodes_watched=(1,)) as job:
            time.sleep(0.3)
            job.emulators[1].raise_notice(kind="interruption")
            acted = job.wait_acted()
    assert len(acted) == 2 and not any(g.emergency_saved for g in job.guards.values())
    assert "needs torch.distributed initialised (init_process_group) first" in caplog.text


def test_counting_store_counts_a_get_as_two_server_requests():
    counts = Counts()
    store = counting_store(dist.HashStore(), counts)
    store.set("k", "v")
    store.get("k")
    assert counts.snapshot() == {"set": 1, "get": 1} and counts.total() == 3
    assert store.clone() is store  # a HashStore's clone is itself: the connection stays shared
    assert Connection.of(store).own is False
    tcp = counting_store(tcp_server(), counts)
    assert Connection.of(tcp).own is True
    tcp.set_timeout(timedelta(seconds=5))


def test_a_silent_failure_ends_a_round_that_waits_for_the_lost_rank_at_once():
    """Rank 2 is gone (it never arrives): a requested save's round would hold every listener for the
    agreement's 30 s. The silent failure announced meanwhile decides that round "abort", so every
    listener reads the failure in well under a second, not after the round's timeout."""
    from spotguard.job.coordination import Coordination
    from spotguard.job.topology import Topology
    from tests.threaded_guards import tcp_server

    server = tcp_server()
    heard: dict[int, float] = {}
    agreed: list[object] = []
    ranks = []
    for rank in (0, 1):  # rank 2 never starts
        ranks.append(
            Coordination(
                server.clone(), "job/", Topology(rank, 3, rank, True, f"node-{rank}"), timeout_s=30.0,
                on_agreed=lambda event, decision, notice: agreed.append(decision),
                on_silent=lambda event, rank=rank: heard.setdefault(rank, time.monotonic()),
            )
        )  # fmt: skip
        ranks[-1].start()
    try:
        ranks[0].request_checkpoint("interval")
        time.sleep(0.5)  # both listeners are in the round now, waiting for rank 2
        announced = time.monotonic()
        assert ranks[1].publish_silent_failure({"cause": "peer-lost", "culprit": "node-2"})
        assert not ranks[0].publish_silent_failure({"cause": "hang", "culprit": ""})  # once per job
        deadline = time.monotonic() + 10
        while len(heard) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(heard) == [0, 1]
        assert max(heard.values()) - announced < 2.0
        assert agreed == [None, None]  # the round was aborted: no save
    finally:
        for coordination in ranks:
            coordination.stop()


def test_a_publish_that_read_the_next_slot_before_a_round_still_reaches_every_listener():
    """A publisher starts at its listener's next slot, read before it writes; the listener may take that
    slot's event and finish its round in between. The slot must still be taken then: were the round to
    remove it, the late publish would write its event there, behind the listener, and no round would
    ever run for it."""
    from spotguard.job.coordination import Coordination
    from spotguard.job.topology import Topology

    agreed = []
    coordination = Coordination(
        dist.HashStore(), "job/", Topology(0, 1, 0, True, "node-0"), timeout_s=10.0,
        on_agreed=lambda event, decision, notice: agreed.append(event.get("reason")),
    )  # fmt: skip
    coordination.start()
    try:
        stale = coordination.broadcast._next  # what a publish reads before the round below runs
        coordination.request_checkpoint("first")
        deadline = time.monotonic() + 10
        while agreed != ["first"]:
            assert time.monotonic() < deadline, agreed
            time.sleep(0.01)
        coordination.broadcast.log.append({"type": "checkpoint", "reason": "late"}, stale)  # the publish, now
        while agreed != ["first", "late"]:
            assert time.monotonic() < deadline, f"the late publish was never agreed: {agreed}"
            time.sleep(0.01)
    finally:
        coordination.stop()
