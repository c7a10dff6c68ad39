"""One rank's snapshot as one file: complete or absent, checked by a CRC32C.

    body: skeleton (torch.save of the state with every tensor on "meta") | each tensor's bytes, in order
          (each part padded to 64 bytes)
    trailer: JSON (run, job, step, rank, world size, the skeleton's and the body's lengths, the body's
             CRC32C) | its length (8 bytes) | MAGIC

The body is laid out first and filled through a memory map (`MappedShard`): copying the state in
is writing the file. The trailer comes last, once the body's checksum is known. A file is made as
`<name>.part` and renamed once whole: a file under its final name is complete, and it counts only
when its body matches the trailer's CRC32C (`verify`). The skeleton loads with torch's weights-only
unpickler: a snapshot cannot run code.
"""

from __future__ import annotations

import dataclasses
import io
import json
import mmap
import os
import stat
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch
from torch.distributed.tensor import DTensor

from spotguard.checkpoint.shard_io import crc32c_extend

MAGIC = b"SGSNAP01"
_TAIL = struct.Struct("!Q8s")  # the trailer's length, MAGIC
_READ = 8 << 20
MAX_TRAILER = 1 << 20


class SnapshotError(RuntimeError):
    """A snapshot file is malformed, incomplete or fails its checksum."""


class SnapshotLoadError(SnapshotError):
    """Every rank had its checked shard, and loading them into the state failed on some rank: the
    state may be overwritten in part (raised on every rank)."""


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """What a snapshot file's trailer says; `body_bytes + trailer` is the file's size."""

    run: str  # the checkpoint location's key
    job: str  # the job identity its checkpoint location holds
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


class MappedShard:
    """A snapshot file being made: its body mapped into memory and filled in place, so the copy of
    the state is the write (no second copy through a buffer). `finish` checksums it, appends the
    trailer and gives it its final name; until then it is a `.part` file that `discard` removes.

    `take_spare(path)` may move a freed snapshot's file there first: its tmpfs pages are reused,
    which costs about half of writing into new ones.
    """

    def __init__(
        self, path: Path, state_dict: Mapping[str, Any], take_spare: Callable[[Path], bool] | None = None
    ) -> None:
        skeleton = io.BytesIO()
        torch.save(_skeleton(state_dict), skeleton)
        self._skeleton = skeleton.getbuffer()
        self._tensors = [(t.shape, t.dtype, _padded(t.numel() * t.element_size())) for t in tensors_of(state_dict)]
        self.body_bytes = _padded(len(self._skeleton)) + sum(size for _, _, size in self._tensors)
        self.path = path
        self._part = path.with_name(path.name + ".part")
        self._fd = reserve(self._part, self.body_bytes, take_spare)
        try:
            self._map = mmap.mmap(self._fd, self.body_bytes, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            self.discard()
            raise

    def fill(self, state_dict: Mapping[str, Any]) -> MappedShard:
        """Copy `state_dict` (the one the layout was made from, or its staged copy) into the file; the
        shard, for `finish`. On a failure the file is discarded."""
        try:
            self._fill(state_dict)
        except BaseException:
            self.discard()
            raise
        return self

    def _fill(self, state_dict: Mapping[str, Any]) -> None:
        body = torch.frombuffer(self._map, dtype=torch.uint8)
        try:
            body[: len(self._skeleton)].copy_(torch.frombuffer(self._skeleton, dtype=torch.uint8))
            offset = _padded(len(self._skeleton))
            for tensor, (shape, dtype, size) in zip(tensors_of(state_dict), self._tensors, strict=True):
                nbytes = tensor.numel() * tensor.element_size()
                body[offset : offset + nbytes].view(dtype).view(shape).copy_(tensor.detach())
                offset += size
        finally:
            del body  # no view of the map may outlive it (closing a map with views raises)

    def finish(self, *, run: str, job: str, step: int, rank: int, world_size: int) -> ShardInfo:
        """Checksum the body, append the trailer, and give the file its final name."""
        try:
            crc = crc32c_extend(0, self._map)
            info = ShardInfo(run, job, step, rank, world_size, len(self._skeleton), self.body_bytes, f"{crc:08x}")
            self._map.close()
            trailer = info.encoded()
            os.pwrite(self._fd, trailer, self.body_bytes)
            os.ftruncate(self._fd, self.body_bytes + len(trailer))  # a longer spare's tail goes
            os.close(self._fd)
            self._fd = -1
            os.replace(self._part, self.path)
        except BaseException:
            self.discard()
            raise
        return info

    def discard(self) -> None:
        try:
            if getattr(self, "_map", None) is not None and not self._map.closed:
                self._map.close()
        except BufferError:  # a view still lives (a traceback holds it): the map goes when it does
            pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._part.unlink(missing_ok=True)


def reserve(part: Path, size: int, take_spare: Callable[[Path], bool] | None = None) -> int:
    """A descriptor of a new file `part` of `size` bytes whose pages are reserved: a full tmpfs
    fails here with ENOSPC (an OSError), never later as a SIGBUS on a store into a mapped page
    that cannot be backed. The file is this process's own: created exclusively, never through a
    link (a spare moved in from the node's private directory is opened without following one)."""
    part.unlink(missing_ok=True)  # a crash's leftover: the directory is private, so it is ours
    reused = take_spare is not None and take_spare(part)
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (0 if reused else os.O_CREAT | os.O_EXCL)
    fd = os.open(part, flags, 0o600)
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid():
            raise SnapshotError(f"{part} is not a file of this user's")
        os.ftruncate(fd, size)  # a longer spare's tail goes
        os.posix_fallocate(fd, 0, size)
    except BaseException:
        os.close(fd)
        part.unlink(missing_ok=True)
        raise
    return fd


_ALIGN = 64  # every part of the body starts 64-byte aligned: a tensor is a view of the mapped bytes
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # map every page at once, not one fault per page


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def read_info(path: Path) -> ShardInfo:
    """The trailer of the snapshot file at `path` (not its checksum: see `verify`)."""
    with open(path, "rb") as f:
        return trailer_of(f, os.fstat(f.fileno()).st_size)


def trailer_of(f: BinaryIO, size: int) -> ShardInfo:
    """The trailer of the open snapshot file `f` of `size` bytes."""
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


class Source(Protocol):
    """Where a snapshot's body is read from, in order: a file, or a peer's connection."""

    def read_exactly(self, view: memoryview) -> None: ...


class _FileSource:
    """A snapshot file as a `Source`: the body's CRC32C computed as it is read."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.got = 0
        self.crc = 0

    def read_exactly(self, view: memoryview) -> None:
        if self.f.readinto(view) != len(view):
            raise SnapshotError("the file ended early")
        self.crc = crc32c_extend(self.crc, view)
        self.got += len(view)

    def read_rest(self, body_bytes: int) -> None:
        buffer = memoryview(bytearray(_READ))
        while self.got < body_bytes:
            self.read_exactly(buffer[: min(_READ, body_bytes - self.got)])


def load(path: Path, live: Mapping[str, Any]) -> tuple[ShardInfo, dict[str, Any]]:
    """The trailer and the state dict of the snapshot file at `path`, in one read: its tensors read
    straight into the matching tensors of `live` (the DCP state dict of the state being resumed)
    where shape and dtype agree, else into new ones, and its body's CRC32C checked as it is read
    (SnapshotError when it does not match: `live` may then be overwritten in part)."""
    with open(path, "rb") as f:
        info = trailer_of(f, os.fstat(f.fileno()).st_size)
        f.seek(0)
        source = _FileSource(f)
        try:
            loaded = read_body(source, info.skeleton_bytes, live)
        except SnapshotError as exc:  # damage in the skeleton, say: the checksum names the cause
            source.read_rest(info.body_bytes)
            if f"{source.crc:08x}" == info.crc32c:
                raise
            problem: BaseException | None = exc
        else:
            problem = None
    if source.got != info.body_bytes or f"{source.crc:08x}" != info.crc32c:
        raise SnapshotError(f"CRC32C {source.crc:08x} does not match the trailer's {info.crc32c}") from problem
    return info, loaded


def read_body(source: Source, skeleton_bytes: int, live: Mapping[str, Any]) -> dict[str, Any]:
    """A snapshot's body from `source` (not checked here: the caller checks its CRC32C), as `load`."""
    head = bytearray(_padded(skeleton_bytes))
    source.read_exactly(memoryview(head))
    try:
        skeleton = torch.load(io.BytesIO(head[:skeleton_bytes]), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means an unusable file
        raise SnapshotError(f"its state skeleton does not load: {type(exc).__name__}: {exc}") from None
    return _fill(skeleton, live, source, bytearray(_ALIGN))


def _fill(skeleton: Any, live: Any, source: Source, pad: bytearray) -> Any:
    if isinstance(skeleton, torch.Tensor):
        target = live.to_local() if isinstance(live, DTensor) else live
        same = isinstance(target, torch.Tensor) and (target.shape, target.dtype) == (skeleton.shape, skeleton.dtype)
        fits = same and target.device.type == "cpu" and target.is_contiguous()
        out = target.detach() if fits else torch.empty(skeleton.shape, dtype=skeleton.dtype)
        view = _bytes_of(out)
        source.read_exactly(view)
        source.read_exactly(memoryview(pad)[: _padded(len(view)) - len(view)])
        if same and not fits:
            target.detach().copy_(out)  # a GPU tensor, or one not contiguous: copied into it
        return live if same else out
    if isinstance(skeleton, Mapping):
        live = live if isinstance(live, Mapping) else {}
        return {k: _fill(v, live.get(k), source, pad) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        live = live if isinstance(live, (list, tuple)) and len(live) == len(skeleton) else [None] * len(skeleton)
        return type(skeleton)(_fill(v, w, source, pad) for v, w in zip(skeleton, live, strict=True))
    return skeleton


def parse_trailer(data: bytes) -> ShardInfo:
    """A trailer (with its length and MAGIC) as it came over the wire."""
    length, magic = _TAIL.unpack(data[-_TAIL.size :])
    if magic != MAGIC or length != len(data) - _TAIL.size:
        raise SnapshotError("not a snapshot trailer")
    try:
        return ShardInfo(**json.loads(data[:length]))
    except (ValueError, TypeError) as exc:
        raise SnapshotError(f"malformed trailer: {exc}") from None
