"""The health watches never end a healthy job, never end it twice the same way, and cannot be blinded by
the process they watch: torchrun agents on 127.0.0.1 running DDP workers over gloo
(tests/silent_worker.py), and one process whose output pipe nobody drains."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from spotguard.demo import localnodes
from spotguard.ending.exit_policy import NO_RESTART_EXIT_CODE

ROOT = Path(__file__).resolve().parent.parent
WORKER = [str(ROOT / "tests" / "silent_worker.py")]
CHECKOUT = {"PYTHONPATH": str(ROOT)}
ENDED = ("declared lost", "silent-failure", "the job hung")


def ledger(tmp: Path) -> list[dict]:
    lines = (tmp / "ckpt" / "spotguard-ledger.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]  # a record in rank 0's place starts a line


def one_node(tmp: Path, args: list[str], env: dict[str, str], **kwargs) -> localnodes.LocalNode:
    (node,) = localnodes.start_nodes(1, WORKER, str(tmp / "ckpt"), tmp, args, {**CHECKOUT, **env}, **kwargs)
    return node


def test_a_phase_declared_on_one_rank_holds_every_ranks_watch(tmp_path):
    """Rank 0 evaluates for 12 s, declared with guard.long_phase(); rank 1 waits for it in the next step's
    allreduce without declaring anything. hang_timeout_s=4: the phase is the job's, the job trains on."""
    node = one_node(tmp_path, ["--steps", "20", "--eval-at", "7", "--eval-s", "12", "--eval-rank", "0", "--declare"],
                    {"SPOTGUARD_HANG_TIMEOUT": "4"}, nproc_per_node=2)  # fmt: skip
    try:
        code = node.finish(180)
        text = node.output()
    finally:
        localnodes.stop_all([node])
    assert code == 0, text[-4000:]
    assert not [line for line in text.splitlines() if any(word in line for word in ENDED)]


def test_an_undeclared_phase_longer_than_the_timeout_is_not_restarted_into_the_same_end(tmp_path):
    """A 12 s evaluation after step 7 that nobody declared, hang_timeout_s=4, and a scheduler that starts the
    job again while its exit file says 75: the first start ends as a hang at step 7 (75: restart me); the
    second hangs at step 7 again and ends with the no-restart code, saying what to declare, so the
    scheduler stops: two hangs in the ledger, where every start would otherwise add one more."""
    codes = []
    text = ""
    for _ in range(3):  # the scheduler's restarts
        node = one_node(tmp_path, ["--steps", "20", "--eval-at", "7", "--eval-s", "12"],
                        {"SPOTGUARD_HANG_TIMEOUT": "4"}, nproc_per_node=2)  # fmt: skip
        try:
            node.finish(180)
            text = node.output()
        finally:
            localnodes.stop_all([node])
        codes.append(json.loads(node.exit_file.read_text())["exit_code"])
        node.exit_file.unlink()
        if codes[-1] != 75:
            break
    assert codes == [75, NO_RESTART_EXIT_CODE], text[-4000:]
    hangs = [r for r in ledger(tmp_path) if r["event"] == "silent-failure"]
    assert [(r["cause"], r["last_step"], r.get("repeated", False)) for r in hangs] == [
        ("hang", 7, False), ("hang", 7, True)]  # fmt: skip
    assert "declare it (guard.long_phase(seconds)" in text
    assert [r["code"] for r in ledger(tmp_path) if r["event"] == "exit"] == [75, NO_RESTART_EXIT_CODE]


def test_a_frozen_rank_0_is_named_and_the_end_recorded_by_another_rank(tmp_path):
    """Rank 0 is SIGSTOPped (its process alone) while rank 1 waits for it in the allreduce. hang_timeout_s=4:
    rank 0 can neither judge nor write anything, so rank 1 claims the judging, names rank 0, and writes the
    node's exit file and the ledger's records before it ends with the restart code."""
    node = one_node(tmp_path, ["--steps", "100000"], {"SPOTGUARD_HANG_TIMEOUT": "4"}, nproc_per_node=2)
    try:
        node.step_reached(5)
        pid = next(json.loads(line)["pid"] for line in node.lines if line.startswith('{"step"'))
        os.kill(pid, signal.SIGSTOP)
        said = node.wait_for("ending this process with code 75", timeout=90)
        assert said is not None, node.tail()
        time.sleep(1.0)
        ended = json.loads(node.exit_file.read_text())
        silent = [r for r in ledger(tmp_path) if r["event"] == "silent-failure"]
    finally:
        localnodes.stop_all([node])
    text = "\n".join(node.lines)
    assert "rank 0 gave no verdict on the hang: rank 1 judged in its place" in text
    assert "hang report of 1 rank(s); rank 0: did not answer (every thread stuck)" in text
    assert (ended["exit_code"], ended["cause"], ended["culprit"]) == (75, "hang", "rank 0")
    assert [(r["cause"], r["culprit"]) for r in silent] == [("hang", "rank 0")]
    segments = {r["segment"] for r in ledger(tmp_path)}
    assert len(segments) == 1  # recorded into rank 0's segment, after its records


FULL_PIPE = textwrap.dedent(
    """
    import logging, sys, time, torch, spotguard
    logging.basicConfig(level=logging.INFO)
    with spotguard.Guard(sys.argv[1], cloud="none", hang_timeout_s=3) as guard:
        state = {"w": torch.zeros(2)}
        for step in range(guard.resume(state), 100000):
            print("x" * 1024, flush=True)  # blocks for good once the pipe is full
            guard.step(step, state)
    """
)


def test_a_rank_stuck_on_a_full_output_pipe_still_ends(tmp_path):
    """stdout and stderr on one pipe that nobody drains (a stalled `| tee`, a launcher that does not read its
    worker): the loop blocks in a print, and so does every log line. The hang is still concluded, and the
    process ends with the restart code and its exit file, without a log line getting through."""
    exit_file = tmp_path / "exit.json"
    env = {**os.environ, **CHECKOUT, "SPOTGUARD_EXIT_FILE": str(exit_file)}
    proc = subprocess.Popen([sys.executable, "-c", FULL_PIPE, str(tmp_path / "ckpt")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, cwd=tmp_path)  # fmt: skip
    try:
        code = proc.wait(timeout=120)  # a hang bound: the timeout, then the end's backstop (20 s)
    finally:
        proc.kill()
        proc.stdout.close()
    assert code == 75
    ended = json.loads(exit_file.read_text())
    assert (ended["exit_code"], ended["cause"]) == (75, "hang")
