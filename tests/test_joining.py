"""Nodes joining a running in-process job (spotguard.inprocess.joining), on a real TCPStore: the joining side's
number and wait, rank 0's door that asks for them or refuses them, and the generation every member forms
with them. The whole path with torchrun nodes is in tests/test_inprocess.py."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch.distributed as dist

from spotguard.demo.processes import free_port
from spotguard.inprocess import joining
from spotguard.inprocess.generation import Generation
from spotguard.inprocess.joining import Door, JoinError


@pytest.fixture
def job(monkeypatch):
    """The job's store (as torchrun's agent hosts it) and its address; the environment a join sets is undone."""
    for name in ("GROUP_RANK", "TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(joining, "FORM_TIMEOUT_S", 10.0)
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    return store, f"127.0.0.1:{port}"


def knocking(address: str, timeout_s: float = 30) -> tuple[threading.Thread, dict]:
    """A joining node's knock on its own thread: what it returned or raised lands in the dict."""
    box: dict = {}

    def knock() -> None:
        try:
            box["joined"] = joining.knock(address, timeout_s)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            box["error"] = exc

    thread = threading.Thread(target=knock, daemon=True)
    thread.start()
    return thread, box


def wait_for_number(store: dist.Store, count: int) -> None:
    store.wait([f"spotguard/joins/{count}/node"])


def test_an_address_that_is_not_host_and_port_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"SPOTGUARD_JOIN must be HOST:PORT .* not 'node-0'"):
        joining.knock("node-0")


def test_a_node_nobody_takes_in_gives_up_after_its_timeout(job):
    store, address = job
    with pytest.raises(JoinError, match=r"did not take node 1 in within 1 s"):
        joining.knock(address, timeout_s=1)
    assert json.loads(store.get("spotguard/joins/1/node"))["ranks"] == 1


def test_the_door_asks_for_a_joining_node_and_every_member_forms_the_same_generation_with_it(job, monkeypatch):
    store, address = job
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")  # the job's; the joining node takes it over
    thread, box = knocking(address)
    wait_for_number(store, 1)
    asked: list[list[int]] = []
    door = Door(store, lambda nodes, on_failed: asked.append(nodes), lambda ranks: None)
    door.poll()
    door.poll()  # asked once, not at every poll, while the job has not stopped for it
    assert asked == [[1]]

    # At the agreed step: rank 0 of the job (generation 0 had 3 ranks; rank 2 left since) numbers and answers it,
    # the other member reads the answer; the joining node forms the same generation, named as a node of its own.
    now = Generation(1, (0, 1), me=0)
    following = joining.take_in(store, now, (1,), founders=3)
    assert (following.number, following.members, following.rank) == (2, (0, 1, 3), 0)
    assert joining.take_in(store, Generation(1, (0, 1), me=1), (1,), founders=None) == Generation(2, (0, 1, 3), 1)
    thread.join(10)
    _, generation, answer = box["joined"]
    assert generation == Generation(2, (0, 1, 3), 3) and generation.rank == 2
    assert (answer.world_before, answer.run_id, os.environ["GROUP_RANK"]) == (2, "job-7", "3")
    door.poll()
    assert asked == [[1]]  # answered: never asked for again


def test_a_node_the_job_cannot_take_is_refused_with_why_and_the_next_one_is_still_asked_for(job):
    store, address = job
    first, refused = knocking(address)
    wait_for_number(store, 1)
    second, taken = knocking(address)
    wait_for_number(store, 2)
    asked: list[list[int]] = []
    verdicts = iter(["it runs 1 rank(s); the job's nodes run 8", None])
    Door(store, lambda nodes, on_failed: asked.append(nodes), lambda ranks: next(verdicts)).poll()
    first.join(10)
    assert str(refused["error"]) == f"the job at {address} refused node 1: it runs 1 rank(s); the job's nodes run 8"
    assert asked == [[2]] and "error" not in taken

    joining.refuse_waiting(store, "the job has ended")  # the job ends before it stops for node 2
    second.join(10)
    assert str(taken["error"]) == f"the job at {address} refused node 2: the job has ended"


def test_a_node_that_gave_up_waiting_is_left_out_of_the_generation_the_next_one_joins(job):
    """Node 1 gives up (its timeout) before the job stops for it; node 2 comes later: the job takes node 2
    alone. Without the claim, node 1's ranks would be members that never come, and the generation would
    not form."""
    store, address = job
    with pytest.raises(JoinError, match="did not take node 1 in"):
        joining.knock(address, timeout_s=0.5)
    thread, box = knocking(address)
    wait_for_number(store, 2)
    asked: list[list[int]] = []
    Door(store, lambda nodes, on_failed: asked.append(nodes), lambda ranks: None).poll()
    assert asked == [[1, 2]]  # the door cannot tell that node 1 left: the claim at the step does
    following = joining.take_in(store, Generation(0, (0, 1), me=0), (1, 2), founders=2)
    assert following.members == (0, 1, 3)  # node 2's member number: 2 + (2 - 1) * 1
    thread.join(10)
    assert box["joined"][1] == Generation(1, (0, 1, 3), 3)


def test_a_number_without_its_record_or_a_failed_join_is_refused_and_the_next_node_still_asked_for(job, monkeypatch):
    """A node that died between drawing its number and saying what it brings would hold every later node
    back; one whose join failed (the snapshot of the step) would be asked for again and again."""
    store, address = job
    monkeypatch.setattr(joining, "RECORD_WAIT_S", 0.3)
    store.add("spotguard/joins/count", 1)  # number 1, and nothing more of it
    thread, box = knocking(address)
    wait_for_number(store, 2)
    asked: list[tuple[list[int], object]] = []
    door = Door(store, lambda nodes, on_failed: asked.append((nodes, on_failed)), lambda ranks: None)
    door.poll()
    assert asked == []  # number 1's record may still come
    time.sleep(0.4)
    door.poll()
    assert [nodes for nodes, _ in asked] == [[2]]
    assert "refused" in store.get("spotguard/joins/1/answer").decode()

    asked[0][1]([2], "rank 1's snapshot failed: no space")  # what the training thread says after the step
    door.poll()
    assert door._missing_since == {}  # number 1 is settled: nothing of it is kept for the job's life
    thread.join(10)
    assert str(box["error"]) == (
        f"the job at {address} refused node 2: the job could not stop for it: rank 1's snapshot failed: no space"
    )


def test_settled_never_moves_back_when_the_door_refuses_a_node_as_rank_0_takes_an_earlier_one_in(job):
    """The door's thread refuses node 3 while the training thread takes node 2 in: were `settled` moved back
    to 2, the door would read node 3 as unanswered and ask every rank to stop for a node it turned away."""
    store, _ = job
    joining.refuse(store, [3], "it runs 2 rank(s); the job's nodes run 1")
    joining.settle(store, 2)  # what `take_in` of node 2 does, a moment later
    assert store.get("spotguard/joins/settled") == b"3"
    joining.settle(store, 4)
    assert store.get("spotguard/joins/settled") == b"4"
