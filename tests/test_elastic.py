"""Elastic continue under torchrun's agent: real agents on 127.0.0.1 (`--nnodes 1:2 --rdzv-backend
c10d --max-restarts 3`, tests/nodes.py), the rendezvous store hosted by the test. One node is
reclaimed, the survivor trains on alone from the committed step, a new node joins and the job
grows back: no step lost or repeated, every sample index of an epoch consumed once (spotguard.data),
final weights equal to uninterrupted runs with the same world-size schedule."""

from __future__ import annotations

import json
import re
import time

import pytest

from spotguard.checkpoint import list_checkpoints
from spotguard.demo.elastic import check_samples, check_steps, spans, step_lines
from tests.nodes import rendezvous, run_nodes, stop_all

STEPS = 60
DATA = ["--dataset", "100", "--batch-size", "4", "--log-samples"]  # 12 / 25 steps an epoch at 2 / 1 ranks
ARGS = ["--steps", str(STEPS), "--step-time", "0.2", *DATA]


def test_two_nodes_one_reclaimed_the_other_goes_on_alone_then_a_new_node_joins(tmp_path):
    rdzv = rendezvous("1:2", max_restarts=3)
    ckpt, out = tmp_path / "ckpt", tmp_path / "out.json"
    # A background save every step: the notice and the join's SIGTERM find one in flight.
    args = [*ARGS, "--out", str(out), "--save-every", "1"]
    # Workers restarted by torchrun at each change of world size are never taken for lost nodes.
    env = {"SPOTGUARD_PEER_TIMEOUT": "2"}
    nodes = [rdzv.join(0, str(ckpt), tmp_path, args, env), rdzv.join(1, str(ckpt), tmp_path, args, env)]
    try:
        nodes[0].wait_for(r'"step": 3, "rank": 0, "world": 2')
        nodes[1].emulator.raise_notice()
        assert nodes[1].finish(60) != 0  # its agent was told to leave: torchrun ends without restarting
        nodes[1].kill()  # and the VM vanishes
        nodes[0].wait_for(r'"rank": 0, "world": 1,', timeout=90)  # the survivor trains on alone
        time.sleep(1)
        nodes.append(rdzv.join(2, str(ckpt), tmp_path, args, env))
        assert nodes[0].finish(180) == 0, nodes[0].tail()
        assert nodes[2].finish(60) == 0, nodes[2].tail()
    finally:
        stop_all(nodes)

    records = [r for node in nodes for r in step_lines(node.lines)]
    schedule = spans(check_steps(records, STEPS))  # each raises CheckFailed, saying what broke
    assert [w for w, _ in schedule] == [2, 1, 2], schedule
    check_samples(records, 100, 4)
    reclaimed = json.loads(nodes[1].exit_file.read_text())
    assert (reclaimed["exit_code"], reclaimed["committed"], reclaimed["leaving"]) == (143, True, True)
    assert reclaimed["step"] == schedule[0][1]
    text = nodes[0].output()
    assert "leaving the elastic job" in nodes[1].output() and "leaving the elastic job" not in text
    assert "watches node" in text and not re.search(r"declared lost|silent-failure", text)
    for _, last in schedule[:2]:  # each change of world size resumed the step committed just before it
        assert re.search(rf"resumed +step={last} +next_step={last + 1}", text), text
    emergencies = [c.step for c in list_checkpoints(str(ckpt)) if c.committed and c.reason == "emergency"]
    assert [s for _, s in schedule[:2]] == emergencies, emergencies

    # The same world-size schedule, each span run to its end and saved: the final weights agree.
    ref = tmp_path / "ref"
    for world, last in schedule[:2]:
        run_nodes(world, ref / "ckpt", ref, ["--steps", str(last + 1), *DATA, "--save-final"])
    expected = run_nodes(2, ref / "ckpt", ref, ["--steps", str(STEPS), *DATA], ref / "out.json")
    assert json.loads(out.read_text())["digest"] == expected["digest"]


def test_the_reclaimed_node_was_the_last_above_min_the_job_stops_with_restart_me(tmp_path):
    """--nnodes 2:2: one survivor cannot form a round, so it commits, stops its own agent and leaves
    "restart me" (143, committed) in its exit file, instead of waiting out the join timeout."""
    rdzv = rendezvous("2:2", max_restarts=3)
    ckpt = str(tmp_path / "ckpt")
    env = {"SPOTGUARD_MIN_NODES": "2"}
    nodes = [rdzv.join(i, ckpt, tmp_path, ["--steps", "200", "--step-time", "0.05"], env) for i in range(2)]
    try:
        nodes[0].step_reached(3)
        nodes[1].emulator.raise_notice()
        started = time.monotonic()
        assert all(node.finish(60) != 0 for node in nodes)  # both agents left, neither restarted
        assert time.monotonic() - started < 30
    finally:
        stop_all(nodes)
    survivor = json.loads(nodes[0].exit_file.read_text())
    assert (survivor["exit_code"], survivor["committed"], survivor["leaving"]) == (143, True, False)
    assert "1 node(s) would stay, fewer than min_nodes=2" in nodes[0].output()
    assert "resumed" not in nodes[0].output() and "resumed" not in nodes[1].output()
    assert [c.step for c in list_checkpoints(ckpt) if c.committed] == [survivor["step"]]


def test_a_node_reclaimed_while_another_joins(tmp_path):
    """--nnodes 1:3: node 2's agent starts as node 1 is reclaimed. Whatever comes first (the notice,
    or the agents' SIGTERM for the join), every step is trained once and every sample used once,
    node 1 leaves the job and nodes 0 and 2 finish it."""
    rdzv = rendezvous("1:3", max_restarts=3)
    ckpt = str(tmp_path / "ckpt")
    args = ["--steps", "40", "--step-time", "0.2", *DATA]
    nodes = [rdzv.join(0, ckpt, tmp_path, args), rdzv.join(1, ckpt, tmp_path, args)]
    try:
        nodes[0].wait_for(r'"step": 3, "rank": 0, "world": 2')
        nodes.append(rdzv.join(2, ckpt, tmp_path, args))
        nodes[1].emulator.raise_notice()
        assert nodes[1].finish(90) != 0
        nodes[1].kill()
        assert nodes[0].finish(180) == 0, nodes[0].tail()
        assert nodes[2].finish(60) == 0, nodes[2].tail()
    finally:
        stop_all(nodes)
    records = [r for node in nodes for r in step_lines(node.lines)]
    check_steps(records, 40)
    check_samples(records, 100, 4)
    assert step_lines(nodes[2].lines), "the joining node never trained"
    assert json.loads(nodes[1].exit_file.read_text())["leaving"] is True


def test_who_leaves_the_elastic_job(monkeypatch):
    from spotguard.ending import elastic

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # the agent would not restart anyone: nothing to do
    assert elastic.withdrawal(reclaimed=True, leaving=True, ranks_left=4, at_least=1) is None
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert elastic.withdrawal(reclaimed=True, leaving=True, ranks_left=4, at_least=1) == "this node is reclaimed"
    assert elastic.withdrawal(reclaimed=False, leaving=True, ranks_left=4, at_least=1) is None  # a signal's sender
    assert elastic.withdrawal(reclaimed=True, leaving=False, ranks_left=8, at_least=2) is None  # 2 nodes stay
    assert elastic.withdrawal(reclaimed=True, leaving=False, ranks_left=4, at_least=2) == (
        "1 node(s) would stay, fewer than min_nodes=2"
    )
    monkeypatch.setenv("SPOTGUARD_MIN_NODES", "3")
    assert elastic.min_nodes(None) == 3 and elastic.min_nodes(2) == 2
    monkeypatch.setenv("SPOTGUARD_MIN_NODES", "two")
    with pytest.raises(ValueError, match=r"min_nodes \(or \$SPOTGUARD_MIN_NODES\) must be a positive int, not 'two'"):
        elastic.min_nodes(None)
    with pytest.raises(ValueError, match="must be a positive int, not 0"):
        elastic.min_nodes(0)
