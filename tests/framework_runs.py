"""Run an example training script (2 CPU processes, under real torchrun or the framework's own
launcher), interrupt it at random steps, resume it, and compare it with a run that never stopped:
what the framework tests share.

The examples print `{"rank", "pid", "step"}` after each step, wait after the step their
`--pause-file` names until it is removed (examples/example_cli.py), and write their final weights'
digest to `--out`. The pause makes the interruption land at the chosen step however fast or slow
the machine is: both ranks wait after that step, the test delivers the interruption and removes
the file once both have agreed on the step to stop at (the next one they finish: the paused one);
nothing depends on how many steps fit in some number of seconds.
"""

import contextlib
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cloud_adapters.aws.emulator import AWSMetadataEmulator
from spotguard.checkpoint import list_checkpoints
from spotguard.checkpoint.format.layout import MANIFEST_NAME, step_dir_name

ROOT = Path(__file__).resolve().parents[1]
PROGRESS = re.compile(r'\{"rank": \d+, "pid": \d+, "step": \d+\}')  # both ranks share one pipe
HANG_S = 180  # bounds a hung run only: generous, the machine may be loaded
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0")


class Run:
    """One launch of an example; its output is read on a thread, so a hung run cannot block the test."""

    def __init__(self, script, tmp, cloud="none", env=None, launcher=TORCHRUN, args=()):
        cmd = [*launcher, str(ROOT / "examples" / script), "--checkpoint-dir", str(tmp / "ckpt")]
        cmd += ["--cloud", cloud, "--pause-file", str(tmp / "pause"), "--out", str(tmp / "out.json"), *args]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "SPOTGUARD_EXIT_FILE": str(tmp / "exit.json"), **(env or {})}
        (tmp / "cwd").mkdir(exist_ok=True)  # the framework's own output goes here
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=tmp / "cwd",
            start_new_session=True,  # so that a failed test can kill the launcher and its workers at once
        )
        self._lines: list[str] = []
        self._eof = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self._lines.append(line)
        self._eof.set()

    @property
    def out(self):
        return "".join(self._lines)

    def wait_for(self, done, what):
        """Poll until `done(output)`; fail with the output if the run ends or hangs first."""
        deadline = time.monotonic() + HANG_S
        while True:
            ended = self._eof.is_set()  # before reading the output: all of it is in by then
            if done(self.out):
                return
            if ended or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"{what}: not seen before the run ended or {HANG_S} s passed\n{self.out[-3000:]}")
            time.sleep(0.05)

    def kill(self, ranks=True):
        """SIGKILL the launcher's process group and (`ranks`) each rank it reported while the run's
        output is open, i.e. while they can still run: torchrun starts each worker in a session of its own."""
        if ranks and not self._eof.is_set():
            for s in steps_by_rank(self.out).values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(s[-1]["pid"], signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def finish(self):
        """The launcher's exit code and the whole output."""
        if not self._eof.wait(HANG_S):
            self.kill()
            pytest.fail(f"the run did not end within {HANG_S} s\n{self.out[-3000:]}")
        return self.proc.wait(), self.out


def steps_by_rank(out):
    steps = {}
    for m in PROGRESS.findall(out):
        p = json.loads(m)
        steps.setdefault(p["rank"], []).append(p)
    return steps


def reference_run(script, tmp, launcher, args=()):
    tmp.mkdir()
    code, out = Run(script, tmp, launcher=launcher, args=args).finish()
    assert code == 0, out[-3000:]
    return json.loads((tmp / "out.json").read_text())


def interrupted(script, tmp, launcher, at, interrupt, resumed_at, cloud="none", env=None, args=(), ranks=2):
    """Run from the newest committed step (`resumed_at` is the first step expected), pause every rank
    after step `at`, `interrupt(pids)`, go on once all agreed; the step committed (`at`)."""
    run = _agreed_after(script, tmp, launcher, at, interrupt, cloud, env, args, ranks)
    (tmp / "pause").unlink()
    code, out = run.finish()
    # torchrun reports 1 for its workers: the node's exit file says what they exited with.
    assert json.loads((tmp / "exit.json").read_text())["exit_code"] == 143, out[-3000:]
    (tmp / "exit.json").unlink()
    # The ranks paused before reporting step `at` to the Guard: the agreed step is `at` itself.
    assert out.count(f"all {ranks} ranks agreed on step {at} (emergency)") == ranks, out[-3000:]
    assert max(c.step for c in list_checkpoints(str(tmp / "ckpt")) if c.committed) == at, out[-3000:]
    firsts_and_lasts = {r: (s[0]["step"], s[-1]["step"]) for r, s in steps_by_rank(out).items()}
    assert firsts_and_lasts == {r: (resumed_at, at) for r in range(ranks)}, out[-3000:]
    return at


def killed_mid_save(script, tmp, launcher, at, resumed_at, args=(), ranks=2):
    """Run from the newest committed step (`resumed_at` is the first step expected); SIGTERM to rank 0
    after step `at`; once every rank agreed and the save's staging directory holds shard bytes,
    SIGKILL each rank (rank 0, which commits, first) and the launcher, as a VM taken back mid-write.
    What the staging directory holds once the ranks are gone (file name -> size)."""
    pidfds = []  # a pid read from the output may be reused once its process is gone; a pidfd is not

    def signal_rank_0(pids):
        pidfds.extend(os.pidfd_open(pids[r]) for r in sorted(pids))
        os.kill(pids[0], signal.SIGTERM)

    try:
        run = _agreed_after(script, tmp, launcher, at, signal_rank_0, "none", None, args, ranks)
        assert {r: s[0]["step"] for r, s in steps_by_rank(run.out).items()} == dict.fromkeys(range(ranks), resumed_at)
        (tmp / "pause").unlink()
        stage = _wait_for_shard_bytes(run, tmp / "ckpt", at)
        for fd in pidfds:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        run.kill(ranks=False)
        run.finish()
        for fd in pidfds:  # readable once that rank has exited
            assert select.select([fd], [], [], HANG_S)[0], f"a rank still runs {HANG_S} s after SIGKILL"
    finally:
        for fd in pidfds:
            os.close(fd)
    assert not (tmp / "ckpt" / step_dir_name(at)).exists(), f"step {at} was committed after all"
    return {e.name: e.stat().st_size for e in os.scandir(stage)}


def _wait_for_shard_bytes(run, ckpt, step):
    """The staging directory of `step`'s save once it holds shard bytes."""
    deadline = time.monotonic() + HANG_S
    while True:
        for stage in ckpt.glob(f".{step_dir_name(step)}.tmp-*"):
            try:
                if any(e.stat().st_size for e in os.scandir(stage) if e.name.endswith(".distcp")):
                    return stage
            except FileNotFoundError:  # committed (renamed) meanwhile
                pass
        if (ckpt / step_dir_name(step)).exists():
            run.kill()
            pytest.fail(f"the save of step {step} was committed before it could be killed: save a larger state")
        if run._eof.is_set() or time.monotonic() > deadline:
            run.kill()
            pytest.fail(f"the save of step {step} wrote nothing before the run ended or {HANG_S} s\n{run.out[-3000:]}")
        time.sleep(0.001)


def _agreed_after(script, tmp, launcher, at, interrupt, cloud, env, args, ranks):
    """A run paused after step `at` on every rank, interrupted, and agreed on the step to stop at."""
    (tmp / "pause").write_text(str(at))
    run = Run(script, tmp, cloud=cloud, env=env, launcher=launcher, args=args)
    run.wait_for(lambda out: _all_reached(out, at, ranks), f"all {ranks} ranks at step {at}")
    interrupt({r: s[-1]["pid"] for r, s in steps_by_rank(run.out).items()})
    # Each rank logs the round's result; only then may they go on to the step agreed.
    agreed = re.compile(rf"all {ranks} ranks agreed on step \d+ \(emergency\)")
    run.wait_for(lambda out: len(agreed.findall(out)) == ranks, "agreement")
    return run


def _all_reached(out, step, ranks):
    steps = steps_by_rank(out)
    return len(steps) == ranks and all(s[-1]["step"] == step for s in steps.values())


def notice_then_sigterm_then_finish(script, tmp, seed, first_step, last_step, launcher=TORCHRUN, args=(), kill=False):
    """An AWS notice at a random step, then (resumed) SIGTERM to rank 1 only at a later one; with
    `kill`, a save SIGKILLed mid-write in a third run (`args` must make it slow enough to catch);
    then the leftovers of a killed upload placed by hand. The last run resumes past them and ends
    equal to a run never interrupted."""
    reference = reference_run(script, tmp / "reference", launcher, args)
    tmp = tmp / "interrupted"
    tmp.mkdir()
    rng = random.Random(seed)
    with AWSMetadataEmulator() as emu:
        env = {"SPOTGUARD_METADATA_URL": emu.url}
        at = rng.randint(first_step + 1, last_step // 3)
        notice = lambda pids: emu.raise_notice()  # noqa: E731
        first = interrupted(script, tmp, launcher, at, notice, first_step, "aws", env, args)
    at = rng.randint(first + 2, 2 * last_step // 3)
    second = interrupted(script, tmp, launcher, at, lambda pids: os.kill(pids[1], signal.SIGTERM), first + 1, args=args)
    committed = [(c.step, c.reason) for c in list_checkpoints(str(tmp / "ckpt")) if c.committed]
    assert committed == [(first, "emergency"), (second, "emergency")]
    if kill:
        left = killed_mid_save(script, tmp, launcher, rng.randint(second + 1, last_step - 1), second + 1, args)
        assert MANIFEST_NAME not in left and any(n.endswith(".distcp") for n in left), left
    place_a_killed_save(tmp / "ckpt", second)  # a local kill leaves a hidden staging dir; a bucket, this

    code, out = Run(script, tmp, launcher=launcher, args=args).finish()
    assert code == 0, out[-3000:]
    assert {r: s[0]["step"] for r, s in steps_by_rank(out).items()} == {0: second + 1, 1: second + 1}, out[-3000:]
    assert json.loads((tmp / "out.json").read_text()) == reference


def sigterm_then_finish(script, tmp, launcher, args, ranks, first_step, at):
    """SIGTERM to the last rank after step `at`; the run resumed from it ends equal to a run never interrupted."""
    reference = reference_run(script, tmp / "reference", launcher, args)
    tmp = tmp / "interrupted"
    tmp.mkdir()

    def signal_last_rank(pids):
        os.kill(pids[ranks - 1], signal.SIGTERM)

    interrupted(script, tmp, launcher, at, signal_last_rank, first_step, args=args, ranks=ranks)
    code, out = Run(script, tmp, launcher=launcher, args=args).finish()
    assert code == 0, out[-3000:]
    assert {r: s[0]["step"] for r, s in steps_by_rank(out).items()} == {r: at + 1 for r in range(ranks)}, out[-3000:]
    assert json.loads((tmp / "out.json").read_text()) == reference


def saved_shards(ckpt, fqn):
    """Each saved chunk of `fqn` in the newest committed step: (its sizes, the file that holds it), by offset."""
    from torch.distributed.checkpoint import FileSystemReader

    newest = max((c for c in list_checkpoints(str(ckpt)) if c.committed), key=lambda c: c.step)
    metadata = FileSystemReader(newest.location).read_metadata()
    files = {tuple(k.offset): v.relative_path for k, v in metadata.storage_data.items() if k.fqn == fqn}
    chunks = sorted(metadata.state_dict_metadata[fqn].chunks, key=lambda c: tuple(c.offsets))
    return [(tuple(c.sizes), files[tuple(c.offsets)]) for c in chunks]


def place_a_killed_save(ckpt, step):
    """A later step as a save SIGKILLed mid-upload leaves it in a bucket (or a retention killed half-way,
    which deletes the manifest first): shards under the step's name, one cut short, no manifest."""
    killed = ckpt / step_dir_name(step + 1)
    shutil.copytree(ckpt / step_dir_name(step), killed)
    (killed / MANIFEST_NAME).unlink()
    shard = next(killed.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
