"""Silent failures of a whole job: three torchrun agents as nodes on 127.0.0.1 (spotguard.demo.localnodes),
each rank a DDP worker over gloo (tests/silent_worker.py). A rank stuck in its data loading ends the job,
its stack in its log and its rank named; the false alarms the defaults must never raise, each made as it
happens in the field (a long step, an evaluation, a save in progress, a store that stops answering for
10 s), with the timeouts scaled down so that each would fire if it counted. A frozen node, and the
relaunch that resumes from the peers' memory, are in test_snapshots_multinode.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from spotguard.demo import localnodes

ROOT = Path(__file__).resolve().parent.parent
WORKER = [str(ROOT / "tests" / "silent_worker.py")]
CHECKOUT = {"PYTHONPATH": str(ROOT)}
ENDED = ("declared lost", "silent-failure", "the job hung")


def start(tmp: Path, args: list[str], env: dict[str, str]) -> list[localnodes.LocalNode]:
    return localnodes.start_nodes(3, WORKER, str(tmp / "ckpt"), tmp, args, {**CHECKOUT, **env})


def finish(nodes: list[localnodes.LocalNode], timeout: float = 180) -> tuple[list[int], str]:
    try:
        codes = [node.finish(timeout) for node in nodes]
    finally:
        localnodes.stop_all(nodes)
    return codes, "\n".join(node.output() for node in nodes)


def exit_files(nodes: list[localnodes.LocalNode]) -> list[dict]:
    return [json.loads(node.exit_file.read_text()) for node in nodes]


def ledger(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "ckpt" / "spotguard-ledger.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("in_store", [False, True], ids=["lock", "store-wait"])
def test_a_rank_stuck_in_its_data_loading_ends_the_job_with_its_stack_and_its_rank_named(tmp_path, in_store):
    """Rank 1 never returns from its data loader at step 10; ranks 0 and 2 wait for it in DDP's
    allreduce (gloo: 30 minutes). With SPOTGUARD_HANG_TIMEOUT=5 every rank ends with the restart code:
    every rank's stacks in its log (rank 1's in next_batch), rank 0's report naming rank 1 (the others
    wait inside torch, it does not), the exit files and the ledger saying so. Stuck in a wait on the job's
    store client (which serves one request at a time), rank 1 still announces the hang and reports."""
    hang = ["--hang-rank", "1", "--hang-at", "10", *(["--hang-in-store"] if in_store else [])]
    nodes = start(tmp_path, ["--steps", "100000", *hang], {"SPOTGUARD_HANG_TIMEOUT": "5"})
    nodes[0].step_reached(9)
    stuck = time.monotonic()
    codes, text = finish(nodes, timeout=120)
    assert time.monotonic() - stuck < 60  # a hang bound: 5 s and the report's few seconds in fact
    assert codes == [1, 1, 1]  # torchrun's code for a failed worker; the worker's is in the exit file
    assert [(f["exit_code"], f["committed"], f["cause"], f["culprit"]) for f in exit_files(nodes)] == [
        (75, False, "hang", "rank 1")
    ] * 3
    node1 = "\n".join(nodes[1].lines)
    assert "stacks of every thread (rank 1, the job hung" in node1
    assert "in next_batch" in node1  # where it is stuck, in its own log
    assert "hang report of 3 rank(s); rank 1: outside torch while the others wait in it" in text
    silent = [r for r in ledger(tmp_path) if r["event"] == "silent-failure"]
    assert [(r["cause"], r["culprit"], r["last_step"]) for r in silent] == [("hang", "rank 1", 9)]
    assert ledger(tmp_path)[-1]["event"] == "exit" and ledger(tmp_path)[-1]["code"] == 75


def test_no_node_is_lost_for_a_long_step_an_evaluation_a_save_or_a_store_that_stops_answering(tmp_path):
    """peer_timeout_s=2 (the default is 20): a step of 8 s, an evaluation of 8 s that nobody declared, a
    save whose state takes 8 s to copy, and the store frozen for 10 s (node 0's torchrun agent, which
    hosts it, SIGSTOPped: a probe's `add` waits until it thaws). None of them is a lost node: the job
    trains to its end and every rank exits 0."""
    nodes = start(
        tmp_path,
        ["--steps", "40", "--long-step-at", "5", "--long-step-s", "8", "--eval-at", "12", "--eval-s", "8",
         "--save-every", "20", "--slow-state-s", "8"],
        {"SPOTGUARD_PEER_TIMEOUT": "2"},
    )  # fmt: skip
    try:
        nodes[0].step_reached(30, timeout=120)
        store_port = int(_arg(nodes[0].proc.args, "--master-port"))
        probe = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=60))
        answered: list[float] = []
        nodes[0].proc.send_signal(signal.SIGSTOP)  # the agent alone: its workers train on
        frozen = time.monotonic()
        threading.Thread(target=lambda: (probe.add("probe", 1), answered.append(time.monotonic())),
                         daemon=True).start()  # fmt: skip
        time.sleep(10)
        nodes[0].proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not answered and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        codes, text = finish(nodes)
    assert answered and answered[0] - frozen >= 9.5  # the store really did not answer
    assert codes == [0, 0, 0], text[-4000:]
    assert text.count("(lost after 2 s of silence)") == 3  # every node was watched
    assert not [line for line in text.splitlines() if any(word in line for word in ENDED)]


def test_no_hang_for_a_declared_evaluation_or_a_save_in_progress(tmp_path):
    """hang_timeout_s=3: an evaluation of 8 s declared with guard.long_phase(), and saves whose state takes
    6 s to copy on the training thread (spotguard's own work is never timed). The job trains to its end."""
    nodes = start(
        tmp_path,
        ["--steps", "30", "--eval-at", "8", "--eval-s", "8", "--declare", "--save-every", "15", "--slow-state-s", "6"],
        {"SPOTGUARD_HANG_TIMEOUT": "3"},
    )  # fmt: skip
    codes, text = finish(nodes)
    assert codes == [0, 0, 0], text[-4000:]
    assert not [line for line in text.splitlines() if any(word in line for word in ENDED)]
    assert "long-phase" in text and "what=evaluation" in text


def test_a_node_that_goes_silent_after_its_notice_is_leaving_not_lost(tmp_path):
    """Node 1 is reclaimed (its cloud's notice) and its VM stops answering before its processes end
    (frozen as soon as both nodes agreed on the step to save at). peer_timeout_s=2: node 0 takes the
    silence for the departure it was told of, saves without node 1 and exits as after any reclaim, not on
    a lost node. The save takes 4 s (a state slow to copy), so node 0 is still there when the silence is
    noticed: a small state is saved and the process gone before 2 s of silence. (Frozen before it could
    agree, the round aborts, the job would train on, and the silence is a loss again: test_health.py.)"""
    nodes = localnodes.start_nodes(2, WORKER, str(tmp_path / "ckpt"), tmp_path,
                                   ["--steps", "100000", "--slow-state-s", "4"],
                                   {**CHECKOUT, "SPOTGUARD_PEER_TIMEOUT": "2"})  # fmt: skip
    try:
        nodes[0].step_reached(5)
        nodes[1].emulator.raise_notice()
        nodes[0].wait_for(r"round \d+: all 2 ranks agreed on step", timeout=60)
        nodes[1].freeze()
        code = nodes[0].finish(120)
        text = nodes[0].output()
    finally:
        localnodes.stop_all(nodes)
    assert code != 0 and "is silent after its notice: leaving, not lost" in text, text[-3000:]
    ended = json.loads(nodes[0].exit_file.read_text())
    assert ended["cause"] == "interruption" and ended["exit_code"] in (143, 75)
    assert not [line for line in text.splitlines() if any(word in line for word in ENDED)]


def _arg(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


@pytest.mark.parametrize("kind", ["guard", "lightning", "hf"])
def test_an_evaluation_that_beats_per_batch_is_no_hang(tmp_path, kind):
    """hang_timeout_s=2 and 5 s of evaluation between two training steps, each batch a heartbeat: through
    guard.heartbeat(), Lightning's validation loop, the Hugging Face Trainer's evaluation. The run ends."""
    done = _heartbeat_run(tmp_path, kind)
    assert done.returncode == 0 and "finished" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert "no training step for" not in done.stderr
    declared = {"lightning": ["what=Lightning's checkpoint", "what=the end of training"],
                "hf": ["what=the Trainer's save", "what=the end of training"]}.get(kind, [])  # fmt: skip
    assert all(what in done.stderr for what in declared)  # the framework's own work between steps


def test_the_same_evaluation_without_heartbeats_is_a_hang_of_the_only_rank(tmp_path):
    done = _heartbeat_run(tmp_path, "none")
    assert done.returncode == 75 and "finished" not in done.stdout
    assert "no training step for" in done.stderr and "stacks of every thread (rank 0" in done.stderr
    ended = json.loads((tmp_path / "exit.json").read_text())
    assert (ended["cause"], ended["culprit"], ended["committed"]) == ("hang", "rank 0", False)


def test_a_guard_entered_again_does_not_time_its_resume(tmp_path):
    """hang_timeout_s=2, a guard entered twice, each time 5 s before its first step: never a hang."""
    done = _heartbeat_run(tmp_path, "reenter")
    assert done.returncode == 0 and "finished" in done.stdout, done.stderr[-3000:]


def test_a_hang_after_a_rank_left_its_guard_ends_the_rank_that_saw_it(tmp_path):
    """Rank 0 left its guard (a crash): no listener reads the job's events any more, so rank 1, whose loop
    then stops, ends on its own instead of announcing to nobody."""
    done = _heartbeat_run(tmp_path, "left")
    assert done.returncode == 75, done.stderr[-3000:]
    assert "no rank reads the job's events any more" in done.stderr


def _heartbeat_run(tmp: Path, kind: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "tests" / "heartbeat_worker.py"), kind, str(tmp / "ckpt"), str(tmp / "out")]
    env = {**os.environ, **CHECKOUT, "SPOTGUARD_EXIT_FILE": str(tmp / "exit.json")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp)
