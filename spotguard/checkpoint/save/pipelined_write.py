"""Writing GPU state: each piece crosses to the host through a pool buffer while the one before is written.

DCP's writer copies each tensor into fresh pageable memory inside the thread that then writes it,
so the device-to-host copies and the writes take turns and every copy faults in new pages (about
2 s of an 8 GB save on one H100). Here a tensor larger than a pool buffer is cut into row slices
that fit one (more chunks of the same tensor in DCP's metadata, which any DCP reader loads), and
each writing thread copies its next slice into a buffer of the shared `bounce.BouncePool` on the
copy stream while it writes the one before (`bounce.Pipeline`): the save runs at the slower of the
copy and the disk. The files are DCP's own (`torch.save` records at the offsets the metadata
gives). A failure on any thread stops the others at their next piece and gives every buffer back;
so does the save's `cutoff` (an emergency's deadline), after which nothing is committed.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _split_by_size_and_type, _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from cloud_adapters.deadline import Deadline
from spotguard.checkpoint.errors import CheckpointError
from spotguard.checkpoint.io import bounce
from spotguard.checkpoint.io.bounce import BouncePool, Pipeline
from spotguard.checkpoint.save.indexed_write import IndexedWriter

Slice = tuple[WriteItem, int, int]  # the item planned, and the rows of it (first, count) a slice holds


def record_room(buffer_bytes: int) -> int:
    """What a slice leaves of a buffer for what torch.save writes around its bytes (about 1.6 KB), so that
    the whole record fits a buffer when it is read back."""
    return min(64 << 10, buffer_bytes // 2)


class PipelinedWriter(IndexedWriter):
    """DCP's file writer (its coordinator writing the metadata's index too) with every tensor that is not
    in host memory copied out through `pool`."""

    def __init__(self, path: Path, *, threads: int, pool: BouncePool, cutoff: Deadline | None = None) -> None:
        super().__init__(path, thread_count=threads, sync_files=True)
        self.pool = pool
        self._cutoff = cutoff or Deadline()
        self._slices: dict[tuple[str, tuple[int, ...]], Slice] = {}

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        plan = super().prepare_local_plan(plan)
        return dataclasses.replace(plan, items=[piece for item in plan.items for piece in self._sliced(item)])

    def _sliced(self, item: WriteItem) -> list[WriteItem]:
        """`item`, or its row slices of at most a buffer each (a row larger than a buffer: the item whole)."""
        data = item.tensor_data
        if item.type == WriteItemType.BYTE_IO or data is None or len(data.chunk.sizes) == 0:
            return [item]
        rows = data.chunk.sizes[0]
        row_bytes = data.properties.dtype.itemsize * int(torch.Size(data.chunk.sizes[1:]).numel())
        most = self.pool.buffer_bytes - record_room(self.pool.buffer_bytes)
        if rows * row_bytes <= most or row_bytes == 0 or row_bytes > most:
            return [item]
        per = most // row_bytes
        pieces = []
        for first in range(0, rows, per):
            count = min(per, rows - first)
            offsets = torch.Size([data.chunk.offsets[0] + first, *data.chunk.offsets[1:]])
            chunk = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([count, *data.chunk.sizes[1:]]))
            pieces.append(
                WriteItem(
                    index=MetadataIndex(item.index.fqn, offsets),
                    type=WriteItemType.SHARD,  # one of several chunks of the tensor
                    tensor_data=TensorWriteData(chunk=chunk, properties=data.properties, size=data.size),
                )
            )
            self._slices[(item.index.fqn, tuple(offsets))] = (item, first, count)
        return pieces

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix
        # DCP's own split of the items into files of about equal size; no empty files
        bins = [b for b in _split_by_size_and_type(self.thread_count, plan.items) if b]
        files = [(f"{prefix}{i}.distcp", items) for i, items in enumerate(bins)]
        results: list[WriteResult] = []
        errors: list[BaseException] = []
        stop = threading.Event()
        self.pool.stream.follow()  # the copies start after the training stream's work queued so far

        def write(name: str, items: list[WriteItem]) -> None:
            try:
                written = self._write_file(name, items, planner, stop)
                results.extend(written)
            except BaseException as exc:  # noqa: BLE001 - raised below, on the calling thread
                errors.append(exc)
                stop.set()

        threads = [threading.Thread(target=write, args=f, name="spotguard-write") for f in files[1:]]
        for thread in threads:
            thread.start()
        if files:
            write(*files[0])
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def _write_file(self, name: str, items: list[WriteItem], planner: SavePlanner, stop: threading.Event) -> list:
        results: list[WriteResult] = []
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
            record = functools.partial(_record, stream, name, results)
            for item in items:
                if item.type == WriteItemType.BYTE_IO:
                    record(item, planner.resolve_data(item).getbuffer())
            pipeline = Pipeline(self.pool)
            lease = None
            try:
                for item in items:
                    if item.type == WriteItemType.BYTE_IO:
                        continue
                    if stop.is_set():
                        raise CheckpointError("another writing thread failed")
                    if self._cutoff.passed():
                        raise CheckpointError("the write stopped at the save's deadline")
                    tensor = self._resolve(planner, item)
                    nbytes = tensor.numel() * tensor.element_size()
                    if not bounce.bounced(tensor) or not 0 < nbytes <= self.pool.buffer_bytes:
                        record(item, _own_storage(tensor.cpu()))  # a row larger than a buffer: copied as DCP does
                        continue
                    lease = pipeline.lease(nbytes)
                    host = lease.typed(tensor.dtype, tensor.shape)
                    pipeline.copy(lease, host, tensor)
                    pipeline.submit(lease, functools.partial(record, item, host))
                    lease = None
                pipeline.drain()
            except BaseException:
                pipeline.abandon(lease)
                raise
            stream.flush()
            os.fsync(stream.fileno())
        return results

    def _resolve(self, planner: SavePlanner, item: WriteItem) -> torch.Tensor:
        """The tensor (or the rows of it) that `item` saves."""
        sliced = self._slices.get((item.index.fqn, tuple(item.index.offset or ())))
        if sliced is None:
            return planner.resolve_data(item).detach()
        whole, first, count = sliced
        return planner.resolve_data(whole).detach().narrow(0, first, count)


def _record(stream: Any, name: str, results: list[WriteResult], item: WriteItem, data: Any) -> None:
    """Append `data` (a host tensor, saved as DCP saves one, or bytes) to the file and note where it went."""
    offset = stream.tell()
    if isinstance(data, torch.Tensor):
        torch.save(data, stream)
    else:
        stream.write(data)
    length = stream.tell() - offset
    results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length)))


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """torch.save writes a tensor's whole storage: a view of a larger one is copied out first (as DCP does)."""
    return tensor.clone() if tensor.untyped_storage().nbytes() != tensor.nbytes else tensor
