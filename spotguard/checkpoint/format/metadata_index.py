"""`.metadata.index`: DCP's metadata without pickle, from which a rank takes only the chunks it loads.

DCP's `.metadata` is one pickle of every chunk of every tensor: at 1,024 ranks of an FSDP state
(600 tensors) some 85 MB, which every rank unpickles whole, ~60 s with `safe_pickle`'s unpickler.
Beside it, rank 0 writes this index of the same metadata: the magic, a little-endian uint64 length,
a JSON header (the tensors with their sizes, properties and chunk counts, the bytes values, the
shard files, DCP's planner_data and version), zero padding to 8 bytes, then two little-endian
int64 arrays: every chunk's offsets and sizes (tensor by tensor, as the header lists them), and
for each chunk its shard's (file, offset, length). A rank checks all of it with array operations,
then builds a `Metadata` of the chunks it needs (`read_index`). DCP's own readers keep using `.metadata`.
"""

from __future__ import annotations

import itertools
import json
import struct
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from typing import Any, NoReturn

import numpy as np
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

from spotguard.checkpoint.errors import CheckpointError
from spotguard.checkpoint.format.chunk_grid import chunk_boxes, overlapping, tiling_problem

_MAGIC = b"SGDCPIX1"
_PREFIX = struct.Struct("<8sQ")
_INT64 = np.dtype("<i8")
_TRANSFORMS = "transform_descriptors" in _StorageInfo.__dataclass_fields__  # since torch 2.7
_DTYPES = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
_MEMORY_FORMATS = {
    str(v): v for v in (torch.contiguous_format, torch.channels_last, torch.channels_last_3d, torch.preserve_format)
}

Box = tuple[Sequence[int], Sequence[int]]  # a chunk's offsets and sizes
# fqn -> the boxes a rank loads of it; a tensor left out is kept whole (every chunk).
Wanted = Mapping[str, Sequence[Box]]


class RefusedIndex(CheckpointError):
    """A `.metadata.index` that is not one spotguard writes (its message is one line)."""


def index_bytes(metadata: Metadata) -> bytes | None:
    """The index of `metadata` as DCP's writer finished it; None when it holds what the index cannot
    say (storage transforms, another planner's data, a chunk with no storage or storage with no chunk):
    then no index is written and every rank reads `.metadata`. None too when no tensor is split in
    chunks (an unsharded or DDP state): no rank would leave any out."""
    if not any(len(getattr(md, "chunks", ())) > 1 for md in metadata.state_dict_metadata.values()):
        return None
    # map() and attrgetter keep the loops over a million chunks in C (a Python loop: seconds at 1,024 ranks).
    keys, infos = metadata.storage_data.keys(), list(metadata.storage_data.values())
    if set(map(type, infos)) - {_StorageInfo} or (_TRANSFORMS and any(map(attrgetter("transform_descriptors"), infos))):
        return None
    storage = dict(zip(zip(map(attrgetter("fqn"), keys), map(attrgetter("offset"), keys)), infos))
    files = {name: i for i, name in enumerate(sorted(set(map(attrgetter("relative_path"), infos))))}
    tensors, values, boxes, places = [], [], [], []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            info = storage.get((fqn, None))
            if info is None:
                return None
            values.append([fqn, files[info.relative_path], info.offset, info.length])
            continue
        props, rows = md.properties, chunk_boxes(md.chunks, len(md.size))
        if str(props.memory_format) not in _MEMORY_FORMATS or rows is None or tiling_problem(md.size, rows):
            return None  # a layout the reader would refuse: it reads `.metadata` instead
        found = list(map(storage.get, zip(itertools.repeat(fqn), map(attrgetter("offsets"), md.chunks))))
        if any(info is None for info in found):
            return None
        tensors.append({
            "fqn": fqn, "size": list(md.size), "chunks": len(md.chunks),
            "dtype": str(props.dtype).removeprefix("torch."), "layout": str(props.layout),
            "requires_grad": props.requires_grad, "memory_format": str(props.memory_format),
            "pin_memory": props.pin_memory,
        })  # fmt: skip
        boxes.append(rows.ravel())
        places.append(found)
    if len(storage) != len(values) + sum(t["chunks"] for t in tensors):
        return None
    found = list(itertools.chain.from_iterable(places))
    columns = (map(files.__getitem__, map(attrgetter("relative_path"), found)), map(attrgetter("offset"), found),
               map(attrgetter("length"), found))  # fmt: skip
    where = np.stack([np.fromiter(c, dtype=_INT64, count=len(found)) for c in columns], axis=1)
    planner_data = metadata.planner_data
    if planner_data is not None and not (
        isinstance(planner_data, dict)
        and all(isinstance(p, tuple) and all(type(k) in (str, int) for k in p) for p in planner_data.values())
    ):
        return None
    header = {
        "version": getattr(metadata, "version", None), "files": list(files), "tensors": tensors, "bytes": values,
        "planner_data": None if planner_data is None else {k: list(p) for k, p in planner_data.items()},
    }  # fmt: skip
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(len(head) + _PREFIX.size) % 8)  # JSON ignores the trailing spaces
    return b"".join([_PREFIX.pack(_MAGIC, len(head)), head, *(b.tobytes() for b in boxes), where.tobytes()])


def read_index(data: bytes, wanted: Wanted, listed: Callable[[str], bool]) -> Metadata:
    """The `Metadata` of the index `data` holding, of each tensor in `wanted`, only the chunks that
    overlap its boxes (and their storage), of the others every chunk. Everything in the index is
    checked first: the header's shape, every chunk inside its tensor and the chunks tiling it, every
    file `listed` (in the manifest), every storage range well-formed. `RefusedIndex` (one line) if not."""
    try:
        return _read(data, wanted, listed)
    except RefusedIndex:
        raise
    except (ValueError, TypeError, KeyError, OverflowError, struct.error, RecursionError) as exc:
        raise RefusedIndex(f"unreadable metadata index: {type(exc).__name__}: {exc}") from None


def _read(data: bytes, wanted: Wanted, listed: Callable[[str], bool]) -> Metadata:
    magic, head_len = _PREFIX.unpack_from(data)
    if magic != _MAGIC or head_len > len(data) - _PREFIX.size or (head_len + _PREFIX.size) % 8:
        _refuse("not a metadata index (magic or header length)")
    header = json.loads(data[_PREFIX.size : _PREFIX.size + head_len])
    _check_shape(header)
    files = header["files"]
    for name in files:
        if not listed(name):
            _refuse(f"it points at a file the manifest does not list: {name!r}")
    tensors = header["tensors"]
    box_counts = [t["chunks"] * 2 * len(t["size"]) for t in tensors]
    chunk_count = sum(t["chunks"] for t in tensors)
    values = np.frombuffer(data, dtype=_INT64, offset=_PREFIX.size + head_len)
    if len(values) != sum(box_counts) + 3 * chunk_count or len(data) % 8:
        _refuse(f"{len(data)} bytes, not the size its header gives")
    places = values[sum(box_counts) :].reshape(chunk_count, 3)
    if ((places[:, 0] >= len(files)) | (places < 0).any(axis=1)).any():
        _refuse("a storage entry names no file of its own or a negative range")
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    box_ends, chunk_ends = itertools.accumulate(box_counts), itertools.accumulate(t["chunks"] for t in tensors)
    box_start = chunk_start = 0
    for t, box_end, chunk_end in zip(tensors, box_ends, chunk_ends, strict=True):
        fqn, size, d = t["fqn"], t["size"], len(t["size"])
        if fqn in state:
            _refuse(f"{fqn} is listed twice")
        boxes = values[box_start:box_end].reshape(t["chunks"], 2 * d)
        why = tiling_problem(size, boxes)
        if why:
            _refuse(f"{fqn}: {why}")
        # A tensor the rank does not say it loads, or of another rank than saved (DCP's planner then reports
        # the mismatch itself): every chunk.
        mine = wanted.get(fqn)
        fits = mine is not None and all(len(o) == len(n) == d for o, n in mine)
        kept = np.flatnonzero(overlapping(boxes, mine)) if fits else np.arange(len(boxes))
        chunks = []
        for row, (file, offset, length) in zip(
            boxes[kept].tolist(), places[chunk_start:chunk_end][kept].tolist(), strict=True
        ):
            chunk = ChunkStorageMetadata(offsets=torch.Size(row[:d]), sizes=torch.Size(row[d:]))
            chunks.append(chunk)
            storage[MetadataIndex(fqn, chunk.offsets)] = _StorageInfo(files[file], offset, length)
        state[fqn] = TensorStorageMetadata(_properties(t), torch.Size(size), chunks)
        box_start, chunk_start = box_end, chunk_end
    for fqn, file, offset, length in header["bytes"]:
        if fqn in state or file >= len(files):
            _refuse(f"the bytes value {fqn} is listed twice or its storage is out of range")
        state[fqn] = BytesStorageMetadata()
        storage[MetadataIndex(fqn)] = _StorageInfo(files[file], offset, length)
    paths = header["planner_data"]
    planner_data = None if paths is None else {k: tuple(p) for k, p in paths.items()}
    metadata = Metadata(state, planner_data=planner_data, storage_data=storage)
    metadata.version = header["version"]  # a field since torch 2.6
    return metadata


def _properties(t: dict[str, Any]) -> TensorProperties:
    return TensorProperties(
        dtype=_DTYPES[t["dtype"]],
        layout=_LAYOUTS[t["layout"]],
        requires_grad=t["requires_grad"],
        memory_format=_MEMORY_FORMATS[t["memory_format"]],
        pin_memory=t["pin_memory"],
    )


_TENSOR_FIELDS = {
    "fqn": str, "size": list, "chunks": int, "dtype": str, "layout": str,
    "requires_grad": bool, "memory_format": str, "pin_memory": bool,
}  # fmt: skip


def _check_shape(header: Any) -> None:
    """The header's keys and types, so that reading it afterwards cannot meet a surprise."""
    fields = {
        "version": (str, type(None)),
        "files": list,
        "tensors": list,
        "bytes": list,
        "planner_data": (dict, type(None)),
    }
    if not isinstance(header, dict) or set(header) != set(fields):
        _refuse("its header does not have the fields of one")
    for name, kind in fields.items():
        if not isinstance(header[name], kind):
            _refuse(f"its header's {name} is a {type(header[name]).__name__}")
    if not all(isinstance(f, str) for f in header["files"]) or len(set(header["files"])) != len(header["files"]):
        _refuse("its file names are not distinct strings")
    for t in header["tensors"]:
        if not isinstance(t, dict) or set(t) != set(_TENSOR_FIELDS):
            _refuse("a tensor entry does not have the fields of one")
        for name, kind in _TENSOR_FIELDS.items():
            if not isinstance(t[name], kind) or (kind is int and isinstance(t[name], bool)):
                _refuse(f"a tensor's {name} is a {type(t[name]).__name__}")
        if not _ints(t["size"]) or t["chunks"] < 0:
            _refuse(f"{t['fqn']}: its size or chunk count is not one a tensor has")
        if t["dtype"] not in _DTYPES or t["layout"] not in _LAYOUTS or t["memory_format"] not in _MEMORY_FORMATS:
            _refuse(f"{t['fqn']}: a dtype, layout or memory format torch does not have")
    for entry in header["bytes"]:
        if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str) and _ints(entry[1:])):
            _refuse("a bytes entry is not [fqn, file, offset, length]")
    for key, path in (header["planner_data"] or {}).items():
        if not (isinstance(path, list) and all(type(p) in (str, int) for p in path)):
            _refuse(f"the planner data of {key} is not a path")


def _ints(values: list[Any]) -> bool:
    return all(type(v) is int and v >= 0 for v in values)


def _refuse(why: str) -> NoReturn:
    raise RefusedIndex(f"metadata index refused: {why}")
