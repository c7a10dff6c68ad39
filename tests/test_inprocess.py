"""In-process recovery (`spotguard.run`, the example's --in-process): real torchrun agents as nodes on
127.0.0.1 (tests/nodes.py). Node 2 of 3 is reclaimed: the survivors keep their processes, form the next
generation's group among themselves, load the agreed step from the nodes' memory and train on, ending
bit-identical to the restart path from the same step (invariant 13); what it cannot do safely ends as
it would without it."""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest

from spotguard.checkpoint import list_checkpoints
from spotguard.cli import main
from tests.nodes import (
    CHECKOUT,
    EXAMPLE,
    ROOT,
    Node,
    join_node,
    rendezvous,
    run_nodes,
    start_nodes,
    stop_all,
    worker_exit_code,
    worker_pids,
)

STEPS = 40
BASE = ["--steps", str(STEPS), "--step-time", "0.1"]
SHARDING = {"ddp": [], "fsdp": ["--fsdp"]}
SNAPSHOTS = {"SPOTGUARD_SNAPSHOT_EVERY": "4"}  # the agreed step's state comes from the nodes' memory
JOINING = [str(ROOT / "tests" / "joining_worker.py")]  # the example, started when the test says (and faults)
RECOVERED = re.compile(
    r"in-process recovery: generation 1, world 3 -> 2, rank\(s\) 2 (left after a notice|lost without a notice): "
    r"this process \(pid (\d+)\) paused ([\d.]+) s .*going on from step (\d+) with the state from (.*)"
)


def reclaim_node_2(tmp_path, args, env, at_step=6, which=2, script=None):
    """Three nodes running the example (or `script`) with `args`; node `which` reclaimed once rank 0 printed
    `at_step`. Returns the nodes (ended), their exit statuses and each node's worker pids before the notice."""
    more = {"script": [str(ROOT / "tests" / script)]} if script else {}
    nodes = start_nodes(3, str(tmp_path / "ckpt"), tmp_path, args, env, **more)
    try:
        nodes[0].step_reached(at_step)
        pids = [worker_pids(n) for n in nodes]
        nodes[which].emulator.raise_notice()
        codes = [n.finish(180) for n in nodes]
    finally:
        stop_all(nodes)
    return nodes, codes, pids


# Where the survivors' state comes from after a departure: DDP's replicas from each process's own tensors,
# FSDP2's shards (the leaving rank's among them) from the snapshot in the nodes' memory.
FROM = {"ddp": ("memory", "this process's own memory"), "fsdp": ("snapshot", "the snapshot in the nodes' memory")}


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_node_2_of_3_reclaimed_the_survivors_go_on_in_their_processes_bit_identical(sharding, tmp_path, capsys):
    args = [*BASE, *SHARDING[sharding], "--in-process", "--out", str(tmp_path / "out.json")]
    # DDP: a snapshot every step, so that the emergency's step is always one whose snapshot is due (said alike)
    env = {"SPOTGUARD_SNAPSHOT_EVERY": "1"} if sharding == "ddp" else SNAPSHOTS
    nodes, codes, pids = reclaim_node_2(tmp_path, args, env)
    text = [n.output() for n in nodes]
    assert codes == [0, 0, 0], "\n".join(n.tail() for n in nodes)
    found = [RECOVERED.search(t) for t in text[:2]]
    assert all(found), "\n".join(n.tail() for n in nodes)
    step = int(found[0][4])
    for node, match, before in zip(nodes, found, pids):
        assert match[1] == "left after a notice" and int(match[4]) == step
        assert int(match[2]) in before  # the same worker process trains on
        assert match[5] == FROM[sharding][1]
        assert "Starting worker group" not in node.output().split("in-process recovery")[1]  # no torchrun restart
    assert "in-process recovery" not in text[2]
    assert re.search(r"this node leaves and the job goes on|exiting with code 0", text[2])
    exit_file = json.loads(nodes[2].exit_file.read_text())
    assert (exit_file["exit_code"], exit_file["leaving"], exit_file["job_goes_on"]) == (0, True, True)
    assert not nodes[0].exit_file.exists() and not nodes[1].exit_file.exists()  # the survivors never exited early
    ended = json.loads((tmp_path / "out.json").read_text())
    assert ended["start"] == step + 1

    # The ledger: the first generation's segment ended interrupted, the second began with the recovery.
    assert main(["report", str(tmp_path / "ckpt"), "--json"]) == 0
    segments = json.loads(capsys.readouterr().out)["segment_details"]
    assert [s["ended"] for s in segments] == ["interrupted", "finished"]
    recovered = segments[1]["recovered"]
    assert (recovered["generation"], recovered["world_before"], recovered["world_after"]) == (1, 3, 2)
    assert (recovered["step"], recovered["source"], recovered["cause"]) == (step, FROM[sharding][0], "interruption")
    assert 0 < recovered["paused_s"] < 60 and segments[1]["first_step"] == step + 1
    assert main(["report", str(tmp_path / "ckpt")]) == 0
    assert re.search(rf"generation 1 +interruption +3 -> 2 +{step} .* {FROM[sharding][0]}", capsys.readouterr().out)
    # A replicated state needs no snapshot of the agreed step: the survivors hold it whole.
    assert ("no snapshot of the emergency's step" in text[0]) == (sharding == "ddp")
    assert f"the snapshot of step {step} was not taken" not in text[0]  # not a warning as well

    # The restart path from the same step: two fresh nodes resume the emergency checkpoint and train on.
    (info,) = [c for c in list_checkpoints(str(tmp_path / "ckpt")) if c.committed]
    assert (info.step, info.reason) == (step, "emergency")
    fresh = tmp_path / "restart"
    shutil.copytree(tmp_path / "ckpt", fresh / "ckpt")
    restarted = run_nodes(2, fresh / "ckpt", fresh, [*BASE, *SHARDING[sharding]], fresh / "out.json")
    assert restarted == ended


def test_a_sigterm_between_two_generations_is_a_notice_in_the_next_one(tmp_path):
    """Node 2 of 3 reclaimed; node 1 is stopped (SIGTERM) as it begins to form the next generation, when no
    guard watches its signals: the signal is held, handled by generation 1's guard as a notice, and node 1
    leaves at the step then agreed (exit 0); node 0 trains on alone to the end, in its process."""
    env = {**SNAPSHOTS, "SPOTGUARD_TEST_SIGTERM_IN_PAUSE": "1"}
    args = [*BASE, "--in-process"]
    nodes, codes, pids = reclaim_node_2(tmp_path, args, env, script="joining_worker.py")
    assert codes == [0, 0, 0], "\n".join(n.tail() for n in nodes)
    assert "test: SIGTERM between generations" in nodes[1].output()
    assert "SIGTERM came while no guard watched it (between two generations): handled now" in nodes[1].output()
    alone = re.search(r"in-process recovery: generation 2, world 2 -> 1, rank\(s\) 1 left after a notice: "
                      r"this process \(pid (\d+)\)", nodes[0].output())  # fmt: skip
    assert alone and int(alone[1]) in pids[0], nodes[0].tail()
    exit_file = json.loads(nodes[1].exit_file.read_text())
    assert (exit_file["exit_code"], exit_file["leaving"], exit_file["job_goes_on"]) == (0, True, True)
    assert not nodes[0].exit_file.exists()


FALLBACKS = [
    # (the node reclaimed, the environment, what the survivors say)
    (2, {"SPOTGUARD_MIN_NODES": "3"}, "2 node(s) would stay, fewer than min_nodes=3: the job ends as without it"),
    (0, {}, "the node of rank 0 is gone, and the job's store may be gone with it: the job ends as without it"),
]


@pytest.mark.parametrize("which,env,said", FALLBACKS, ids=["min_nodes", "store-host"])
def test_what_cannot_go_on_in_process_ends_as_without_it(which, env, said, tmp_path):
    nodes, codes, _ = reclaim_node_2(tmp_path, [*BASE, "--in-process"], env, which=which)
    text = [n.output() for n in nodes]
    assert "in-process recovery: generation" not in "".join(text)
    assert said in text[(which + 1) % 3], text[(which + 1) % 3]
    assert [worker_exit_code(n) for n in nodes] == [143, 143, 143], "\n".join(n.tail() for n in nodes)
    exits = [json.loads(n.exit_file.read_text()) for n in nodes]
    assert [(e["exit_code"], e["leaving"], "job_goes_on" in e) for e in exits] == [
        (143, i == which, False) for i in range(3)
    ]


def test_a_generation_that_cannot_be_formed_ends_as_without_in_process_recovery(tmp_path):
    """The survivors' next group is never formed (a member does not come): they exit 143, the emergency step
    being committed, and say why; the leaving node's share was handed over before (it exits 0)."""
    nodes, codes, _ = reclaim_node_2(tmp_path, [*BASE, "--in-process"], {}, script="unformable_worker.py")
    text = [n.output() for n in nodes]
    for survivor in text[:2]:
        assert (
            "in-process recovery failed (FormError: generation 1: a member never came (injected)): ending as "
            "without it" in survivor
        ), survivor
        assert "emergency checkpoint committed; exiting with code 143 so the job is restarted" in survivor
    assert [worker_exit_code(n) for n in nodes] == [143, 143, 0], "\n".join(n.tail() for n in nodes)
    exits = [json.loads(n.exit_file.read_text()) for n in nodes]
    (info,) = [c for c in list_checkpoints(str(tmp_path / "ckpt")) if c.committed]
    assert [(e["exit_code"], e["committed"], e["step"], e["leaving"]) for e in exits] == [
        (143, True, info.step, False),
        (143, True, info.step, False),
        (0, True, info.step, True),
    ]


def test_with_exit_code_none_the_leaving_rank_returns_to_its_caller_and_the_survivors_go_on(tmp_path):
    out = tmp_path / "out.json"
    nodes, codes, _ = reclaim_node_2(tmp_path, [*BASE, "--in-process", "--out", str(out)], {},
                                     script="exit_none_worker.py")  # fmt: skip
    text = [n.output() for n in nodes]
    assert codes == [0, 0, 0] and [worker_exit_code(n) for n in nodes] == [0, 0, 0], "\n".join(n.tail() for n in nodes)
    assert all(RECOVERED.search(t) for t in text[:2])
    assert "in-process recovery failed" not in text[2] and not nodes[2].exit_file.exists()  # its caller's to say
    assert json.loads(out.read_text())["start"] > 0


def test_a_training_function_that_raises_as_its_rank_leaves_returns_to_the_caller(tmp_path):
    """The leaving rank's function raises after its last step (injected): `run` returns to its caller, which
    ends well, instead of failing on a result never made; the survivors go on."""
    nodes, codes, _ = reclaim_node_2(tmp_path, [*BASE, "--in-process"], {}, script="raise_on_leaving_worker.py")
    text = [n.output() for n in nodes]
    assert [worker_exit_code(n) for n in nodes] == [0, 0, 0], "\n".join(n.tail() for n in nodes)
    assert "injected: the training function fails as its rank leaves" in text[2]
    assert all(RECOVERED.search(t) for t in text[:2])


def workers_ended(nodes: list[Node], timeout: float = 120) -> None:
    """Wait until the nodes' workers have all exited (their agents may still wait in torchrun's exit barrier
    for a frozen node's agent, which never comes)."""
    deadline = time.monotonic() + timeout
    while any(worker_pids(n) for n in nodes):
        assert time.monotonic() < deadline, "\n".join(n.tail() for n in nodes)
        time.sleep(0.2)


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_node_2_of_3_frozen_the_survivors_leave_the_step_and_go_on_from_the_snapshot(sharding, tmp_path):
    """No notice: node 2 stops answering (SIGSTOP, no FIN) while the survivors wait on it in a collective.
    Once its neighbour declares it lost, they shut their group's sockets down, leave the step, and go on
    from the newest whole snapshot at world 2, as the restart path would, in the same processes."""
    out = tmp_path / "out.json"
    args = [*BASE, *SHARDING[sharding], "--in-process", "--save-every", "4", "--out", str(out)]
    env = {**SNAPSHOTS, "SPOTGUARD_PEER_TIMEOUT": "5"}
    nodes = start_nodes(3, str(tmp_path / "ckpt"), tmp_path, args, env)
    try:
        nodes[0].step_reached(10)  # between two snapshots (every 4 steps), the save of step 8 done
        pids = [worker_pids(n) for n in nodes]
        nodes[2].freeze()
        workers_ended(nodes[:2])
    finally:
        stop_all(nodes)
    text = [n.output() for n in nodes[:2]]
    found = [RECOVERED.search(t) for t in text]
    assert all(found), "\n".join(n.tail() for n in nodes[:2])
    step = int(found[0][4])
    for node, match, before in zip(nodes, found, pids):
        assert match[1] == "lost without a notice" and int(match[4]) == step
        assert int(match[2]) in before  # the same worker process trains on
        assert match[5] == "the snapshot in the nodes' memory"
        assert float(match[3]) < 60  # the step was left, not waited out (gloo's own timeout: 30 min)
        assert "failed (exitcode" not in node.output()  # torchrun saw no worker fail
        assert "node vm/node-2 lost" in node.output() and "go on in their processes" in node.output()
    assert not nodes[0].exit_file.exists() and not nodes[1].exit_file.exists()
    ended = json.loads(out.read_text())
    assert ended["start"] == step + 1

    # The restart path from the same step: two fresh nodes resume it (saved durably too: every 4 steps).
    fresh = tmp_path / "restart"
    (fresh / "ckpt").mkdir(parents=True)
    shutil.copytree(tmp_path / "ckpt" / f"step-{step:010d}", fresh / "ckpt" / f"step-{step:010d}")
    restarted = run_nodes(2, fresh / "ckpt", fresh, [*BASE, *SHARDING[sharding]], fresh / "out.json")
    assert restarted == ended


def test_two_departures_in_a_row_make_generation_2_at_world_1_bit_identical(tmp_path, capsys):
    """Node 2 reclaimed, then node 1: rank 0's one process goes through two recoveries (generations 1 and
    2, worlds 3 -> 2 -> 1) and ends where a restart from the second emergency step ends."""
    out = tmp_path / "out.json"
    nodes = start_nodes(3, str(tmp_path / "ckpt"), tmp_path, [*BASE, "--in-process", "--out", str(out)], SNAPSHOTS)
    try:
        nodes[0].step_reached(6)
        before = worker_pids(nodes[0])
        nodes[2].emulator.raise_notice()
        assert nodes[0].wait_for("in-process recovery: generation 1"), nodes[0].tail()  # then the second notice
        nodes[1].emulator.raise_notice()
        codes = [n.finish(180) for n in nodes]
    finally:
        stop_all(nodes)
    assert codes == [0, 0, 0], "\n".join(n.tail() for n in nodes)
    text = nodes[0].output()
    first = re.search(r"in-process recovery: generation 1, world 3 -> 2, rank\(s\) 2 left after a notice: "
                      r"this process \(pid (\d+)\)", text)  # fmt: skip
    second = re.search(r"in-process recovery: generation 2, world 2 -> 1, rank\(s\) 1 left after a notice: "
                       r"this process \(pid (\d+)\) .*going on from step (\d+)", text)  # fmt: skip
    assert first and second, nodes[0].tail()
    assert int(first[1]) == int(second[1]) and int(first[1]) in before  # one process throughout
    step = int(second[2])
    assert json.loads(out.read_text())["start"] == step + 1
    assert main(["report", str(tmp_path / "ckpt"), "--json"]) == 0
    segments = json.loads(capsys.readouterr().out)["segment_details"]
    assert [(s["recovered"] or {}).get("generation") for s in segments] == [None, 1, 2]
    assert [(s["recovered"] or {}).get("world_after") for s in segments[1:]] == [2, 1]

    newest = max(c.step for c in list_checkpoints(str(tmp_path / "ckpt")) if c.committed)
    assert newest == step
    fresh = tmp_path / "restart"
    shutil.copytree(tmp_path / "ckpt", fresh / "ckpt")
    assert run_nodes(1, fresh / "ckpt", fresh, BASE, fresh / "out.json") == json.loads(out.read_text())


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_a_replacement_joins_the_running_job_and_it_ends_at_full_size_bit_identical(sharding, tmp_path, capsys):
    """Node 2 of 3 reclaimed, the survivors go on at world 2; then a replacement node joins the running job
    (SPOTGUARD_JOIN, its own agent): the survivors keep their processes throughout, the joining node loads the
    agreed step from their memory, and the job ends at world 3 where three fresh nodes resuming that step end."""
    out = tmp_path / "out.json"
    # every step saved durably too: the restart path below resumes the step the node joined at
    plain = ["--steps", "60", "--step-time", "0.1", *SHARDING[sharding]]
    args = [*plain, "--in-process", "--save-every", "1", "--out", str(out)]
    ckpt, go = str(tmp_path / "ckpt"), tmp_path / "go"
    nodes = start_nodes(3, ckpt, tmp_path, args, SNAPSHOTS)
    nodes.append(join_node(nodes[0], 3, ckpt, tmp_path, args, {**SNAPSHOTS, "SPOTGUARD_TEST_GO": str(go)},
                           script=JOINING))  # fmt: skip
    try:
        nodes[0].step_reached(6)
        pids = [worker_pids(n) for n in nodes[:2]]
        nodes[2].emulator.raise_notice()
        assert nodes[0].wait_for("in-process recovery: generation 1"), nodes[0].tail()
        go.touch()  # the replacement knocks now
        codes = [n.finish(180) for n in nodes]
    finally:
        stop_all(nodes)
    assert codes == [0, 0, 0, 0], "\n".join(n.tail() for n in nodes)
    joined = re.compile(
        r"in-process recovery: generation 2, world 2 -> 3, rank\(s\) 2 joined: this process \(pid (\d+)\) "
        r"paused ([\d.]+) s .*going on from step (\d+) with the state from (.*)"
    )
    found = [joined.search(n.output()) for n in (nodes[0], nodes[1], nodes[3])]
    assert all(found), "\n".join(n.tail() for n in nodes)
    step = int(found[0][3])
    # DDP's survivors load the step from their own tensors, the joining rank from the snapshot of it in theirs
    survivors = FROM[sharding][1]
    for match, source in zip(found, [survivors, survivors, "the snapshot in the nodes' memory"]):
        assert int(match[3]) == step and match[4] == source
    for node, match, before in zip(nodes, found, pids):
        assert int(match[1]) in before  # the survivors' processes train on, through both recoveries
        assert "Starting worker group" not in node.output().split("in-process recovery")[1]  # no torchrun restart
    assert "node 1 waiting to join the job" in nodes[3].output()
    ended = json.loads(out.read_text())
    assert ended["start"] == step + 1

    assert main(["report", ckpt, "--json"]) == 0
    segments = json.loads(capsys.readouterr().out)["segment_details"]
    assert [s["ended"] for s in segments] == ["interrupted", "joining", "finished"]
    recovered = segments[2]["recovered"]
    assert (recovered["cause"], recovered["world_before"], recovered["world_after"]) == ("join", 2, 3)

    # The restart path from the same step: three fresh nodes resume it (saved durably too) and train on.
    fresh = tmp_path / "restart"
    (fresh / "ckpt").mkdir(parents=True)
    shutil.copytree(tmp_path / "ckpt" / f"step-{step:010d}", fresh / "ckpt" / f"step-{step:010d}")
    restarted = run_nodes(3, fresh / "ckpt", fresh, plain, fresh / "out.json")
    assert restarted == ended


def test_a_node_booting_later_finds_a_job_started_through_the_rendezvous_and_joins_it_in_process(tmp_path, capsys):
    """As the Terraform startup script runs an in-process job: two nodes start it through torchrun's c10d
    rendezvous (its workers' store at an address torchrun picks) with SPOTGUARD_JOIN_REGISTRY the rendezvous
    endpoint; a third node asks `spotguard join-address` there, and joins with what it answers: the first two
    keep their processes, and the job ends at world 3. Once it ended, the address is no longer given."""
    rdzv = rendezvous("2", 0)
    registry = f"127.0.0.1:{rdzv.port}"
    # the startup script leaves torchrun's shared agent store on for a job that is not elastic
    env = {**SNAPSHOTS, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0", "SPOTGUARD_JOIN_REGISTRY": registry}
    args, ckpt = ["--steps", "80", "--step-time", "0.1", "--in-process"], str(tmp_path / "ckpt")
    nodes = [rdzv.join(i, ckpt, tmp_path, args, env) for i in range(2)]
    try:
        deadline = time.monotonic() + 120
        while main(["join-address", registry, "--job", "job", "--timeout", "5"]) != 0:
            assert time.monotonic() < deadline and all(n.proc.poll() is None for n in nodes), nodes[0].tail()
            time.sleep(0.5)
        address = capsys.readouterr().out.strip()
        pids = [worker_pids(n) for n in nodes]
        joining = {**CHECKOUT, **SNAPSHOTS, "SPOTGUARD_JOIN": address}
        nodes.append(Node(2, ["--standalone"], EXAMPLE, ckpt, tmp_path, args, joining))
        codes = [n.finish(180) for n in nodes]
    finally:
        stop_all(nodes)
    assert codes == [0, 0, 0], "\n".join(n.tail() for n in nodes)
    joined = re.compile(
        r"in-process recovery: generation 1, world 2 -> 3, rank\(s\) 2 joined: this process \(pid (\d+)\)"
    )
    found = [joined.search(n.output()) for n in nodes]
    assert all(found), "\n".join(n.tail() for n in nodes)
    for node, match, before in zip(nodes[:2], found, pids):
        assert int(match[1]) in before  # the first two nodes' processes train on
        assert "Starting worker group" not in node.output().split("in-process recovery")[1]  # no torchrun restart
    assert main(["join-address", registry, "--job", "job", "--timeout", "5"]) == 1  # the job ended: start as usual


def test_a_node_the_job_cannot_take_in_is_refused_and_the_job_trains_on(tmp_path):
    """A job without snapshots has nothing in its memory for a joining node to load: the node is refused
    with why, and ends; the job never stops for it."""
    args = ["--steps", "60", "--step-time", "0.1", "--in-process"]
    ckpt, go = str(tmp_path / "ckpt"), tmp_path / "go"
    nodes = start_nodes(2, ckpt, tmp_path, args)
    nodes.append(join_node(nodes[0], 2, ckpt, tmp_path, args, {"SPOTGUARD_TEST_GO": str(go)}, script=JOINING))
    try:
        nodes[0].step_reached(2)
        go.touch()
        assert nodes[2].finish(120) != 0
        codes = [n.finish(180) for n in nodes[:2]]
    finally:
        stop_all(nodes)
    assert codes == [0, 0], "\n".join(n.tail() for n in nodes)
    assert "refused node 1: the job takes no snapshots (a joining node loads its state from the nodes' memory)" in (
        nodes[2].output()
    ), nodes[2].tail()
    assert "node 1 cannot join" in nodes[0].output()
    assert "in-process recovery" not in nodes[0].output() + nodes[1].output()


def test_a_node_that_dies_once_taken_in_is_left_behind_and_the_job_goes_on_in_its_processes(tmp_path):
    """The joining node is taken in, then dies before the new generation forms (injected): its members never
    come, and the job's own members form the generation after it without it and train on, in their processes,
    not restarted (before: every survivor exited 75)."""
    out, go = tmp_path / "out.json", tmp_path / "go"
    args = ["--steps", "60", "--step-time", "0.1", "--in-process", "--out", str(out)]
    ckpt = str(tmp_path / "ckpt")
    env = {**SNAPSHOTS, "SPOTGUARD_TEST_FORM_TIMEOUT": "5"}
    nodes = start_nodes(2, ckpt, tmp_path, args, env, script=JOINING)
    vanishing = {**env, "SPOTGUARD_TEST_VANISH": "1", "SPOTGUARD_TEST_GO": str(go)}
    nodes.append(join_node(nodes[0], 2, ckpt, tmp_path, args, vanishing, script=JOINING))
    try:
        nodes[0].step_reached(2)
        pids = [worker_pids(n) for n in nodes[:2]]
        go.touch()
        codes = [n.finish(180) for n in nodes]
    finally:
        stop_all(nodes)
    assert codes[:2] == [0, 0] and codes[2] != 0, "\n".join(n.tail() for n in nodes)
    assert "taken in, vanishing" in nodes[2].output()
    for node, before in zip(nodes[:2], pids):
        text = node.output()
        assert "generation 1 with the joining node(s) was not formed (FormError" in text, node.tail()
        found = re.search(r"in-process recovery: generation 2, world 2 -> 2, the joining node\(s\) never came: "
                          r"this process \(pid (\d+)\)", text)  # fmt: skip
        assert found and int(found[1]) in before, node.tail()
    assert json.loads(out.read_text())["start"] > 0


def test_under_an_elastic_agent_the_leaving_agent_is_withdrawn_and_the_survivors_go_on_in_their_processes(tmp_path):
    """An elastic job (c10d rendezvous, --nnodes 2:3, restarts allowed): the node of rank 2 is reclaimed. Its
    worker exits 0 and its agent is stopped, so that it neither starts the worker again nor closes the
    rendezvous; the survivors keep their processes, no agent restarts its workers, and the job ends where two
    fresh nodes resuming the emergency step end."""
    rdzv = rendezvous("2:3", max_restarts=3)
    ckpt, out = str(tmp_path / "ckpt"), tmp_path / "out.json"
    args = [*BASE, "--in-process", "--log-samples", "--out", str(out)]
    nodes = [rdzv.join(i, ckpt, tmp_path, args, SNAPSHOTS) for i in range(3)]
    try:
        nodes[0].wait_for(r'"step": 6, "rank": \d, "world": 3')
        # The rendezvous numbers the nodes: the one of rank 2 leaves (rank 0's keeps the workers' store).
        (leaving,) = [n for n in nodes if any('"rank": 2, "world": 3' in line for line in list(n.lines))]
        survivors = [n for n in nodes if n is not leaving]
        pids = [worker_pids(n) for n in survivors]
        leaving.emulator.raise_notice()
        workers_ended(survivors, timeout=180)
        leaving.finish(60)
    finally:
        stop_all(nodes)
    for node, before in zip(survivors, pids):
        found = RECOVERED.search(node.output())
        assert found and found[1] == "left after a notice" and int(found[2]) in before, node.tail()
        assert "Starting worker group" not in node.output().split("in-process recovery")[1]  # no restart
    exit_file = json.loads(leaving.exit_file.read_text())
    assert (exit_file["exit_code"], exit_file["leaving"], exit_file["job_goes_on"]) == (0, True, True)
    assert "leaving the elastic job: this node is reclaimed; stopped this node's torchrun agent" in leaving.output()
    assert worker_exit_code(leaving) == 0
    step = int(RECOVERED.search(survivors[0].output())[4])
    ended = json.loads(out.read_text())
    assert ended["start"] == step + 1
    fresh = tmp_path / "restart"
    shutil.copytree(tmp_path / "ckpt", fresh / "ckpt")
    assert run_nodes(2, fresh / "ckpt", fresh, BASE, fresh / "out.json") == ended
