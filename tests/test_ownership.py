"""Who holds which bytes (HSDP, TP, meshes a rank is not in) and the survivors' refusal to commit a
plan that does not cover every tensor. Meshes of 8 ranks are built in one process on torch's
"fake" process group, in a subprocess so that it never meets the tests' real groups."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from spotguard.checkpoint.moves.ownership import SurvivorPlanner
from tests.ckpt_workers import ROOT

MESHES = textwrap.dedent("""
    import json, torch, torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from spotguard.checkpoint.moves.ownership import expects_handoff, hands_over, holders
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    hsdp = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    w = DTensor.from_local(torch.ones(2, 3), hsdp, [Replicate(), Shard(0)], run_check=False)
    tp = DTensor.from_local(torch.ones(2, 3), init_device_mesh("cpu", (8,)), [Shard(1)], run_check=False)
    part = DTensor.from_local(torch.ones(2), torch.distributed.device_mesh.DeviceMesh("cpu", [0, 1, 2, 3]),
                              [Shard(0)], run_check=False)
    node1 = {4, 5, 6, 7}  # the second "node" leaves
    survivors = set(range(8)) - node1
    print(json.dumps({
        "hsdp_holders": {r: sorted(holders(w, r)) for r in range(8)},
        "hsdp_replica_survives": [hands_over(w, r, survivors) for r in sorted(node1)],
        "hsdp_both_replicas_leave": [hands_over(w, r, {0, 2, 3, 4, 6, 7}) for r in (1, 5)],
        "tp_holders": sorted(holders(tp, 5)),
        "tp_hands_over": [hands_over(tp, r, survivors) for r in sorted(node1)],
        "outside_mesh": [sorted(holders(part, 6)), hands_over(part, 6, survivors)],
        "expects": [expects_handoff({"w": w}, 5, survivors), expects_handoff({"w": w, "tp": tp}, 5, survivors)],
    }))
""")


@pytest.fixture(scope="module")
def meshes():
    done = subprocess.run(
        [sys.executable, "-c", MESHES], capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT)}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_hsdp_a_shard_is_held_by_its_replica_in_the_other_group(meshes):
    assert meshes["hsdp_holders"]["1"] == [1, 5] and meshes["hsdp_holders"]["6"] == [2, 6]
    assert meshes["hsdp_replica_survives"] == [False] * 4  # every leaving shard has a surviving replica
    assert meshes["hsdp_both_replicas_leave"] == [True, False]  # the lowest leaving holder hands it over, once


def test_tensor_parallel_shards_are_each_rank_s_own(meshes):
    assert meshes["tp_holders"] == [5]
    assert meshes["tp_hands_over"] == [True] * 4


def test_a_rank_outside_a_tensor_s_mesh_holds_none_of_it(meshes):
    assert meshes["outside_mesh"] == [[], False]


def test_a_handoff_is_expected_only_when_some_shard_would_be_lost(meshes):
    assert meshes["expects"] == [False, True]


def test_survivors_never_commit_a_plan_that_leaves_part_of_a_tensor_out(tmp_path):
    """Half of `w` was handed over, the other half is nowhere: the save fails, naming the tensor."""
    half = torch.arange(2.0)
    item = WriteItem(
        index=MetadataIndex("w", torch.Size([0])),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size([0]), torch.Size([2])),
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size([4]),
        ),
    )
    with pytest.raises(dcp.CheckpointException) as failed:
        dcp.save(
            {"b": torch.ones(2)}, checkpoint_id=str(tmp_path), planner=SurvivorPlanner([(item, half)]), no_dist=True
        )
    (error, _) = failed.value.failures[0]
    assert "survivors do not hold the whole state: w: 2 of 4 elements" in str(error)
    assert not (tmp_path / ".metadata").exists()
