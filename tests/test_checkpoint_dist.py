"""Checkpoints across real gloo process groups: DDP save, resharding 2 -> 1 and 1 -> 2, emergency during periodic."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from spotguard.checkpoint import Checkpointer, IfSaved, list_checkpoints, rooted, verify_checkpoint
from spotguard.checkpoint.format.layout import step_dir_name
from tests.ckpt_workers import Own, assert_same, finish, launch_code, make_model, run_ranks, snapshot, train


def resume_in_process(ckpt, width=32, depth=3, with_step=True, **kwargs):
    """Resume at world size 1 (no process group) into a fresh model."""
    model = make_model(seed=7, width=width, depth=depth)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": optim, **({"step": -1} if with_step else {})}
    with Checkpointer(str(ckpt), **kwargs) as ck:
        step = ck.resume(state)
    return step, state, snapshot(model, optim)


def test_ddp_save_uploads_writes_replicas_once_and_resumes_at_world_size_1(tmp_path):
    remote, local, out = tmp_path / "remote", tmp_path / "local", tmp_path / "out"
    out.mkdir()
    run_ranks("ddp_train_save", 2, ckpt=str(remote), local=str(local), out=str(out), save_at=[2, 4], steps=5)

    for root in (remote, local):
        assert [(i.step, i.committed, i.world_size) for i in list_checkpoints(str(root))] == [
            (2, True, 2),
            (4, True, 2),
        ]
    assert all(r.ok for r in verify_checkpoint(str(remote)))

    # DCP de-duplicated the replicated DDP tensors: each one is stored once, and both ranks wrote a share.
    step_dir = remote / "step-0000000004"
    metadata = pickle.loads((step_dir / ".metadata").read_bytes())  # verified above
    fqns = [index.fqn for index in metadata.storage_data]
    assert len(fqns) == len(set(fqns)) and "model.0.weight" in fqns and "optim.state.0.weight.exp_avg" in fqns
    per_rank = {r: sum(p.stat().st_size for p in step_dir.glob(f"__{r}_*.distcp")) for r in (0, 1)}
    assert per_rank[0] > 0 and per_rank[1] > 0
    # Every shard byte belongs to exactly one stored item: a second copy of a replica would be unreferenced bytes.
    assert sum(info.length for info in metadata.storage_data.values()) == sum(per_rank.values())
    held = torch.load(out / "step-4.pt")

    # A fresh VM with one process: download from the remote, verify, reshard 2 -> 1.
    step, state, loaded = resume_in_process(remote, local_dir=str(tmp_path / "fresh"))
    assert step == 4 and state["step"] == 4
    assert_same(loaded, held)


def test_single_process_checkpoint_resumes_on_two_ranks(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    model = make_model(seed=0)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, optim, range(3))
    with Checkpointer(str(ckpt)) as ck:
        ck.save(
            3, {"model": model, "optim": optim, "step": 3, "own_0": IfSaved(Own("saved by rank 0"))}, reason="manual"
        )

    run_ranks("ddp_resume", 2, ckpt=str(ckpt), local=None, out=str(out))
    for rank in (0, 1):
        got = torch.load(out / f"resumed-rank{rank}.pt")
        assert got["step"] == 3 and got["saved_step"] == 3
        assert_same(got["state"], snapshot(model, optim))
    # Rank 1 is new at world size 2: no value of its own was saved, and the step loads all the same.
    owns = [torch.load(out / f"resumed-rank{rank}.pt")["own"] for rank in (0, 1)]
    assert owns == ["saved by rank 0", "fresh on rank 1"]


def test_emergency_save_during_periodic_save_on_two_ranks(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    run_ranks("emergency_during_periodic", 2, ckpt=str(ckpt), out=str(out))

    report = json.loads((out / "report.json").read_text())
    assert report["periodic_in_flight"] and report["durable"] and 0 < report["margin_s"] < 120
    listed = list_checkpoints(str(ckpt))
    assert [(i.step, i.reason, i.committed) for i in listed] == [(5, "periodic", True), (6, "emergency", True)]
    assert all(r.ok for r in verify_checkpoint(str(ckpt)))
    manifest = json.loads((ckpt / "step-0000000006" / "spotguard.json").read_text())
    assert manifest["notice"]["cloud"] == "aws" and manifest["world_size"] == 2

    step, _, loaded = resume_in_process(ckpt, width=1024, depth=4, with_step=False)
    assert step == 6
    assert_same(loaded, torch.load(out / "step-6.pt"))
    # The periodic save holds the values at the time it was asked for, not the ones training moved on to.
    (ckpt / "step-0000000006" / "spotguard.json").unlink()
    step, _, loaded = resume_in_process(ckpt, width=1024, depth=4, with_step=False)
    assert step == 5
    assert_same(loaded, torch.load(out / "step-5.pt"))


NODE_LEADER_PROBE = """
import torch.distributed as dist
from spotguard.job import topology
from spotguard.checkpoint.comm import Comm
dist.init_process_group("gloo")
print("leader" if Comm().is_node_leader else "follower", topology.current().local_rank, flush=True)
dist.destroy_process_group()
"""


def test_without_local_rank_one_rank_leads_the_node_as_the_guard_sees_it():
    """Two ranks that both thought they were the node leader would race downloading into one local_dir."""
    answers = [out.strip().splitlines()[-1] for out in finish(launch_code(NODE_LEADER_PROBE, 2), timeout=60)]
    assert answers == ["leader 0", "follower 1"]


def test_saves_of_one_layout_reuse_the_plan_and_the_metadata_the_first_made_the_emergency_too(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run_ranks("cached_plans", 2, ckpt=str(tmp_path / "ckpt"), out=str(out))
    plans = json.loads((out / "plans.json").read_text())
    # Step 1 plans; 2 (periodic) and 3 (the emergency) reuse it; 4 adds a key per rank and plans anew.
    # Where the items went did not change either: 2 and 3 write step 1's .metadata (and index) again.
    assert plans == {"reused": [False, True, True, False], "made": 2, "pickled": 2}
    ckpt = tmp_path / "ckpt"
    for name in (".metadata", ".metadata.index"):
        same = {(ckpt / step_dir_name(step) / name).read_bytes() for step in (1, 2, 3)}
        assert len(same) == 1 and (ckpt / step_dir_name(4) / name).read_bytes() not in same


def test_a_gather_sends_each_ranks_bytes_to_rank_0_alone_with_no_ring_of_sizes():
    """Three real gloo ranks, objects of 0.1 KB, 3 MB and nothing much: rank 0 gets each whole and in rank order
    (its own as a copy, as torch's gather_object gives it), and no rank takes part in an all-gather; a message of
    the group's user, rank 1 to rank 0, that rank 0 waits for across the gather is not mistaken for its bytes."""
    outputs = run_ranks("comm_gather", 3, sizes=[100, 3_000_000, 1])
    got = "RESULT [(0, 100, True), (1, 3000000, True), (2, 1, True)] copy=True theirs=[0.0, 1.0, 2.0, 3.0]"
    assert got in outputs[0], outputs[0]
    assert [f"RESULT rank {r} gathered={r == 0}" in out for r, out in enumerate(outputs)] == [True] * 3


def test_a_scatter_sends_each_rank_its_bytes_alone_with_no_broadcast_nor_padding():
    """Three real gloo ranks, rank 0 scatters objects of 0.1 KB, 3 MB and nothing much: each rank gets its own
    whole (rank 0 a copy), no rank takes part in a broadcast, and a message of the group's user, rank 0 to rank 2,
    that rank 2 waits for across the scatter is not mistaken for its bytes."""
    outputs = run_ranks("comm_scatter", 3, sizes=[100, 3_000_000, 1])
    assert "RESULT copy=True" in outputs[0], outputs[0]
    sizes = [100, 3_000_000, 1]
    assert [f"RESULT rank {r} got ({r}, {sizes[r]}, True)" in out for r, out in enumerate(outputs)] == [True] * 3
    assert "theirs=[0.0, 1.0, 2.0, 3.0]" in outputs[2], outputs[2]


def test_rank_0_must_scatter_one_object_per_rank():
    with pytest.raises(ValueError, match="one object per rank: 3 expected, got 2"):
        rooted.scatter_bytes(None, 0, 3, [b"a", b"b"])  # type: ignore[arg-type]  # raises before the wire is used
