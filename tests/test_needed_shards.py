"""At a reshard from snapshots each rank reads the indexes of the shards it needs, not every shard's."""

from __future__ import annotations

import json

import torch

from spotguard.snapshots.items import BYTES, StoredItem
from spotguard.snapshots.needed import Layout, shard_layout, shards_needed, state_layout

COLS = 4


def row_sharded(world: int, rows: int, fqns: list[str], total: int) -> dict[int, Layout]:
    """Each of `world` shards holds rows [s*rows, (s+1)*rows) of every tensor (the last ones fewer), and a
    value every rank saved."""
    out = {}
    for s in range(world):
        start, size = min(s * rows, total), max(0, min(rows, total - s * rows))
        items = [StoredItem(f, 0, 4 * size * COLS, "float32", (start, 0), (size, COLS), (total, COLS)) for f in fqns]
        out[s] = shard_layout([*items, StoredItem("step", 0, 8, BYTES)])
    return out


def rows_of(rank: int, rows: int, fqns: list[str], more: tuple[str, ...] = ("step",)) -> Layout:
    return Layout.of([*((f, (rank * rows, 0), (rows, COLS)) for f in fqns), *((m, (), ()) for m in more)])


def brute_force(rank: int, rows: int, old_rows: int, old: int) -> list[int]:
    lo, hi = rank * rows, (rank + 1) * rows
    return [s for s in range(old) if s * old_rows < hi and lo < (s + 1) * old_rows]


def test_a_rank_of_a_shrunk_or_grown_row_sharded_job_needs_the_shards_its_rows_lie_in():
    for old, old_rows, new, rows in ((64, 3, 24, 8), (24, 8, 64, 3), (32, 2, 32, 2)):
        shards = row_sharded(old, old_rows, ["w", "v"], old * old_rows)
        wants = [rows_of(r, rows, ["w", "v"]) for r in range(new)]
        needed = shards_needed(shards, wants, [[] for _ in range(new)])
        # "step", held by every shard, comes with a shard the rank needs anyway.
        assert needed == [brute_force(r, rows, old_rows, old) for r in range(new)], (old, new)


def test_a_replicated_state_is_read_from_one_shard_on_the_ranks_node():
    world = 16
    shards = {s: shard_layout([StoredItem("w", 0, 64, "float32", (0, 0), (4, COLS), (4, COLS))]) for s in range(world)}
    wants = [Layout.of([("w", (0, 0), (4, COLS))]) for _ in range(8)]
    on_node = [[2 * (r // 2), 2 * (r // 2) + 1] for r in range(8)]  # two ranks a node, holding two shards
    assert shards_needed(shards, wants, on_node) == [[r] for r in range(8)]
    assert shards_needed(shards, wants, [[5, 9]] * 8) == [[5]] * 8  # its node's, before its own
    # A rank whose node holds no copy and whose own shard is gone reads the first.
    assert shards_needed({s: v for s, v in shards.items() if s != 3}, wants, [[] for _ in range(8)])[3] == [0]


def test_a_column_sharded_tensor_is_swept_along_its_columns():
    shards = {s: Layout.of([("w", (0, 2 * s), (8, 2))]) for s in range(16)}
    wants = [Layout.of([("w", (0, 8 * r), (8, 8))]) for r in range(4)]
    assert shards_needed(shards, wants, [[]] * 4) == [[4 * r + i for i in range(4)] for r in range(4)]


def test_what_no_shard_holds_needs_no_shard():
    shards = row_sharded(4, 2, ["w"], 8)
    wants = [Layout.of([("missing", (0, 0), (2, COLS)), ("gone", (), ())])]
    assert shards_needed(shards, wants, [[]]) == [[]]
    assert shards_needed({}, wants, [[]]) == [[]]


def test_a_rank_whose_chunk_is_empty_still_gets_a_shard_of_its_tensor():
    """FSDP's last ranks hold no rows of a tensor with fewer rows than ranks: the load planner still
    looks the tensor up in the metadata, so some shard of it must come."""
    shards = row_sharded(4, 2, ["w"], 8)
    wants = [Layout.of([("w", (8, 0), (0, COLS))]), Layout.of([("w", (0, 0), (2, COLS))])]
    assert shards_needed(shards, wants, [[], []]) == [[0], [0]]


def test_a_ranks_layout_is_its_chunks_as_dcps_planner_names_them():
    layout = state_layout({"model": {"w": torch.zeros(3, 2)}, "epoch": 4})
    assert layout.fqns == ("model.w", "epoch")
    assert layout.offsets.tolist() == [[0, 0], [0, 0]] and layout.sizes.tolist() == [[3, 2], [1, 1]]


def test_a_rank_that_cannot_lay_its_state_out_leaves_no_rank_waiting_in_the_exchange(tmp_path):
    from tests.ckpt_workers import run_ranks

    run_ranks("reshard_layout_fails", 2, timeout=45, snapshot_dir=str(tmp_path / "memory"), out=str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["indexes"] is None for r in ranks)
    assert any("injected: no layout" in why for why in ranks[1]["problems"]), ranks[1]
