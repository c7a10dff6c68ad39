"""One rank's snapshot as one file: complete or absent, checked by CRC32C block by block.

    body: the rank's items in the order DCP's save planner lists them (`items.laid_out`), each part
          padded to 64 bytes: a tensor chunk's raw bytes (row-major), or a non-tensor value as
          torch.save wrote it
    trailer: JSON (run, job, attempt, step, rank, world size, the body's length, the block size, the
             CRC32C of each block of the body, the items' index, each item's path in the state) |
             its length (8 bytes) | its CRC32C (4 bytes) | MAGIC

The body is laid out first and filled through a memory map (`MappedShard`): copying the state in
is writing the file. The trailer comes last, once the checksums are known. A file is made as
`<name>.part` and renamed once whole: a file under its final name is complete, and what is read
of it counts only when its blocks match the trailer's CRC32Cs. A block checksum lets a rank that
needs a part of another rank's shard (a resume at another world size) read and check that part
alone. Non-tensor values load with a weights-only unpickler: a snapshot cannot run code.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math
import mmap
import os
import stat
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from spotguard.checkpoint.io.checksums import crc32c_extend
from spotguard.checkpoint.io.libc import libc_function
from spotguard.snapshots.items import BYTES, LayoutError, StoredItem, laid_out, metadata_of, stored

MAGIC = b"SGSNAP02"
_TAIL = struct.Struct("!QL8s")  # the trailer's length, its CRC32C, MAGIC
BLOCK = 4 << 20  # the body's bytes per CRC32C
MAX_TRAILER = 64 << 20


class SnapshotError(RuntimeError):
    """A snapshot file is malformed, incomplete or fails its checksum."""


class SnapshotLoadError(SnapshotError):
    """A snapshot did not load whole after ranks began writing it into the state (its reads failed
    everywhere, or pushing it into the user's objects failed on some rank): the state may be
    overwritten in part (raised on every rank)."""


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """What a snapshot file's trailer says; `body_bytes + trailer` is the file's size."""

    run: str  # the checkpoint location's key
    job: str  # the job identity its checkpoint location holds
    attempt: str  # the start of the job that took it (a new one at every start)
    step: int
    rank: int
    world_size: int
    body_bytes: int
    block_bytes: int
    blocks: tuple[str, ...]  # the CRC32C of each block of the body, in hex
    items: tuple[StoredItem, ...]
    paths: Mapping[str, list[Any]]  # each item's path in the state ("optim.step" -> ["optim", "step"])

    def encoded(self) -> bytes:
        fields = {**dataclasses.asdict(self), "items": [item.encoded() for item in self.items]}
        trailer = json.dumps(fields, separators=(",", ":")).encode()
        return trailer + _TAIL.pack(len(trailer), crc32c_extend(0, trailer), MAGIC)

    @classmethod
    def decoded(cls, raw: bytes, crc: int) -> ShardInfo:
        """The trailer's JSON `raw`, checked against its CRC32C `crc` and for an index that fits the body."""
        if crc32c_extend(0, raw) != crc:
            raise SnapshotError("the trailer does not match its CRC32C")
        try:
            fields = json.loads(raw)
            fields["items"] = tuple(StoredItem.decoded(item) for item in fields["items"])
            fields["blocks"] = tuple(fields["blocks"])
            info = cls(**fields)
        except (ValueError, TypeError, KeyError) as exc:
            raise SnapshotError(f"malformed trailer: {exc}") from None
        if info.block_bytes <= 0 or len(info.blocks) != -(-info.body_bytes // info.block_bytes):
            raise SnapshotError("malformed trailer: the block checksums do not cover the body")
        end = 0
        for item in info.items:  # in body order, apart, within the body, each tensor's size its shape's
            size = None if item.dtype == BYTES else math.prod(item.chunk_sizes) * item.torch_dtype.itemsize
            if item.offset < end or item.offset + item.nbytes > info.body_bytes or size not in (None, item.nbytes):
                raise SnapshotError(f"malformed trailer: the index of {item.fqn} does not fit the body")
            end = item.offset + item.nbytes
        try:  # each tensor's chunks inside it and apart: a copy found wrong is struck off alone
            metadata_of({info.rank: info.items}, whole=False)
        except LayoutError as exc:
            raise SnapshotError(f"malformed trailer: {exc}") from None
        return info


class BlockCrcs:
    """The CRC32C of each `block_bytes` block of a byte stream fed in order (any piece sizes)."""

    def __init__(self, block_bytes: int = BLOCK) -> None:
        self.block_bytes = block_bytes
        self.crcs: list[str] = []
        self._crc = 0
        self._filled = 0

    def update(self, data: memoryview | bytes | mmap.mmap) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            n = min(len(view), self.block_bytes - self._filled)
            self._crc = crc32c_extend(self._crc, view[:n])
            self._filled += n
            view = view[n:]
            if self._filled == self.block_bytes:
                self._close()

    def finish(self) -> tuple[str, ...]:
        if self._filled:
            self._close()
        return tuple(self.crcs)

    def _close(self) -> None:
        self.crcs.append(f"{self._crc:08x}")
        self._crc = self._filled = 0


class BlockCheck:
    """Checks the blocks of a body read in runs (each starting at a block's start): a block is
    compared with the trailer's CRC32C as soon as its last byte arrives."""

    def __init__(self, info: ShardInfo, name: str) -> None:
        self.info = info
        self.name = name
        self._block = -1
        self._crc = self._filled = 0

    def start(self, offset: int) -> None:
        """A run begins at `offset` (a block's start)."""
        if offset % self.info.block_bytes:
            raise ValueError(f"a run starts at {offset}, inside a block")
        self._block, self._crc, self._filled = offset // self.info.block_bytes, 0, 0

    def update(self, view: memoryview) -> None:
        view = view.cast("B")
        while len(view):
            size = min(self.info.block_bytes, self.info.body_bytes - self._block * self.info.block_bytes)
            n = min(len(view), size - self._filled)
            self._crc = crc32c_extend(self._crc, view[:n])
            self._filled += n
            view = view[n:]
            if self._filled == size:
                expected = self.info.blocks[self._block]
                if f"{self._crc:08x}" != expected:
                    raise SnapshotError(f"{self.name}: block {self._block}: CRC32C {self._crc:08x} does not "
                                        f"match the trailer's {expected}")  # fmt: skip
                self._block, self._crc, self._filled = self._block + 1, 0, 0


class MappedShard:
    """A snapshot file being made: its body mapped into memory and filled in place, so the copy of
    the state is the write (no second copy through a buffer). `finish` checksums it, appends the
    trailer and gives it its final name; until then it is a `.part` file that `discard` removes.

    The layout is DCP's list of this rank's items of `state_dict` (its staged copy, for a GPU
    state). `take_spare(path)` may move a freed snapshot's file there first: its tmpfs pages are
    reused, which costs about half of writing into new ones.
    """

    def __init__(
        self, path: Path, state_dict: Mapping[str, Any], take_spare: Callable[[Path], bool] | None = None
    ) -> None:
        self._entries, self._paths = laid_out(state_dict)
        self._items: list[StoredItem] = []
        offset = 0
        for entry in self._entries:
            self._items.append(stored(entry, offset))
            offset += _padded(self._items[-1].nbytes)
        self.body_bytes = offset
        self.path = path
        self._part = path.with_name(path.name + ".part")
        self._fd = reserve(self._part, max(1, self.body_bytes), take_spare)
        try:
            self._map = map_populated(self._fd, max(1, self.body_bytes))
        except BaseException:
            self.discard()
            raise

    def fill(self) -> MappedShard:
        """Copy the items into the file; the shard, for `finish`. On a failure the file is discarded."""
        try:
            self._fill()
        except BaseException:
            self.discard()
            raise
        return self

    def _fill(self) -> None:
        body = torch.frombuffer(self._map, dtype=torch.uint8)
        try:
            for entry, item in zip(self._entries, self._items, strict=True):
                part = body[item.offset : item.offset + item.nbytes]
                if isinstance(entry.data, bytes):
                    part.copy_(torch.frombuffer(bytearray(entry.data), dtype=torch.uint8))
                elif item.nbytes:
                    part.view(entry.data.dtype).view(entry.data.shape).copy_(entry.data)
        finally:
            del body  # no view of the map may outlive it (closing a map with views raises)
        self._entries = []  # the state's tensors are not held past the copy

    def finish(self, *, run: str, job: str, attempt: str, step: int, rank: int, world_size: int) -> ShardInfo:
        """Checksum the body block by block, append the trailer, and give the file its final name."""
        try:
            crcs = BlockCrcs()
            crcs.update(memoryview(self._map)[: self.body_bytes])
            info = ShardInfo(run, job, attempt, step, rank, world_size, self.body_bytes, crcs.block_bytes,
                             crcs.finish(), tuple(self._items), self._paths)  # fmt: skip
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


def map_populated(fd: int, size: int) -> mmap.mmap:
    """`size` bytes of the file `fd`, mapped shared, every page mapped at once: a fault per 4 KiB page
    costs about 0.3 s of CPU per GiB. Populated by madvise(MADV_POPULATE_WRITE) through ctypes, which
    releases the GIL: mmap's MAP_POPULATE holds it for as long as the kernel takes (about 1 s per GiB of
    new tmpfs pages here), every other thread of the process stalled. A kernel before 5.14 refuses the
    madvise: MAP_POPULATE then, as before."""
    mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    if _madvise is not None:
        anchor = ctypes.c_char.from_buffer(mapped)  # its address; the export ends with `anchor`
        address = ctypes.addressof(anchor)
        del anchor
        if _madvise(address, size, _MADV_POPULATE_WRITE) == 0:
            return mapped
    mapped.close()
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


_MADV_POPULATE_WRITE = 23  # linux/mman.h, Linux 5.14


_madvise = libc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def read_info(path: Path) -> ShardInfo:
    """The trailer of the snapshot file at `path` (its blocks are checked as they are read)."""
    with open(path, "rb") as f:
        return trailer_of(f, os.fstat(f.fileno()).st_size)


def trailer_of(f: BinaryIO, size: int) -> ShardInfo:
    """The trailer of the open snapshot file `f` of `size` bytes."""
    if size < _TAIL.size:
        raise SnapshotError(f"{size} bytes: too short for a snapshot")
    f.seek(size - _TAIL.size)
    length, crc, magic = _TAIL.unpack(f.read(_TAIL.size))
    if magic != MAGIC or length > min(MAX_TRAILER, size - _TAIL.size):
        raise SnapshotError("not a snapshot file (no trailer)")
    f.seek(size - _TAIL.size - length)
    info = ShardInfo.decoded(f.read(length), crc)
    if info.body_bytes != size - _TAIL.size - length:
        raise SnapshotError(f"the body is {size - _TAIL.size - length} bytes, the trailer says {info.body_bytes}")
    return info


def parse_trailer(data: bytes) -> ShardInfo:
    """A trailer (with its length and MAGIC) as it came over the wire."""
    length, crc, magic = _TAIL.unpack(data[-_TAIL.size :])
    if magic != MAGIC or length != len(data) - _TAIL.size:
        raise SnapshotError("not a snapshot trailer")
    return ShardInfo.decoded(data[:length], crc)
