"""A tensor's chunks must tile it, in a snapshot's indexes as in a durable step's `.metadata`.

DCP's load planner reads the chunks the metadata lists as they are: two that overlap, written by
someone who can write the files (and their checksums), would load shifted data into one part of a
tensor and leave another as it was, and the planner's element count would still add up.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from spotguard.checkpoint.format.layout import step_dir_name
from spotguard.checkpoint.format.safe_pickle import untiled
from spotguard.snapshots import shard_file
from spotguard.snapshots.items import LayoutError
from spotguard.snapshots.loading import load_shards
from spotguard.snapshots.reading import FileRuns
from tests.ckpt_workers import assert_same
from tests.test_checkpoint import resume_fresh, save_steps
from tests.test_checkpoint_security import vouch_for
from tests.test_snapshots import chunked, run


def tensor(size: tuple[int, ...], *boxes: tuple[tuple[int, ...], tuple[int, ...]]) -> Metadata:
    chunks = [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes in boxes]
    return Metadata({"t": TensorStorageMetadata(TensorProperties(torch.float32), torch.Size(size), chunks)})


def pinwheel(n: int) -> list:
    """A tiling of (2n, 2n) no DTensor makes: n columns on the left, 2n rows on the right."""
    return [((0, c), (2 * n, 1)) for c in range(n)] + [((r, n), (1, n)) for r in range(2 * n)]


LAYOUTS = {  # name: (size, chunks, whole, what is wrong)
    "rows (FSDP)": ((8, 2), [((0, 0), (3, 2)), ((3, 0), (5, 2))], True, None),
    "a grid (FSDP x TP)": ((4, 6), [((r, c), (2, 3)) for r in (0, 2) for c in (0, 3)], True, None),
    "a 0-d tensor": ((), [((), ())], True, None),
    "empty chunks anywhere inside": ((0, 4), [((0, 0), (0, 4)), ((0, 2), (0, 2))], True, None),
    "a gap, in one shard's index": ((8, 2), [((0, 0), (3, 2)), ((4, 0), (4, 2))], False, None),
    "a gap": ((8, 2), [((0, 0), (3, 2)), ((4, 0), (4, 2))], True, "its chunks hold 14 elements, the tensor 16"),
    "rows that overlap": ((8, 2), [((0, 0), (4, 2)), ((2, 0), (4, 2))], False, "chunks at [0, 0] and [2, 0] overlap"),
    "overlap, all counted": (
        (4, 4),
        [((0, 0), (2, 3)), ((1, 2), (2, 2)), ((2, 0), (2, 2)), ((3, 2), (1, 2))],
        True,
        "the chunks at [0, 0] and [1, 2] overlap",
    ),  # fmt: skip
    "a chunk past the end": ((8, 2), [((0, 0), (4, 2)), ((4, 0), (5, 2))], False, "lies outside its size [8, 2]"),
    "a chunk of fewer dimensions": ((8, 2), [((0, 0), (8,))], False, "lies outside"),
    "a negative offset": ((8, 2), [((-1, 0), (1, 2))], False, "lies outside"),
    "a negative size": ((-1, 0), [], True, "a size [-1, 0] no tensor has"),
    "many cells a chunk": ((40, 40), pinwheel(20), True, "a layout DCP does not write"),
}


@pytest.mark.parametrize("size, chunks, whole, wrong", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_chunks_must_lie_inside_their_tensor_apart_and_when_whole_cover_it(size, chunks, whole, wrong):
    why = untiled(tensor(size, *chunks), whole=whole)
    if wrong is None:
        assert why is None
    else:
        assert why.startswith("t: ") and wrong in why, why


def overlapping(path: Path, fqn: str) -> None:
    """Rewrite the index of the snapshot file at `path` (its CRC32C too, as its writer could): `fqn`'s
    one chunk as two of half its rows, the second from a quarter of the way down. The body, its block
    CRC32Cs and the element count stay as they were."""
    info = shard_file.read_info(path)
    (item,) = [i for i in info.items if i.fqn == fqn]
    rows, half = item.chunk_sizes[0], item.nbytes // 2
    first = dataclasses.replace(item, nbytes=half, chunk_sizes=(rows // 2, *item.chunk_sizes[1:]))
    second = dataclasses.replace(first, offset=item.offset + half, chunk_offsets=(rows // 4, *item.chunk_offsets[1:]))
    items = tuple(new for i in info.items for new in ((first, second) if i is item else (i,)))
    body = path.read_bytes()[: info.body_bytes]
    path.write_bytes(body + dataclasses.replace(info, items=items).encoded())


def test_a_snapshot_whose_index_has_overlapping_chunks_yields_to_the_one_before(tmp_path, caplog):
    run(tmp_path, 11)  # snapshots 4 and 8
    (newest,) = (tmp_path / "memory").rglob("step-0000000008/*.snap")
    overlapping(newest, "model.0.weight")
    with caplog.at_level(logging.INFO):
        start, _, _ = run(tmp_path, 7)
    assert start == 5  # not 9, with rows 4-11 of the weight shifted and 12-15 as they were
    assert "malformed trailer: model.0.weight: the chunks at [0, 0] and [4, 0] overlap" in caplog.text


def test_chunks_of_two_shards_that_overlap_fail_the_load_at_another_world_size(tmp_path):
    whole = torch.arange(16.0).reshape(8, 2)
    shards = chunked(tmp_path, whole, 4)  # rows 0-1, 2-3, 4-5, 6-7
    path, info = shards[2]
    (item,) = info.items
    shards[2] = path, dataclasses.replace(info, items=(dataclasses.replace(item, chunk_offsets=(3, 0)),))
    indexes = {shard: info for shard, (_, info) in shards.items()}  # each one alone is fine
    live = {"w": torch.zeros(8, 2)}
    with pytest.raises(LayoutError, match=r"w: the chunks at \[2, 0\] and \[3, 0\] overlap"):
        load_shards(live, indexes, lambda s: s, lambda shard, runs: FileRuns(shards[shard][0]))
    assert not live["w"].any()  # refused before a byte is read (else rows 3-4 from shard 2, row 5 never)


def test_a_durable_step_whose_metadata_has_overlapping_chunks_is_skipped(tmp_path, caplog):
    ckpt = tmp_path / "ckpt"
    held = save_steps(ckpt, [1, 2])
    path = ckpt / step_dir_name(2) / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # the test's own file: a plain unpickler is fine here
    weight = metadata.state_dict_metadata["model.0.weight"]  # 32 x 32, one chunk
    weight.chunks[:] = [ChunkStorageMetadata(torch.Size(o), torch.Size([16, 32])) for o in ([0, 0], [8, 0])]
    metadata.storage_data[MetadataIndex("model.0.weight", (8, 0))] = metadata.storage_data[
        MetadataIndex("model.0.weight", (0, 0))
    ]
    path.write_bytes(pickle.dumps(metadata))
    vouch_for(path.parent, ".metadata")
    step, _, loaded = resume_fresh(ckpt)
    assert step == 1  # not 2, with rows 8-31 of the weight wrong
    assert_same(loaded, held[0])
    assert "model.0.weight: the chunks at [0, 0] and [8, 0] overlap" in caplog.text
