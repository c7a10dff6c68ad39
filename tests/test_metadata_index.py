"""`.metadata.index`: written beside `.metadata` at a save, read at resume for only this rank's chunks,
checked strictly, and `.metadata` read as before where a step has no index."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from spotguard.checkpoint.format.layout import MANIFEST_NAME, METADATA_INDEX_NAME, step_dir_name
from spotguard.checkpoint.format.manifest import Manifest
from spotguard.checkpoint.format.metadata_index import RefusedIndex, index_bytes, read_index
from spotguard.checkpoint.format.safe_pickle import load_metadata
from tests import ckpt_workers

WORKERS = Path(__file__).resolve().parent / "index_workers.py"


def sharded(ranks: int, tensors: int = 3, rows: int = 4, cols: int = 8) -> Metadata:
    """An FSDP2-shaped metadata: each tensor sharded by rows over `ranks`, rank r's chunk in its file;
    a 0-d tensor and a bytes value besides."""
    state, storage = {}, {}
    for t in range(tensors):
        fqn, chunks = f"layers.{t}.weight", []
        for r in range(ranks):
            offsets = torch.Size([r * rows, 0])
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([rows, cols])))
            storage[MetadataIndex(fqn, offsets, r)] = _StorageInfo(f"__{r}_0.distcp", t * 4096, 4096)
        properties = TensorProperties(dtype=torch.bfloat16)
        state[fqn] = TensorStorageMetadata(properties, torch.Size([ranks * rows, cols]), chunks)
    empty = torch.Size([])
    state["step"] = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), empty, [ChunkStorageMetadata(empty, empty)]
    )
    storage[MetadataIndex("step", empty)] = _StorageInfo("__0_0.distcp", 1 << 20, 512)
    state["epoch"] = BytesStorageMetadata()
    storage[MetadataIndex("epoch")] = _StorageInfo("__0_0.distcp", 2 << 20, 64)
    return Metadata(state, planner_data={"step": ("step",), "epoch": ("epoch",)}, storage_data=storage)


def everything(name: str) -> bool:
    return True


def test_a_rank_at_1024_keeps_only_the_chunks_its_shards_overlap():
    full = sharded(1024)
    rank = 700
    wanted = {f"layers.{t}.weight": [((rank * 4 + 2, 0), (4, 8))] for t in range(3)}  # straddles ranks 700 and 701
    partial = read_index(index_bytes(full), wanted, everything)
    for t in range(3):
        chunks = partial.state_dict_metadata[f"layers.{t}.weight"].chunks
        assert [c.offsets for c in chunks] == [torch.Size([rank * 4, 0]), torch.Size([rank * 4 + 4, 0])]
    assert partial.state_dict_metadata["step"] == full.state_dict_metadata["step"]  # not asked for: kept whole
    assert partial.storage_data == {k: v for k, v in full.storage_data.items() if k.fqn in ("step", "epoch") or
                                    k.offset in (torch.Size([rank * 4, 0]), torch.Size([rank * 4 + 4, 0]))}  # fmt: skip
    assert partial.planner_data == full.planner_data
    assert {k: v.size for k, v in partial.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)} == {
        k: v.size for k, v in full.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)
    }


def test_without_a_filter_the_index_says_what_the_metadata_does():
    full = sharded(4)
    full.version = "1.0.0"
    read = read_index(index_bytes(full), {}, everything)
    assert read.state_dict_metadata == full.state_dict_metadata
    assert read.storage_data == full.storage_data and read.version == "1.0.0"
    assert read == load_metadata(pickle.dumps(read))  # the same types the pickle holds


def _with_boxes(data: bytes, change) -> bytes:
    """`data` with its chunk array changed by `change` (an int64 view of it)."""
    head = int.from_bytes(data[8:16], "little")
    values = np.frombuffer(data, dtype="<i8", offset=16 + head).copy()
    change(values)
    return data[: 16 + head] + values.tobytes()


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda v: v.__setitem__(4, 2), "overlap"),  # chunk 1 starts at row 2, over chunk 0
        (lambda v: v.__setitem__(14, 3), "hold 120 elements, the tensor 128"),  # chunk 3 holds 3 rows of 4
        # Every chunk the whole tensor: no dimension is cut, and each cell is covered 4 times.
        (lambda v: v[:16].reshape(4, 4).__setitem__(slice(None), (0, 0, 16, 8)), "hold 512 elements"),
        (lambda v: v.__setitem__(12, 1 << 40), "outside"),  # chunk 3 starts far beyond the tensor
        (lambda v: v.__setitem__(-3, 7), "names no file"),  # a file id the header does not list
        (lambda v: v.__setitem__(-1, -5), "negative range"),
    ],
)
def test_a_tampered_index_is_refused_in_one_line(change, says):
    data = _with_boxes(index_bytes(sharded(4)), change)
    with pytest.raises(RefusedIndex, match=says) as refused:
        read_index(data, {}, everything)
    assert _one_line(refused).startswith("metadata index refused: ")


def test_an_index_cut_short_or_with_a_header_not_its_own_is_refused():
    data = index_bytes(sharded(4))
    with pytest.raises(RefusedIndex, match="not the size") as refused:
        read_index(data[:-8], {}, everything)
    _one_line(refused)
    head = int.from_bytes(data[8:16], "little")
    header = json.loads(data[16 : 16 + head])
    header["tensors"][0]["dtype"] = "os.system"
    text = json.dumps(header).encode()
    text += b" " * (-(len(text) + 16) % 8)
    bad = data[:8] + len(text).to_bytes(8, "little") + text + data[16 + head :]
    with pytest.raises(RefusedIndex, match="dtype"):
        read_index(bad, {}, everything)
    with pytest.raises(RefusedIndex, match="does not list"):
        read_index(data, {}, lambda name: name != "__3_0.distcp")


def test_metadata_the_index_cannot_say_gets_none():
    """Then no index is written, and every rank reads `.metadata`."""
    odd = sharded(2)
    key = next(iter(odd.storage_data))
    odd.storage_data[key] = dataclasses.replace(odd.storage_data[key], transform_descriptors=["zstd"])
    assert index_bytes(odd) is None
    lost = sharded(2)
    del lost.storage_data[key]
    assert index_bytes(lost) is None
    assert index_bytes(sharded(1)) is None  # nothing sharded: nothing for a rank to leave out


def _results(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"resumed-{world}-{r}.json").read_text()) for r in range(world)]


def _run(scenario: str, world: int, ckpt: Path, out: Path) -> None:
    args = json.dumps({"ckpt": str(ckpt), "out": str(out)})
    ckpt_workers.finish(ckpt_workers.launch_command([str(WORKERS), scenario, args], world), timeout=180)


def test_fsdp2_resumes_through_the_index_at_the_same_and_other_world_sizes(tmp_path):
    """Saved by 2 ranks; resumed by 2 and by 3 through the index (each rank keeping only its chunks),
    then, the index taken out of the step as in one saved before it existed, through `.metadata`."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    _run("save", 2, ckpt, out)
    step_dir = ckpt / step_dir_name(2)
    manifest = Manifest.from_bytes((step_dir / MANIFEST_NAME).read_bytes())
    assert manifest.file(METADATA_INDEX_NAME) is not None
    total = sum(
        len(getattr(md, "chunks", ()))
        for md in load_metadata((step_dir / ".metadata").read_bytes()).state_dict_metadata.values()
    )  # noqa: E501
    for world in (2, 3):
        _run("resume", world, ckpt, out)
        results = _results(out, world)
        assert all(r["equal"] for r in results), results
        # The first and last ranks' shards lie within one saved rank's (at 3, the middle one's straddles both).
        assert all(len(r["kept"]) == 1 for r in results) and results[0]["kept"][0] < total > results[-1]["kept"][0]
    files = tuple(f for f in manifest.files if f.name != METADATA_INDEX_NAME)
    (step_dir / MANIFEST_NAME).write_bytes(dataclasses.replace(manifest, files=files).to_bytes())
    (step_dir / METADATA_INDEX_NAME).unlink()
    _run("resume", 2, ckpt, out)
    assert [r["equal"] for r in _results(out, 2)] == [True, True]
    assert [r["kept"] for r in _results(out, 2)] == [[], []]  # read through .metadata
