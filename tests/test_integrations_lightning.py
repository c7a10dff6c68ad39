"""Lightning's Trainer (DDP, 2 CPU processes) with SpotGuardCallback: an AWS notice at a random step,
or SIGTERM to one rank only; every rank stops at the agreed step, the checkpoint is committed, the
next run resumes from the step after it and ends bit-identical to a run that never stopped; a step
without a manifest (a save killed before its commit) is never resumed from."""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("lightning")

from cloud_adapters.aws.emulator import AWSMetadataEmulator  # noqa: E402
from spotguard.checkpoint import MANIFEST_NAME, list_checkpoints, step_dir_name  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS = 24  # 3 epochs of 8 batches per rank
PROGRESS = re.compile(r'\{"rank": \d+, "pid": \d+, "step": \d+\}')  # both ranks share one pipe


def launch(tmp, cloud="none", env=None, step_time=0.0):
    cmd = [sys.executable, str(ROOT / "examples" / "lightning_train.py"), "--checkpoint-dir", str(tmp / "ckpt")]
    cmd += ["--root", str(tmp / "lightning"), "--cloud", cloud, "--step-time", str(step_time)]
    cmd += ["--out", str(tmp / "out.json")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def progress(proc):
    for line in proc.stdout:
        yield from (json.loads(m) for m in PROGRESS.findall(line))


def run_to_step(proc, step):
    """Read progress until a rank reports `step`; the pid of each rank."""
    pids = {}
    for p in progress(proc):
        pids[p["rank"]] = p["pid"]
        if p["step"] >= step and len(pids) == 2:
            return pids
    pytest.fail(f"training ended before step {step}")


def finish(proc, pids=()):
    """The launcher's exit code, once every rank (rank 1 is a child of rank 0) has gone."""
    out, _ = proc.communicate(timeout=120)
    for pid in pids:
        deadline = time.monotonic() + 60
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    return proc.returncode, out


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def first_step(out):
    return min(json.loads(m)["step"] for m in PROGRESS.findall(out))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    code, out = finish(launch(tmp))
    assert code == 0, out[-3000:]
    return json.loads((tmp / "out.json").read_text())


def interrupted_then_resumed(tmp, reference, interrupt, cloud="none", env=None):
    proc = launch(tmp, cloud=cloud, env=env, step_time=0.15)
    pids = run_to_step(proc, random.Random().randint(3, STEPS - 6))
    interrupt(pids)
    code, out = finish(proc, pids.values())
    assert code == 143, out[-3000:]
    assert out.count("emergency checkpoint committed") == 2, out[-3000:]  # both ranks, one step
    committed = [c for c in list_checkpoints(str(tmp / "ckpt")) if c.committed]
    assert [c.reason for c in committed] == ["emergency"], out[-3000:]
    step = committed[0].step
    # A later save killed before its manifest: its files are there, it must never be resumed from.
    killed = tmp / "ckpt" / step_dir_name(step + 1)
    shutil.copytree(tmp / "ckpt" / step_dir_name(step), killed)
    (killed / MANIFEST_NAME).unlink()

    code, out = finish(launch(tmp))
    assert code == 0, out[-3000:]
    assert first_step(out) == step  # global_step before the first resumed batch: the next one is step + 1
    assert json.loads((tmp / "out.json").read_text()) == reference


def test_aws_notice_at_a_random_step_stops_every_rank_and_resumes_bit_identical(tmp_path, reference):
    with AWSMetadataEmulator() as emu:
        interrupted_then_resumed(
            tmp_path, reference, lambda pids: emu.raise_notice(), "aws", {"SPOTGUARD_METADATA_URL": emu.url}
        )


def test_sigterm_to_one_rank_only_takes_the_same_path(tmp_path, reference):
    interrupted_then_resumed(tmp_path, reference, lambda pids: os.kill(pids[1], signal.SIGTERM))
