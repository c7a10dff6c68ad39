"""CUDA tensors through the staged background save, the one-pass resume and an NCCL process group.

These need a CUDA device and are skipped without one (the CPU tests exercise the same code
paths on CPU tensors); they run where a GPU is present.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from spotguard.checkpoint import Checkpointer
from spotguard.checkpoint.format.layout import step_dir_name
from spotguard.demo.processes import free_port, rank_env
from tests.ckpt_workers import ROOT
from tests.framework_runs import sigterm_then_finish
from tests.test_checkpoint import flip_byte

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

NUMEL = 16 << 20  # 64 MiB per tensor: a copy that takes long enough for a race to show


def cuda_state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 4096)).cuda()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optim


def step(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    model(torch.randn(256, 4096, device="cuda")).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def on_host(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    held = {f"p{i}": p.detach().to("cpu", copy=True) for i, p in enumerate(model.parameters())}
    for i, s in enumerate(optim.state.values()):
        held.update({f"s{i}.{k}": v.detach().to("cpu", copy=True) for k, v in s.items() if torch.is_tensor(v)})
    return held


def test_a_background_save_racing_the_next_optimizer_steps_saves_its_own_step(tmp_path):
    model, optim = cuda_state(0)
    state = {"model": model, "optim": optim}
    with Checkpointer(str(tmp_path)) as ckpt:
        for saved in (1, 2, 3):  # the second and third reuse the pinned buffers of the first
            step(model, optim)
            torch.cuda.synchronize()
            expected = on_host(model, optim)
            ckpt.save(saved, state, reason="periodic", wait=False)
            for _ in range(5):  # queued at once on the training stream, racing the staging copies
                step(model, optim)
            ckpt.wait()
            model2, optim2 = cuda_state(1)
            step(model2, optim2)  # the optimizer state exists, as after a real step
            assert Checkpointer(str(tmp_path)).resume({"model": model2, "optim": optim2}) == saved
            got = on_host(model2, optim2)
            assert got.keys() == expected.keys()
            assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_resume_into_cuda_tensors_is_bit_identical_and_a_damaged_file_falls_back(tmp_path):
    model, optim = cuda_state(0)
    held = {}
    with Checkpointer(str(tmp_path), write_threads=3) as ckpt:
        for saved in (1, 2):
            step(model, optim)
            ckpt.save(saved, {"model": model, "optim": optim}, reason="manual")
            held[saved] = on_host(model, optim)
    model2, optim2 = cuda_state(1)
    step(model2, optim2)
    assert Checkpointer(str(tmp_path)).resume({"model": model2, "optim": optim2}) == 2
    assert all(torch.equal(v, on_host(model2, optim2)[k]) for k, v in held[2].items())
    flip_byte(sorted((tmp_path / step_dir_name(2)).glob("*.distcp"))[-1])
    assert Checkpointer(str(tmp_path)).resume({"model": model2, "optim": optim2}) == 1
    assert all(torch.equal(v, on_host(model2, optim2)[k]) for k, v in held[1].items())


NCCL = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from cloud_adapters.gcp.emulator import GCPMetadataEmulator
    import spotguard
    from spotguard.checkpoint import Checkpointer
    from tests.test_cuda import cuda_state, on_host, step

    dist.init_process_group("nccl", device_id=torch.device("cuda:0"))
    model, optim = cuda_state(0)
    state = {"model": model, "optim": optim}
    with GCPMetadataEmulator() as emulator:
        with spotguard.Guard(sys.argv[1], cloud="gcp", metadata_url=emulator.url, exit_code=None) as guard:
            for n in range(10_000):
                step(model, optim)
                if n == 3:
                    emulator.raise_notice()
                if guard.step(n, state):
                    break
    held = on_host(model, optim)
    model2, optim2 = cuda_state(1)
    step(model2, optim2)
    resumed = Checkpointer(sys.argv[1]).resume({"model": model2, "optim": optim2})
    got = on_host(model2, optim2)
    print(json.dumps({"stopped_at": n, "resumed": resumed, "saved": guard.emergency_saved,
                      "same": all(torch.equal(got[k], held[k]) for k in held)}))
    dist.destroy_process_group()
""")


def test_an_nccl_job_saves_on_a_notice_and_resumes_bit_identical(tmp_path):
    env = dict(rank_env(0, 1, free_port()), PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-c", NCCL, str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"stopped_at": got["stopped_at"], "resumed": got["stopped_at"], "saved": True, "same": True}
    assert got["stopped_at"] >= 3


def test_an_emergency_save_after_a_background_save_stages_into_its_buffers(tmp_path):
    """The emergency copies the state into the pinned buffers the background save allocated (the
    same memory, holding the emergency's step afterwards) instead of copying as it writes."""
    model, optim = cuda_state(0)
    state = {"model": model, "optim": optim}
    with Checkpointer(str(tmp_path)) as ckpt:
        step(model, optim)
        ckpt.save(1, state, reason="emergency")  # no buffers yet: the write copies through the small pinned pool
        assert ckpt._stager.nbytes == 0
        ckpt.save(2, state, reason="periodic", wait=False)  # stages (allocates) before it returns
        pinned = {key: b.data_ptr() for key, b in ckpt._stager._buffers.items() if b.is_pinned()}
        step(model, optim)
        torch.cuda.synchronize()
        expected = on_host(model, optim)
        ckpt.save(3, state, reason="emergency")
        buffers = {key: b for key, b in ckpt._stager._buffers.items() if b.is_pinned()}
        assert pinned and {key: b.data_ptr() for key, b in buffers.items()} == pinned
        for b in buffers.values():  # step 3's values: the emergency copied into them (step 2's were there)
            assert any(b.shape == t.shape and torch.equal(b, t) for t in expected.values())
    model2, optim2 = cuda_state(1)
    step(model2, optim2)
    assert Checkpointer(str(tmp_path)).resume({"model": model2, "optim": optim2}) == 3
    got = on_host(model2, optim2)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_lightning_fsdp_on_a_gpu_stops_at_the_agreed_step_and_resumes_bit_identical(tmp_path):
    """Lightning runs FSDP on GPUs only (it refuses strategy="fsdp" on CPU): one GPU, world size 1."""
    pytest.importorskip("lightning")
    fsdp = ("--strategy", "fsdp", "--accelerator", "cuda", "--devices", "1")
    sigterm_then_finish("lightning_train.py", tmp_path, (sys.executable,), fsdp, ranks=1, first_step=1, at=5)


def test_an_emergency_save_of_gpu_state_crosses_through_the_pinned_pool_and_resumes_bit_identical(tmp_path):
    import torch.distributed.checkpoint as dcp

    from spotguard.checkpoint.io import bounce

    model, optim = cuda_state(0)
    step(model, optim)
    torch.cuda.synchronize()
    expected = on_host(model, optim)
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with Checkpointer(str(tmp_path), write_threads=4) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim}, reason="emergency")  # no background save: the pool
    assert torch.cuda.max_memory_allocated() - before < 1 << 30  # the goal: <= 1 GB of GPU memory added
    pool = bounce._pools["cuda:0"]
    assert pool.lent == 0 and 0 < pool.allocated_bytes <= pool.count * bounce.BUFFER_BYTES
    assert pool._free[0].is_pinned()
    model2, optim2 = cuda_state(1)
    step(model2, optim2)
    assert Checkpointer(str(tmp_path)).resume({"model": model2, "optim": optim2}) == 1
    got = on_host(model2, optim2)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    plain = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}  # DCP's own reader takes the slices
    dcp.load({"model": plain}, checkpoint_id=tmp_path / step_dir_name(1), no_dist=True)
    assert all(torch.equal(plain[k].cpu(), v.cpu()) for k, v in model.state_dict().items())


def test_a_guard_snapshot_of_gpu_state_comes_back_into_the_gpu(tmp_path, monkeypatch):
    import spotguard

    monkeypatch.setenv("SPOTGUARD_SNAPSHOT_DIR", str(tmp_path / "memory"))
    model, optim = cuda_state(0)
    with spotguard.Guard(str(tmp_path / "ckpt"), cloud="none", exit_code=None, snapshot_every=2) as guard:
        for n in range(5):
            step(model, optim)
            guard.step(n, {"model": model, "optim": optim})
        guard.snapshots.wait(120)
        assert guard.snapshots.last.ok and guard.snapshots.last.step == 4
    torch.cuda.synchronize()
    expected = on_host(model, optim)
    model2, optim2 = cuda_state(1)
    step(model2, optim2)
    with spotguard.Guard(str(tmp_path / "ckpt"), cloud="none", exit_code=None, snapshot_every=2) as guard:
        assert guard.resume({"model": model2, "optim": optim2}) == 5
        assert [e.detail.get("tier") for e in guard.timeline.entries if e.event == "resumed"] == ["snapshot"]
    got = on_host(model2, optim2)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_leaving_rank_hands_cuda_shards_over_bit_for_bit():
    import torch.distributed as dist

    from spotguard.checkpoint.moves.handoff.send import send_shards
    from spotguard.job.departure import Departure
    from spotguard.job.kvstore import Connection
    from tests.test_handoff import STEP, Survivor, cutoff, shard

    departure = Departure(frozenset({1}), Connection.of(dist.HashStore()), "run/emergency/1/", world_size=2)
    sent = [shard("w", torch.randn(3 << 20, device="cuda"), 3 << 20, 6 << 20), shard("h", torch.ones(7, device="cuda"))]
    survivor = Survivor(departure)
    assert send_shards(departure, 1, 0, STEP, sent, cutoff()) == sum(t.numel() * t.element_size() for _, t in sent)
    got = survivor.join()
    assert all(torch.equal(tensor, want.cpu()) for (_, tensor), (_, want) in zip(got, sent))
