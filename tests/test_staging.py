"""Background saves copy the state into host buffers allocated once and reused: the copy is the
values of its step whatever training does next, buffers follow a changing state, DTensors keep
their placement, and a Checkpointer's successive background saves each commit their own values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch

from spotguard.checkpoint import Checkpointer
from spotguard.checkpoint.io.staging import Stager
from tests.ckpt_workers import ROOT


def test_buffers_are_reused_and_hold_the_values_of_their_step():
    state = {"w": torch.randn(1000), "opt": {"m": torch.randn(10, 20).t(), "step": 3}, "l": [torch.ones(4)]}
    stager = Stager()
    first = stager.stage(state)
    pointers = (first["w"].data_ptr(), first["opt"]["m"].data_ptr(), first["l"][0].data_ptr())
    state["w"].add_(1.0)  # the next optimizer step
    assert not torch.equal(first["w"], state["w"])  # the staged copy is the step's own
    second = stager.stage(state)
    assert (second["w"].data_ptr(), second["opt"]["m"].data_ptr(), second["l"][0].data_ptr()) == pointers
    assert torch.equal(second["w"], state["w"]) and torch.equal(second["opt"]["m"], state["opt"]["m"])
    assert second["opt"]["step"] == 3 and second["opt"] is not state["opt"]


def test_a_changing_state_gets_new_buffers_and_drops_unused_ones():
    stager = Stager()
    stager.stage({"a": torch.zeros(100), "b": torch.zeros(50)})
    assert stager.nbytes == 600
    staged = stager.stage({"a": torch.ones(200), "c": torch.ones(10, dtype=torch.float64)})  # a grew, b went
    assert torch.equal(staged["a"], torch.ones(200)) and staged["c"].dtype == torch.float64
    assert stager.nbytes == 200 * 4 + 10 * 8


DTENSOR = textwrap.dedent("""
    import json, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from spotguard.checkpoint.io.staging import Stager
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    mesh = init_device_mesh("cpu", (1,))
    w = DTensor.from_local(torch.arange(6.0).reshape(2, 3), mesh, [Shard(0)])
    stager = Stager()
    first = stager.stage({"w": w})["w"]
    ptr = first.to_local().data_ptr()
    w.to_local().mul_(10)
    second = stager.stage({"w": w})["w"]
    print(json.dumps({
        "type": type(second).__name__, "placements": str(second.placements),
        "reused": second.to_local().data_ptr() == ptr, "values": second.to_local().flatten().tolist(),
    }))
""")


def test_a_dtensor_is_staged_as_its_local_shard_with_its_placement():
    done = subprocess.run(
        [sys.executable, "-c", DTENSOR],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"type": "DTensor", "placements": "(Shard(dim=0),)", "reused": True,
                   "values": [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]}  # fmt: skip


def test_successive_background_saves_each_commit_their_own_values(tmp_path):
    state = {"w": torch.zeros(1 << 18)}
    with Checkpointer(str(tmp_path)) as ckpt:
        for step in (1, 2, 3):
            state["w"].fill_(step)
            ckpt.save(step, state, reason="periodic", wait=False)  # waits for the previous one, then stages
            state["w"].fill_(-1.0)  # training goes on while the save writes
        ckpt.wait()
    for step in (1, 2, 3):
        restored = {"w": torch.empty(1 << 18)}
        with Checkpointer(str(tmp_path)) as ckpt:
            for newer in range(step + 1, 4):  # hide the newer steps from resume
                (tmp_path / f"step-{newer:010d}" / "spotguard.json").rename(tmp_path / f"m{newer}")
            assert ckpt.resume(restored) == step
            for newer in range(step + 1, 4):
                (tmp_path / f"m{newer}").rename(tmp_path / f"step-{newer:010d}" / "spotguard.json")
        assert torch.equal(restored["w"], torch.full((1 << 18,), float(step)))
