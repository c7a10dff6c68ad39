"""Run an example training script under real torchrun (2 CPU processes), interrupt it at a random
step, resume it, and compare it with a run that never stopped: what the framework tests share.

The examples print `{"rank", "pid", "step"}` after each step and write their final weights'
digest to `--out`."""

import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cloud_adapters.aws.emulator import AWSMetadataEmulator
from spotguard.checkpoint import list_checkpoints

ROOT = Path(__file__).resolve().parents[1]
PROGRESS = re.compile(r'\{"rank": \d+, "pid": \d+, "step": \d+\}')  # both ranks share one pipe


def launch(script, tmp, cloud="none", env=None, step_time=0.0):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", "0", str(ROOT / "examples" / script), "--checkpoint-dir", str(tmp / "ckpt")]
    cmd += ["--cloud", cloud, "--step-time", str(step_time), "--out", str(tmp / "out.json")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPOTGUARD_EXIT_FILE": str(tmp / "exit.json"), **(env or {})}
    cwd = tmp / "cwd"  # the framework's own output goes here
    cwd.mkdir(exist_ok=True)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)


def progress(proc):
    for line in proc.stdout:
        yield from (json.loads(m) for m in PROGRESS.findall(line))


def run_to_step(proc, step):
    """Read progress until a rank reports `step`; the pid of each rank, and the progress read."""
    pids, seen = {}, []
    for p in progress(proc):
        pids[p["rank"]] = p["pid"]
        seen.append(json.dumps(p))
        if p["step"] >= step and len(pids) == 2:
            return pids, "\n".join(seen)
    pytest.fail(f"training ended before step {step}")


def finish(proc):
    out, _ = proc.communicate(timeout=180)
    return proc.returncode, out


def steps_by_rank(out):
    steps = {}
    for m in PROGRESS.findall(out):
        p = json.loads(m)
        steps.setdefault(p["rank"], []).append(p["step"])
    return steps


def reference_run(script, tmp):
    code, out = finish(launch(script, tmp))
    assert code == 0, out[-3000:]
    return json.loads((tmp / "out.json").read_text())


def interrupted_then_resumed(script, tmp, reference, seed, last_step, interrupt, cloud="none", env=None):
    """Interrupt at a random step (`interrupt(pids)`), check the agreed stop and commit, resume, compare."""
    proc = launch(script, tmp, cloud=cloud, env=env, step_time=0.08)
    pids, seen = run_to_step(proc, random.Random(seed).randint(2, last_step - 3))
    interrupt(pids)
    code, out = finish(proc)
    out = f"{seen}\n{out}"
    # torchrun reports 1 for its workers; the node's exit file says what they exited with.
    assert json.loads((tmp / "exit.json").read_text())["exit_code"] == 143, out[-3000:]
    # torchrun SIGTERMs the other worker as soon as one exits 143, which may cut that worker's last log line.
    assert "emergency checkpoint committed" in out, out[-3000:]
    committed = [c for c in list_checkpoints(str(tmp / "ckpt")) if c.committed]
    assert [c.reason for c in committed] == ["emergency"], out[-3000:]
    step = committed[0].step
    assert {r: s[-1] for r, s in steps_by_rank(out).items()} == {0: step, 1: step}, out[-3000:]

    (tmp / "exit.json").unlink()
    code, out = finish(launch(script, tmp))
    assert code == 0, out[-3000:]
    assert {r: s[0] for r, s in steps_by_rank(out).items()} == {0: step + 1, 1: step + 1}, out[-3000:]
    assert json.loads((tmp / "out.json").read_text()) == reference


def aws_notice(script, tmp, reference, seed, last_step):
    with AWSMetadataEmulator() as emu:
        interrupted_then_resumed(
            script, tmp, reference, seed, last_step, lambda pids: emu.raise_notice(), "aws",
            {"SPOTGUARD_METADATA_URL": emu.url},
        )  # fmt: skip


def sigterm_to_rank_1(script, tmp, reference, seed, last_step):
    interrupted_then_resumed(script, tmp, reference, seed, last_step, lambda pids: os.kill(pids[1], signal.SIGTERM))
