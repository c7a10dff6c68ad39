"""DCP's load, fed from snapshot files: each rank reads the parts of saved chunks its state needs.

`SnapshotReader` is a DCP StorageReader over a snapshot's shards. DCP's load planner (`items`)
gives each rank its read items: which saved chunk, which box of it, into which box of the state.
For each shard the reader turns them into runs of whole blocks (`BLOCK` bytes, merged where they
touch) and reads them from one source, its own node's file or a peer's (`peers.PeerRuns`), in one
request. The bytes of a box that is contiguous in the file (a dimension-0 slice, as FSDP shards,
or a whole chunk) go straight into the state's tensor when that is contiguous host memory, or
through the process's pinned buffers (`bounce`) into it when it lives on a GPU (the next piece is
read while one is copied to the device); the rest go through a buffer. Every block is checked
against the trailer's CRC32C as its last byte arrives. A failed check or a broken transfer raises
`ShardUnusable` naming the shard, after which the state may be overwritten in part (the caller
then loads another snapshot or the durable step over it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ContextManager, Protocol

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from spotguard.checkpoint.io import bounce
from spotguard.checkpoint.io.bounce import IN_FLIGHT, Pipeline
from spotguard.snapshots.items import BYTES, Copy, StoredItem
from spotguard.snapshots.shard_file import BlockCheck, ShardInfo, SnapshotError

RUN_MAX = 64 << 20  # runs are merged up to this size (a bigger chunk is one run of its own)
_DISCARD = 1 << 20  # the bytes of a run no item needs are read (and checked) this much at a time


class ShardUnusable(SnapshotError):
    """The copy of shard `shard` this rank read from could not be used."""

    def __init__(self, shard: int, why: str) -> None:
        super().__init__(f"shard {shard}: {why}")
        self.shard = shard
        self.why = why


class Source(Protocol):
    """The bytes of a shard's runs, in order: `read_into` is called with consecutive offsets within a run."""

    def read_into(self, offset: int, view: memoryview) -> None: ...


class FileRuns:
    """A snapshot file on this node as a `Source`."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def read_into(self, offset: int, view: memoryview) -> None:
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n == 0:
                raise SnapshotError(f"the file ended at byte {offset + done}")
            done += n

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> FileRuns:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# (shard, its runs as (start, length)) -> a source of those runs, closed when the reading ends
OpenShard = Callable[[int, list[tuple[int, int]]], ContextManager[Source]]


@dataclasses.dataclass
class _Need:
    """The bytes [start, end) of a shard's body that one read item needs, and where they go."""

    start: int
    end: int
    read: ReadItem
    item: StoredItem
    dest: torch.Tensor | None = None  # where the planner wants them (None: a non-tensor value)
    direct: torch.Tensor | None = None  # the bytes of `dest` when they are read straight into it
    device: torch.Tensor | None = None  # the bytes of `dest` on a device, when they cross through the pool
    buffer: bytearray | None = None


class SnapshotReader(StorageReader):
    """A StorageReader over the shards `infos` of one snapshot (old rank -> its trailer), whose
    saved chunks are `copies` (`items.metadata_of`). `prefer(shard)` orders the shards that hold
    the same chunk (a replicated tensor): the smallest is read. `open_shard` opens a shard's runs."""

    def __init__(
        self,
        metadata: Metadata,
        copies: Mapping[Any, list[Copy]],
        infos: Mapping[int, ShardInfo],
        prefer: Callable[[int], Any],
        open_shard: OpenShard,
    ) -> None:
        super().__init__()
        self.metadata = metadata
        self._copies = copies
        self._infos = infos
        self._prefer = prefer
        self._open = open_shard
        self.bytes_read: dict[int, int] = {}  # per shard

    # ---- DCP's StorageReader ------------------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return checkpoint_id is None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_shard: dict[int, list[tuple[ReadItem, StoredItem]]] = {}
        for read in plan.items:
            copy = min(self._copies[_key(read.storage_index)], key=lambda c: self._prefer(c.shard))
            by_shard.setdefault(copy.shard, []).append((read, copy.item))
        for shard, reads in sorted(by_shard.items()):
            self._read_shard(shard, reads, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    # ---- one shard ---------------------------------------------------------------------------
    def _read_shard(self, shard: int, reads: list[tuple[ReadItem, StoredItem]], planner: LoadPlanner) -> None:
        """Read and check one shard's runs, handing each run's items to the planner as soon as its blocks
        are checked (a buffer lives for one run). What goes wrong opening, reading or checking the copy
        raises ShardUnusable (another copy may do); handing the items over, whatever it raises (the
        snapshot does not fit the state: no copy would)."""
        info = self._infos[shard]
        needs = sorted((_need(read, item, planner) for read, item in reads), key=lambda n: n.start)
        for before, after in zip(needs, needs[1:]):
            if after.start < before.end:  # never planned by DCP: two reads of the same bytes
                raise SnapshotError(f"two reads overlap at byte {after.start}")
        runs = _runs(needs, info)
        check = BlockCheck(info, f"rank {shard}'s shard")
        pool = bounce.pool_for([n.dest for n in needs if n.device is not None], IN_FLIGHT)  # type: ignore[misc]
        pipeline = Pipeline(pool) if pool is not None else None
        with contextlib.ExitStack() as stack:
            if pipeline is not None:
                pool.stream.follow()  # type: ignore[union-attr]  # after the work queued on the state's tensors
                stack.callback(pipeline.abandon)  # after a failure: copies in flight waited for, buffers back
            try:
                source = stack.enter_context(self._open(shard, [(start, end - start) for start, end, _ in runs]))
            except Exception as exc:  # noqa: BLE001 - this copy cannot be reached
                raise ShardUnusable(shard, f"{type(exc).__name__}: {exc}") from exc
            for start, end, members in runs:
                try:
                    check.start(start)
                    self._read_run(source, check, shard, start, end, members, pipeline)
                    if pipeline is not None:
                        pipeline.drain()  # the run's copies to the device done before its items are handed over
                except Exception as exc:  # noqa: BLE001 - a broken transfer or a failed check: this copy
                    raise ShardUnusable(shard, f"{type(exc).__name__}: {exc}") from exc
                for need in members:
                    _deliver(need, planner)
                    need.buffer = None

    def _read_run(
        self,
        source: Source,
        check: BlockCheck,
        shard: int,
        start: int,
        end: int,
        needs: list[_Need],
        pipeline: Pipeline | None,
    ) -> None:
        position = start
        discard = memoryview(bytearray(min(_DISCARD, end - start) or 1))

        def take(view: memoryview) -> None:
            nonlocal position
            source.read_into(position, view)
            check.update(view)
            position += len(view)
            self.bytes_read[shard] = self.bytes_read.get(shard, 0) + len(view)

        for need in needs:
            while position < need.start:
                take(discard[: min(len(discard), need.start - position)])
            if need.direct is not None:
                take(memoryview(need.direct.numpy()).cast("B"))
            elif need.device is not None:
                assert pipeline is not None
                step = pipeline.pool.buffer_bytes
                for first in range(0, need.end - need.start, step):
                    piece = need.device[first : first + step]
                    lease = pipeline.lease(piece.numel())
                    try:
                        take(lease.bytes())
                        pipeline.copy(lease, piece, lease.buffer[: piece.numel()])
                    except BaseException:
                        pipeline.abandon(lease)  # not submitted yet: it goes back with the others
                        raise
                    pipeline.submit(lease)
            else:
                need.buffer = bytearray(need.end - need.start)
                take(memoryview(need.buffer))
        while position < end:
            take(discard[: min(len(discard), end - position)])


def _key(index: MetadataIndex) -> tuple[str, tuple[int, ...] | None]:
    return index.fqn, None if index.offset is None else tuple(index.offset)


def _need(read: ReadItem, item: StoredItem, planner: LoadPlanner) -> _Need:
    """What `read` needs of `item`: a contiguous slice read straight into the state where it can be."""
    if read.type == LoadItemType.BYTE_IO or item.dtype == BYTES:
        return _Need(item.offset, item.offset + item.nbytes, read, item)
    span = _contiguous_span(item, read.storage_offsets, read.lengths)
    dest = planner.resolve_tensor(read).detach()
    if span is None:
        return _Need(item.offset, item.offset + item.nbytes, read, item, dest)
    fits = (
        dest.is_contiguous()
        and dest.dtype == item.torch_dtype
        and dest.numel() * dest.element_size() == span[1] - span[0] > 0
    )
    if not fits:
        return _Need(*span, read, item, dest)
    if bounce.bounced(dest):
        return _Need(*span, read, item, dest, device=_bytes(dest))
    return _Need(*span, read, item, dest, direct=_bytes(dest))


def _contiguous_span(item: StoredItem, offsets: Sequence[int], lengths: Sequence[int]) -> tuple[int, int] | None:
    """The bytes of the box (`offsets`, `lengths`) of `item`'s chunk when they are contiguous in the
    file (the box spans every dimension but the first), else None."""
    sizes = item.chunk_sizes
    if tuple(offsets[1:]) != (0,) * (len(sizes) - 1) or tuple(lengths[1:]) != tuple(sizes[1:]):
        return None
    row = item.nbytes // sizes[0] if sizes and sizes[0] else item.nbytes
    first = offsets[0] if sizes else 0
    rows = lengths[0] if sizes else 1
    return item.offset + first * row, item.offset + (first + rows) * row


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, as a flat uint8 tensor sharing its memory."""
    return tensor.reshape(-1).view(torch.uint8)


def _runs(needs: list[_Need], info: ShardInfo) -> list[tuple[int, int, list[_Need]]]:
    """The needs grouped into runs of whole blocks: (start, end, needs), merged where their blocks touch."""
    block = info.block_bytes
    runs: list[tuple[int, int, list[_Need]]] = []
    for need in needs:
        start = need.start // block * block
        end = min(info.body_bytes, -(-need.end // block) * block)
        if runs and start <= runs[-1][1] and max(end, runs[-1][1]) - runs[-1][0] <= RUN_MAX:
            first, last, members = runs[-1]
            runs[-1] = (first, max(last, end), [*members, need])
        else:
            runs.append((start, end, [need]))
    return runs


def _deliver(need: _Need, planner: LoadPlanner) -> None:
    """Hand a need's checked bytes to the planner (what was read straight into the state: committed)."""
    read, item = need.read, need.item
    if item.dtype == BYTES:
        planner.load_bytes(read, io.BytesIO(bytes(need.buffer or b"")))
        return
    target = need.dest
    assert target is not None
    if need.direct is None and need.device is None:
        stored = (
            torch.frombuffer(need.buffer, dtype=item.torch_dtype)
            if need.buffer
            else torch.empty(0, dtype=item.torch_dtype)
        )
        if need.end - need.start == item.nbytes:  # the whole chunk: the box is cut out of it
            piece = narrow_tensor_by_index(stored.view(item.chunk_sizes), read.storage_offsets, read.lengths)
        else:  # a contiguous slice of rows
            piece = stored.view(read.lengths)
        if piece.size() != target.size():
            raise SnapshotError(f"{item.fqn}: stored {tuple(piece.size())}, the state has {tuple(target.size())}")
        target.copy_(piece)
    planner.commit_tensor(read, target)
