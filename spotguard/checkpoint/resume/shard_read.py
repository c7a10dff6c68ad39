"""How a step's shard files get read fast: one pass, several files at a time, checked as the bytes go by.

DCP's own reader goes through a rank's files one after another, and a resume that checks the
files first reads every byte twice. Here each file that this rank's load plan touches is read
once, from its first byte to its last, `threads` files at a time: the CRC32C (and, with a
checkpoint key, the SHA-256) is computed from the bytes as they are read, and the records
the plan needs are copied into the state on the way, straight from the read buffer (a tensor record
is viewed where it lies, not loaded into new memory first). A record bound for a GPU is read into a
buffer of the process's pinned pool (`bounce`) and copied to the device on the copy stream while
the thread reads the next record into another buffer. Only at a file's end is it
known whether it matched its manifest: `Damaged` then tells resume that what was copied from
it is wrong, and resume loads an older step over the whole state (or, when no step loads,
refuses to start from a half-loaded state). A rank that needs part of a file still reads all
of it, so that every byte it used was checked.

A state in host memory, loaded without a checkpoint key, is read by `piece_read` instead: the same
checks, with the files' bytes read in pieces by threads that any file's pieces go to, and large tensors
read straight into their memory (no copy). Records that cannot be are delivered by this module's loader.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from spotguard.checkpoint.errors import CheckpointError, Damaged
from spotguard.checkpoint.format.manifest import FileRecord, mismatch
from spotguard.checkpoint.io import bounce
from spotguard.checkpoint.io.bounce import IN_FLIGHT, BouncePool, Lease, Pipeline
from spotguard.checkpoint.io.checksums import RunningChecksum
from spotguard.checkpoint.resume.piece_read import ReadBuffer, read_in_pieces, reader_count
from spotguard.checkpoint.resume.records import RecordFile, records_in
from spotguard.checkpoint.state import tensors_of

_GAP_CHUNK = 8 << 20  # bytes between and after the records are read (and checked) this much at a time


def read_checked(
    step_dir: Path,
    plan: LoadPlan,
    planner: LoadPlanner,
    storage_data: Mapping[Any, Any],
    records: Mapping[str, FileRecord],
    *,
    threads: int,
    sha256: bool,
) -> None:
    """Load `plan`'s items from `step_dir` into the planner's state, checking each file against `records`.

    Raises Damaged for the first file (in plan order) that differs from its record, and
    CheckpointError for a plan that names a file the manifest does not list.
    """
    per_file: dict[str, list[ReadItem]] = {}
    for item in plan.items:
        info = storage_data[item.storage_index]
        if getattr(info, "transform_descriptors", None):  # spotguard never writes them
            raise CheckpointError(f"{step_dir}: {info.relative_path} was written with transforms spotguard cannot read")
        per_file.setdefault(info.relative_path, []).append(item)
    unlisted = sorted(set(per_file) - set(records))
    if unlisted:
        raise CheckpointError(f"{step_dir}: the load plan reads files the manifest does not list: {unlisted}")
    readers = max(1, min(threads, len(per_file)))
    # Records bound for a GPU cross through pinned buffers (pageable ones, for records larger than a buffer).
    pool = bounce.pool_for(list(tensors_of(planner.state_dict)), readers + IN_FLIGHT)
    loader = _Loader(planner, storage_data, pool)
    work = [(step_dir / name, records[name], items) for name, items in per_file.items()]
    if pool is None and not sha256:  # a CPU state: in pieces, large tensors read straight into their memory
        read_in_pieces(work, storage_data, planner, loader.deliver, loader.lock, threads=reader_count(threads))
        return
    if pool is not None:
        pool.stream.follow()  # the copies into the state come after the work queued on it (a fresh optimizer's)
    with ThreadPoolExecutor(readers, thread_name_prefix="spotguard-read") as pool:
        futures = [pool.submit(loader.read_file, *args, sha256=sha256) for args in work]
        for future in futures:  # every file is finished (or failed) before the first error is raised
            future.exception()
        for future in futures:
            future.result()


class _Loader:
    """Reads whole files and hands their records to the planner; the planner is called by one thread at a time."""

    def __init__(self, planner: LoadPlanner, storage_data: Mapping[Any, Any], pool: BouncePool | None) -> None:
        self._planner = planner
        self._storage_data = storage_data
        self._lock = threading.Lock()
        self._buffers = _Buffers()
        self._pool = pool

    @property
    def lock(self) -> threading.Lock:
        """Held around every call into the planner."""
        return self._lock

    def deliver(self, data: memoryview, items: list[ReadItem]) -> None:
        """Hand a record read into host memory to the planner: copied into the state now."""
        self._deliver(data, items, None, None)

    def read_file(self, path: Path, record: FileRecord, items: list[ReadItem], *, sha256: bool) -> None:
        records = records_in(path, record.size, items, self._storage_data)
        reader = _CheckingReader(path, self._buffers, sha256=sha256)
        pipeline = Pipeline(self._pool) if self._pool is not None else None
        lease = None
        failure: Exception | None = None
        try:
            for offset, length, readers in records:
                reader.skip(offset - reader.position)
                if pipeline is not None and 0 < length <= pipeline.pool.buffer_bytes:
                    lease = pipeline.lease(length)
                    data = reader.take_into(lease.bytes())
                else:
                    data = reader.take(length)
                if len(data) < length:
                    break  # the file is short: the size check below says so
                try:
                    self._deliver(data, readers, pipeline, lease)
                    lease = None
                except Exception as exc:  # a damaged file explains it better: read on to its end first
                    failure = exc
                    break
            if pipeline is not None and failure is None:
                pipeline.drain()  # the copies to the device done, their items committed
            reader.skip_to_end()
        finally:
            reader.close()
            if pipeline is not None:
                pipeline.abandon(lease)  # after a failure: the copies in flight waited for, the buffers back
        wrong = mismatch(reader.record(record.name), record, sha256=sha256)
        if wrong:
            raise Damaged(f"{path.parent}/{wrong}") from failure
        if failure is not None:
            raise failure

    def _deliver(
        self, data: memoryview, items: Iterable[ReadItem], pipeline: Pipeline | None, lease: Lease | None
    ) -> None:
        """Hand a record's items to the planner: copied into the state now or, when the record was read
        into `lease`, on the copy stream, committed once the copies are done."""
        items = list(items)
        if items[0].type == LoadItemType.BYTE_IO:
            with self._lock:
                for item in items:
                    self._planner.load_bytes(item, io.BytesIO(data))
            if lease is not None:
                pipeline.submit(lease)  # type: ignore[union-attr]
            return
        stored = _stored_tensor(data)
        copied = []
        for item in items:
            piece = narrow_tensor_by_index(stored, item.storage_offsets, item.lengths)
            with self._lock:
                target = self._planner.resolve_tensor(item).detach()
            if target.size() != piece.size():
                stored_size, wanted = tuple(piece.size()), tuple(target.size())
                raise CheckpointError(f"{item.storage_index}: stored {stored_size}, the state has {wanted}")
            if lease is None:
                target.copy_(piece)
            else:
                pipeline.copy(lease, target, piece)  # type: ignore[union-attr]
            copied.append((item, target))
        if lease is None:
            self._commit(copied)
        else:
            pipeline.submit(lease, functools.partial(self._commit, copied))  # type: ignore[union-attr]

    def _commit(self, copied: list[tuple[ReadItem, torch.Tensor]]) -> None:
        with self._lock:
            for item, target in copied:
                self._planner.commit_tensor(item, target)


def _stored_tensor(data: memoryview) -> torch.Tensor:
    """The tensor that torch.save wrote into `data`, as a view of `data` (valid while `data` is).

    torch.load would copy the record into newly allocated memory (a second pass over the
    bytes, with a page fault per page); its loader can slice storages out of one buffer
    instead, which is what its own mmap mode does. Same restricted unpickler as torch.load's
    weights_only=True.
    """
    reader = torch._C.PyTorchFileReader(RecordFile([data]))
    whole = torch.frombuffer(data, dtype=torch.uint8).untyped_storage()
    return torch.serialization._load(
        reader, "cpu", torch._weights_only_unpickler, overall_storage=whole, encoding="utf-8"
    )


class _Buffers:
    """One read buffer per thread, grown to the largest record it met."""

    def __init__(self) -> None:
        self._local = threading.local()  # freed with the reading threads, which end with the load

    def get(self, length: int) -> memoryview:
        if not hasattr(self._local, "buffer"):
            self._local.buffer = ReadBuffer(_GAP_CHUNK)
        return self._local.buffer.get(length)


class _CheckingReader:
    """Sequential reads of one file into the thread's buffer, checksumming every byte that passes."""

    def __init__(self, path: Path, buffers: _Buffers, *, sha256: bool) -> None:
        # O_NOFOLLOW: a step holds its own files only (resume checked that before; this closes the gap).
        try:
            self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError as exc:  # unreadable is damaged: a local copy is then fetched again
            raise Damaged(f"{path}: {exc}") from exc
        with contextlib.suppress(AttributeError, OSError):  # a larger readahead: the disk reads on during a copy
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        self._path = path
        self._buffers = buffers
        self._checksum = RunningChecksum(sha256=sha256)

    def take(self, length: int) -> memoryview:
        """The next `length` bytes (fewer at the end of the file), valid until the next call."""
        return self.take_into(self._buffers.get(length))

    def take_into(self, view: memoryview) -> memoryview:
        """The next `len(view)` bytes (fewer at the end of the file), read into `view`."""
        length = len(view)
        got = 0
        while got < length:
            try:
                n = os.readv(self._fd, [view[got:]])
            except OSError as exc:  # EIO from a bad sector: the way a local copy usually goes bad
                raise Damaged(f"{self._path}: {exc}") from exc
            if n == 0:
                break
            got += n
        view = view[:got]
        self._checksum.update(view, got)
        return view

    @property
    def position(self) -> int:
        return self._checksum.size

    def skip(self, length: int) -> None:
        while length > 0 and (got := len(self.take(min(length, _GAP_CHUNK)))):
            length -= got

    def skip_to_end(self) -> None:
        while self.take(_GAP_CHUNK):
            pass

    def record(self, name: str) -> FileRecord:
        return self._checksum.record(name)

    def close(self) -> None:
        os.close(self._fd)
