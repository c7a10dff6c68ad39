"""The whole product under real torchrun: an interruption (AWS emulator, or SIGTERM to the
launcher) at a random step, an emergency save, a resume in new processes, and final weights
bit-identical to a run that was never interrupted (invariants 1, 2 and 5)."""

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cloud_adapters.aws.emulator import AWSMetadataEmulator
from spotguard.checkpoint import list_checkpoints
from spotguard.cli import main
from tests.conftest import backend_for

ROOT = Path(__file__).resolve().parents[1]
STEPS = 40


def torchrun(ckpt, out=None, cloud="none", env=None, extra=()):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        str(ROOT / "examples" / "train_ddp.py"),
        "--checkpoint-dir",
        str(ckpt),
        "--steps",
        str(STEPS),
        "--cloud",
        cloud,
        "--step-time",
        "0.05",
        *extra,
    ]
    if out:
        cmd += ["--out", str(out)]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )


def wait_for_step(proc, step):
    for line in proc.stdout:
        if line.startswith("{") and json.loads(line)["step"] >= step:
            return
    pytest.fail(f"training ended before step {step}: {proc.stderr.read()[-3000:]}")


def finish(proc, timeout=180):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    code, err = finish(torchrun(tmp / "ckpt", out=tmp / "ref.json"))
    assert code == 0, err[-3000:]
    return json.loads((tmp / "ref.json").read_text())["digest"]


def resume_and_compare(ckpt, tmp_path, reference, extra=()):
    """Resume in new processes (with `extra`, e.g. an empty --local-dir: a fresh VM) and finish."""
    code, err = finish(torchrun(ckpt, out=tmp_path / "resumed.json", extra=extra))
    assert code == 0, err[-3000:]
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed["start"] > 0
    assert resumed["digest"] == reference
    return resumed


def assert_ledger(ckpt, step, action, capsys):
    """`spotguard report` on the ledger rank 0 wrote across the interrupted and the resumed run."""
    capsys.readouterr()
    assert main(["report", str(ckpt), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["segments"], summary["interruptions"], summary["steps_lost"], summary["torn_lines"]) == (2, 1, 0, 0)
    [x] = summary["interruption_details"]
    assert (x["action"], x["agreed_step"], x["committed"], x["exact"]) == (action, step, True, True)
    assert x["margin_s"] > 0 and x["time_to_resume_s"] > 0
    first, second = summary["segment_details"]
    assert (first["ended"], first["exit_code"], first["last_step"]) == ("interrupted", 143, step)
    assert (second["ended"], second["first_step"], second["last_step"]) == ("finished", step + 1, STEPS - 1)
    assert 0 < summary["goodput"] < 1


@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])
def test_aws_interruption_at_a_random_step_resumes_bit_identical(
    kind, tmp_path, reference, storage_servers, monkeypatch, capsys
):
    backend = backend_for(kind, storage_servers, monkeypatch, tmp_path)
    ckpt = backend.url if kind != "local" else tmp_path / "ckpt"
    # With a bucket, each "VM" stages on its own local disk; the replacement starts empty.
    vm1 = ["--local-dir", str(tmp_path / "vm1")] if kind != "local" else []
    vm2 = ["--local-dir", str(tmp_path / "vm2")] if kind != "local" else []
    at = random.Random().randint(2, 25)
    with AWSMetadataEmulator() as emu:
        # Slower steps: the notice (polled every second) must come before the job's end, also on a busy machine.
        proc = torchrun(ckpt, cloud="aws", env={"SPOTGUARD_METADATA_URL": emu.url}, extra=[*vm1, "--step-time", "0.2"])
        wait_for_step(proc, at)
        emu.raise_notice()
        code, err = finish(proc)
    assert code != 0  # the workers exited 143: torchrun reports the job as failed, to be restarted
    committed = [c for c in list_checkpoints(str(ckpt)) if c.committed]
    assert len(committed) == 1 and committed[0].reason == "emergency", err[-3000:]
    assert at <= committed[0].step < STEPS - 1
    resumed = resume_and_compare(ckpt, tmp_path, reference, extra=vm2)
    assert resumed["start"] == committed[0].step + 1
    assert_ledger(ckpt, committed[0].step, "terminate", capsys)


def test_sigterm_to_the_launcher_takes_the_same_emergency_path(tmp_path, reference, capsys):
    ckpt = tmp_path / "ckpt"
    proc = torchrun(ckpt)
    wait_for_step(proc, random.Random().randint(2, 25))
    proc.send_signal(signal.SIGTERM)  # what Kubernetes or Slurm sends; torchrun forwards it to the workers
    code, err = finish(proc)
    assert code != 0
    committed = [c for c in list_checkpoints(str(ckpt)) if c.committed]
    assert [c.reason for c in committed] == ["emergency"], err[-3000:]
    resume_and_compare(ckpt, tmp_path, reference)
    assert_ledger(ckpt, committed[0].step, "SIGTERM", capsys)


def test_the_example_prints_each_step_line_in_one_write(monkeypatch):
    """With stdout unbuffered, a line written in two pieces lets a log line (stderr, the same pipe
    under the multi-node harness) land inside it, and the harness could not read the step."""
    import importlib.util
    import io

    spec = importlib.util.spec_from_file_location("train_ddp", Path(__file__).parents[1] / "examples" / "train_ddp.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    writes = []

    class Recorder(io.StringIO):
        def write(self, text):
            writes.append(text)
            return len(text)

    monkeypatch.setattr("sys.stdout", Recorder())
    example.say({"step": 3, "loss": 0.5})
    assert [w for w in writes if w] == ['{"step": 3, "loss": 0.5}\n']
