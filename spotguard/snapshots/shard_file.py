"""One rank's snapshot as one file: complete or absent, checked by a CRC32C.

    body: skeleton (torch.save of the state with every tensor on "meta") | each tensor's bytes, in order
    trailer: JSON (run, step, rank, world size, the body's length and CRC32C) | its length (8 bytes) | MAGIC

The trailer comes last so that the body streams out as it is written, its checksum computed on the
way. A file is written as `<name>.part` and renamed once whole: a file under its final name is
complete, and it counts only when its body matches the trailer's CRC32C (`verify`). The skeleton
loads with torch's weights-only unpickler: a snapshot cannot run code.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.tensor import DTensor

from spotguard.checkpoint.shard_io import crc32c_extend

MAGIC = b"SGSNAP01"
_TAIL = struct.Struct("!Q8s")  # the trailer's length, MAGIC
_READ = 8 << 20
MAX_TRAILER = 1 << 20


class SnapshotError(RuntimeError):
    """A snapshot file is malformed, incomplete or fails its checksum."""


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """What a snapshot file's trailer says; `body_bytes + trailer` is the file's size."""

    run: str
    step: int
    rank: int
    world_size: int
    skeleton_bytes: int
    body_bytes: int
    crc32c: str

    def encoded(self) -> bytes:
        trailer = json.dumps(dataclasses.asdict(self)).encode()
        return trailer + _TAIL.pack(len(trailer), MAGIC)


def tensors_of(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors of a (DCP) state dict in a fixed order: the order of the skeleton's walk."""
    if isinstance(tree, DTensor):
        yield tree.to_local()
    elif isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, Mapping):
        for value in tree.values():
            yield from tensors_of(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from tensors_of(value)


def _skeleton(tree: Any) -> Any:
    if isinstance(tree, DTensor):
        tree = tree.to_local()
    if isinstance(tree, torch.Tensor):
        return torch.empty(tree.shape, dtype=tree.dtype, device="meta")
    if isinstance(tree, Mapping):
        return {k: _skeleton(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_skeleton(v) for v in tree)
    return tree


def write(path: Path, staged: Mapping[str, Any], *, run: str, step: int, rank: int, world_size: int) -> ShardInfo:
    """Write `staged` (a state dict whose tensors are contiguous host copies) to `path`, whole or not at all."""
    skeleton = io.BytesIO()
    torch.save(_skeleton(staged), skeleton)
    part = path.with_name(path.name + ".part")
    crc = size = 0
    try:
        with open(part, "wb") as f:
            for chunk in (skeleton.getbuffer(), *(_bytes_of(t) for t in tensors_of(staged))):
                f.write(chunk)
                crc = crc32c_extend(crc, chunk)
                size += len(chunk)
            info = ShardInfo(run, step, rank, world_size, len(skeleton.getbuffer()), size, f"{crc:08x}")
            f.write(info.encoded())
        os.replace(part, path)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return info


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def read_info(path: Path) -> ShardInfo:
    """The trailer of the snapshot file at `path` (not its checksum: see `verify`)."""
    with open(path, "rb") as f:
        return _trailer(f, os.fstat(f.fileno()).st_size)


def _trailer(f: BinaryIO, size: int) -> ShardInfo:
    if size < _TAIL.size:
        raise SnapshotError(f"{size} bytes: too short for a snapshot")
    f.seek(size - _TAIL.size)
    length, magic = _TAIL.unpack(f.read(_TAIL.size))
    if magic != MAGIC or length > min(MAX_TRAILER, size - _TAIL.size):
        raise SnapshotError("not a snapshot file (no trailer)")
    f.seek(size - _TAIL.size - length)
    try:
        info = ShardInfo(**json.loads(f.read(length)))
    except (ValueError, TypeError) as exc:
        raise SnapshotError(f"malformed trailer: {exc}") from None
    if info.body_bytes != size - _TAIL.size - length:
        raise SnapshotError(f"the body is {size - _TAIL.size - length} bytes, the trailer says {info.body_bytes}")
    return info


def verify(path: Path) -> ShardInfo:
    """The trailer of `path` once its body matches the CRC32C there; SnapshotError otherwise."""
    with open(path, "rb") as f:
        info = _trailer(f, os.fstat(f.fileno()).st_size)
        f.seek(0)
        crc, left, buffer = 0, info.body_bytes, bytearray(_READ)
        while left:
            n = f.readinto(memoryview(buffer)[: min(_READ, left)])
            if not n:
                raise SnapshotError("the file ended early")
            crc = crc32c_extend(crc, memoryview(buffer)[:n])
            left -= n
    if f"{crc:08x}" != info.crc32c:
        raise SnapshotError(f"CRC32C {crc:08x} does not match the trailer's {info.crc32c}")
    return info


def load(path: Path, live: Mapping[str, Any]) -> dict[str, Any]:
    """The state dict in `path`, its tensors read straight into the matching tensors of `live` (the
    DCP state dict of the state being resumed) where shape and dtype agree, else into new ones."""
    with open(path, "rb") as f:
        info = _trailer(f, os.fstat(f.fileno()).st_size)
        f.seek(0)
        try:
            skeleton = torch.load(io.BytesIO(f.read(info.skeleton_bytes)), weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unpickling failure means an unusable file
            raise SnapshotError(f"its state skeleton does not load: {type(exc).__name__}: {exc}") from None
        return _fill(skeleton, live, f)


def _fill(skeleton: Any, live: Any, f: BinaryIO) -> Any:
    if isinstance(skeleton, torch.Tensor):
        target = live.to_local() if isinstance(live, DTensor) else live
        fits = (
            isinstance(target, torch.Tensor)
            and target.shape == skeleton.shape
            and target.dtype == skeleton.dtype
            and target.device.type == "cpu"
            and target.is_contiguous()
        )
        out = target.detach() if fits else torch.empty(skeleton.shape, dtype=skeleton.dtype)
        view = _bytes_of(out)
        if f.readinto(view) != len(view):
            raise SnapshotError("the file ended early")
        if (
            not fits
            and isinstance(target, torch.Tensor)
            and (target.shape, target.dtype)
            == (
                skeleton.shape,
                skeleton.dtype,
            )
        ):
            target.detach().copy_(out)  # a GPU tensor, or one not contiguous: copied into it
            return live
        return live if fits else out
    if isinstance(skeleton, Mapping):
        live = live if isinstance(live, Mapping) else {}
        return {k: _fill(v, live.get(k), f) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        live = live if isinstance(live, (list, tuple)) and len(live) == len(skeleton) else [None] * len(skeleton)
        return type(skeleton)(_fill(v, w, f) for v, w in zip(skeleton, live, strict=True))
    return skeleton
