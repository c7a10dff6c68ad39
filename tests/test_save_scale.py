"""Rank 0's phases of a save, and the reads after it, grow linearly with the number of ranks.

At 1,024 ranks a step quadratic in N on rank 0 takes minutes inside an emergency's deadline
(`bench/save_scale.py` measures the phases). Here each phase runs on N ranks' plans and write
results, shaped as FSDP2's (every tensor sharded over all ranks, one replicated value), at two
sizes, and the Python lines it executes are counted: deterministic, unlike a timing. Four times
the ranks may cost six times the lines at most (linear: 4x; quadratic: 16x).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from cloud_adapters.notice import utc_now
from cloud_adapters.storage import LocalStore
from spotguard.checkpoint.comm import Comm
from spotguard.checkpoint.format.layout import DCP_METADATA_NAME
from spotguard.checkpoint.format.manifest import FileRecord
from spotguard.checkpoint.format.runs import RunClaim
from spotguard.checkpoint.format.safe_pickle import load_metadata
from spotguard.checkpoint.moves.durable import Uploader
from spotguard.checkpoint.save.plan_cache import CachedPlanner
from spotguard.checkpoint.save.protocol import SaveProtocol
from spotguard.checkpoint.save.write import Written
from spotguard.snapshots.items import StoredItem, metadata_of
from spotguard.snapshots.needed import Layout, shard_layout, shards_needed

TENSORS = 6
ROWS = 2  # of each tensor, per rank
COLS = 4
SMALL, LARGE = 32, 128
LINEAR_BOUND = 6.0  # lines at LARGE / lines at SMALL


def fqn(t: int) -> str:
    return f"model.layers.{t}.weight"


def local_plan(rank: int, world: int) -> SavePlan:
    """What DCP's local planner makes of rank `rank`'s FSDP2 state: one chunk of every tensor, and a
    value every rank holds (de-duplicated by the global plan)."""
    size = torch.Size([ROWS * world, COLS])
    items = [
        WriteItem(
            index=MetadataIndex(fqn(t), torch.Size([ROWS * rank, 0])),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(torch.Size([ROWS * rank, 0]), torch.Size([ROWS, COLS])),
                properties=TensorProperties(dtype=torch.float32),
                size=size,
            ),
        )
        for t in range(TENSORS)
    ]
    items.append(WriteItem(index=MetadataIndex("step"), type=WriteItemType.BYTE_IO))
    return SavePlan(items, planner_data={fqn(t): (fqn(t),) for t in range(TENSORS)} | {"step": ("step",)})


def write_results(plan: SavePlan, rank: int) -> list[WriteResult]:
    return [
        WriteResult(index=item.index, size_in_bytes=64, storage_data=_StorageInfo(f"__{rank}_0.distcp", 64 * i, 64))
        for i, item in enumerate(plan.items)
    ]


def lines(phase: Callable[[], Any]) -> int:
    """The Python lines `phase` executes, in every function it calls."""
    count = 0

    def trace(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        count += event == "line"
        return trace

    sys.settrace(trace)
    try:
        phase()
    finally:
        sys.settrace(None)
    return count


def global_plan(world: int, tmp: Path) -> Callable[[], Any]:
    plans = [local_plan(r, world) for r in range(world)]
    planner, writer = CachedPlanner(), FileSystemWriter(tmp)

    def phase() -> None:
        try:
            writer.prepare_global_plan(planner.create_global_plan(plans)[0])
        finally:
            planner.forget()

    return phase


def metadata_write(world: int, tmp: Path) -> Callable[[], Any]:
    plans = [local_plan(r, world) for r in range(world)]
    planner = CachedPlanner()
    final, metadata = planner.create_global_plan(plans)
    planner.forget()
    results = [write_results(plan, r) for r, plan in enumerate(final)]
    writer = FileSystemWriter(tmp)
    writer.set_up_storage_writer(True)
    return lambda: writer.finish(metadata, results)


def metadata_read(world: int, tmp: Path) -> Callable[[], Any]:
    metadata_write(world, tmp)()
    data = (tmp / DCP_METADATA_NAME).read_bytes()
    return lambda: load_metadata(data)


def commit(world: int, tmp: Path) -> Callable[[], Any]:
    claim = RunClaim("run", utc_now(), None)
    protocol = SaveProtocol(
        remote=LocalStore(tmp / "ckpt"),
        stage_root=tmp / "ckpt",
        local_root=None,
        comm=Comm(),
        run_id="run",
        claim=claim,
        key=None,
        uploader=Uploader(LocalStore(tmp / "ckpt"), claim, 1, None),
        write_threads=1,
        transfer_threads=1,
        stream_uploads=False,
        keep_last=None,
        on_event=None,
    )
    stage = tmp / "ckpt" / ".step-1.tmp"
    stage.mkdir(parents=True)
    gathered = [
        Written(tuple(FileRecord(f"__{r}_{i}.distcp", 64, "00000000") for i in range(2)), None, None)
        for r in range(world)
    ]

    def phase() -> None:
        assert protocol._commit(1, "emergency", None, stage, gathered, Comm(), ()).error is None

    return phase


def snapshot_index_items(world: int) -> dict[int, list[StoredItem]]:
    return {
        r: [
            StoredItem(fqn(t), 64 * t, 64, "float32", (ROWS * r, 0), (ROWS, COLS), (ROWS * world, COLS))
            for t in range(TENSORS)
        ]
        for r in range(world)
    }


def snapshot_index(world: int, tmp: Path) -> Callable[[], Any]:
    """A rank's DCP metadata from the shards' indexes it got."""
    indexes = snapshot_index_items(world)
    return lambda: metadata_of(indexes, whole=True)


def snapshot_needed(world: int, tmp: Path) -> Callable[[], Any]:
    """Rank 0 at a reshard to half the ranks: which shards each rank needs."""
    shards = {r: shard_layout(items) for r, items in snapshot_index_items(world).items()}
    half = world // 2
    wants = [Layout.of([(fqn(t), (2 * ROWS * r, 0), (2 * ROWS, COLS)) for t in range(TENSORS)]) for r in range(half)]
    return lambda: shards_needed(shards, wants, [[2 * r, 2 * r + 1] for r in range(half)])


@pytest.mark.parametrize("make", [global_plan, metadata_write, metadata_read, commit, snapshot_index, snapshot_needed])
def test_a_rank_0_phase_grows_linearly_with_the_ranks(tmp_path, make):
    counted = {}
    for world in (SMALL, LARGE):
        (tmp_path / str(world)).mkdir()
        counted[world] = lines(make(world, tmp_path / str(world)))
    ratio = counted[LARGE] / counted[SMALL]
    assert ratio <= LINEAR_BOUND, f"{make.__name__}: {counted} lines at {SMALL} and {LARGE} ranks ({ratio:.1f}x)"


def test_the_line_count_tells_a_quadratic_phase_from_a_linear_one():
    def quadratic(world: int) -> Callable[[], Any]:
        return lambda: [a == b for a in range(world) for b in range(world)]

    def linear(world: int) -> Callable[[], Any]:
        return lambda: [a for a in range(world)]

    for make, grows in ((quadratic, True), (linear, False)):
        ratio = lines(make(LARGE)) / lines(make(SMALL))
        assert (ratio > LINEAR_BOUND) == grows, (make.__name__, ratio)
