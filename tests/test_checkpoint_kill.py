"""A rank SIGKILLed at chosen moments of a 128 MiB two-rank save: resume never sees a half-written step."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from spotguard.checkpoint import Checkpointer, list_checkpoints
from tests.ckpt_workers import BIG_NUMEL, BIG_TENSORS, big_state, kill_all, launch

TOTAL = BIG_TENSORS * BIG_NUMEL * 4


def moment_reached(moment: str, files: dict[str, int]) -> bool:
    data = sum(size for name, size in files.items() if name.endswith(".distcp"))
    if moment == "before_data":
        return data == 0
    if moment == "mid_data":
        return 0.1 * TOTAL < data < 0.9 * TOTAL
    return ".metadata" in files  # before_manifest: every shard written, the manifest not yet


def watch_and_kill(ckpt: Path, moment: str, pid: int, timeout: float = 120) -> dict[str, int] | None:
    """Poll step 2's staging directory; SIGKILL `pid` the moment it looks as asked. What was there,
    or None when the save outran the watch (committed before the moment was seen)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for stage in ckpt.glob(".step-0000000002.tmp-*"):
            try:
                files = {e.name: e.stat().st_size for e in os.scandir(stage)}
            except FileNotFoundError:  # renamed or removed meanwhile
                continue
            if moment_reached(moment, files):
                os.kill(pid, signal.SIGKILL)
                return files
        if (ckpt / "step-0000000002").exists():
            return None
    raise AssertionError(f"{moment} not seen within {timeout}s")


def kill_at(tmp_path: Path, moment: str, victim: int) -> dict[str, int] | None:
    """One trial: two ranks save steps 1 and 2; `victim` is SIGKILLed at `moment` of step 2."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir(parents=True)
    procs = launch("big_save", 2, ckpt=str(ckpt), out=str(out))
    try:
        deadline = time.monotonic() + 120
        while not (out / "step-1.done").exists():
            assert all(p.poll() is None for p in procs), "a rank exited before step 1 was saved"
            assert time.monotonic() < deadline, "step 1 was not saved in time"
            time.sleep(0.01)
        seen = watch_and_kill(ckpt, moment, procs[victim].pid)
        if seen is not None:
            procs[victim].wait(10)
            assert procs[victim].returncode == -signal.SIGKILL
            time.sleep(1.0)  # let the survivor do whatever it still can
        return seen
    finally:
        kill_all(procs)


@pytest.mark.parametrize("moment", ["before_data", "mid_data", "before_manifest"])
def test_sigkill_during_save_leaves_the_previous_step_loadable(tmp_path, moment):
    # The coordinator is the one that writes the manifest: killing it is the interesting case just before.
    victim = 0 if moment == "before_manifest" else random.choice([0, 1])
    # On a loaded machine the save can outrun the watch (the moment is a few ms long): try again.
    for attempt in range(3):
        ckpt = tmp_path / f"try-{attempt}" / "ckpt"
        seen = kill_at(ckpt.parent, moment, victim)
        if seen is not None:
            break
    assert seen is not None, f"the save outran the watch for {moment} three times"

    committed = {i.step for i in list_checkpoints(str(ckpt)) if i.committed}
    if moment != "before_manifest":
        assert committed == {1}, (moment, victim, seen)
    state = {k: torch.zeros(BIG_NUMEL) for k in big_state(0)}
    with Checkpointer(str(ckpt)) as ck:
        step = ck.resume(state)
    # Killed just before the manifest, the step is either absent or complete: never half there.
    assert step == max(committed), (moment, victim, seen)
    for key, want in big_state(step).items():
        assert torch.equal(state[key], want), (key, moment, victim)
