"""A snapshot's contents in DCP's terms, so that DCP's own planners decide what goes where.

At a snapshot, DCP's save planner lists this rank's items (`laid_out`): each tensor chunk with where
it sits in the global tensor (a DTensor's local shard, or a whole replicated tensor), each non-tensor
value as the bytes torch.save makes of it. The file stores them in that order with an index
(`StoredItem`). At a resume, the indexes of a snapshot's shards become DCP `Metadata`
(`metadata_of`), and DCP's load planner works out, for the state of each rank of the new job,
which saved chunks it needs and which part of each: the same reshard a durable checkpoint gets,
at any world size. The assembled chunks must tile each tensor (`safe_pickle.untiled`), and
`CoveringPlanner` adds the check DCP leaves out because its own metadata is whole by construction:
every element of the state is read from somewhere.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, WriteItemType
from torch.distributed.tensor import DTensor

from spotguard.checkpoint.format.safe_pickle import WeightsOnlyLoadPlanner, untiled

BYTES = "bytes"  # the dtype of a non-tensor value's item


class LayoutError(RuntimeError):
    """A snapshot's shards disagree about an item, or do not hold all of the state."""


@dataclasses.dataclass(frozen=True)
class StoredItem:
    """One item of a snapshot file: a tensor chunk (its raw bytes, row-major) or a torch.save'd value."""

    fqn: str
    offset: int  # where its bytes start in the file's body
    nbytes: int
    dtype: str  # "float32", ...; BYTES for a non-tensor value
    chunk_offsets: tuple[int, ...] = ()  # where the chunk sits in the global tensor
    chunk_sizes: tuple[int, ...] = ()
    size: tuple[int, ...] = ()  # the global tensor's shape

    @property
    def key(self) -> tuple[str, tuple[int, ...] | None]:
        """How DCP names the chunk (its MetadataIndex's fqn and offset)."""
        return self.fqn, None if self.dtype == BYTES else self.chunk_offsets

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_of(self.fqn, self.dtype)

    def encoded(self) -> list[Any]:
        return [self.fqn, self.offset, self.nbytes, self.dtype, self.chunk_offsets, self.chunk_sizes, self.size]

    @classmethod
    def decoded(cls, raw: Any) -> StoredItem:
        fqn, offset, nbytes, dtype, chunk_offsets, chunk_sizes, size = raw
        return cls(
            str(fqn),
            int(offset),
            int(nbytes),
            str(dtype),
            *(tuple(map(int, v)) for v in (chunk_offsets, chunk_sizes, size)),
        )


@dataclasses.dataclass(frozen=True)
class Entry:
    """An item to be written, with its data (a tensor in host or device memory, or bytes)."""

    fqn: str
    data: torch.Tensor | bytes
    chunk_offsets: tuple[int, ...] = ()
    size: tuple[int, ...] = ()


def laid_out(state_dict: Mapping[str, Any]) -> tuple[list[Entry], dict[str, list[Any]]]:
    """This rank's items of a (DCP) state dict, as DCP's save planner lists them, and the path of each
    flat name in the state ("optim.state.0.exp_avg" -> ["optim", "state", 0, "exp_avg"])."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(dict(state_dict), is_coordinator=True)
    entries = []
    for item in planner.create_local_plan().items:
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            entries.append(Entry(item.index.fqn, data.getvalue()))
            continue
        chunk, size = item.tensor_data.chunk, item.tensor_data.size
        tensor = data.to_local() if isinstance(data, DTensor) else data
        if tuple(tensor.shape) != tuple(chunk.sizes):
            raise LayoutError(f"{item.index.fqn}: a chunk of {tuple(chunk.sizes)} holds {tuple(tensor.shape)}")
        entries.append(Entry(item.index.fqn, tensor.detach(), tuple(chunk.offsets), tuple(size)))
    return entries, {fqn: list(path) for fqn, path in planner.mappings.items()}


def stored(entry: Entry, offset: int) -> StoredItem:
    """The index record of `entry` written at `offset`."""
    if isinstance(entry.data, bytes):
        return StoredItem(entry.fqn, offset, len(entry.data), BYTES)
    tensor = entry.data
    dtype = str(tensor.dtype).removeprefix("torch.")
    nbytes = tensor.numel() * tensor.element_size()
    return StoredItem(entry.fqn, offset, nbytes, dtype, entry.chunk_offsets, tuple(tensor.shape), entry.size)


@dataclasses.dataclass(frozen=True)
class Copy:
    """Where a saved chunk can be read: the shard (old rank) whose file holds it, and its record there."""

    shard: int
    item: StoredItem


def metadata_of(indexes: Mapping[int, Iterable[StoredItem]], *, whole: bool) -> tuple[Metadata, dict[Any, list[Copy]]]:
    """DCP Metadata for the items of the shards `indexes` (old rank -> its file's items), and every
    copy of each saved chunk by its key (a replicated tensor is one chunk held by every shard).

    Each tensor's chunks must lie inside it and apart; with `whole` (every shard of the snapshot)
    they must cover it too.
    """
    copies: dict[Any, list[Copy]] = {}
    described: dict[str, tuple[str, tuple[int, ...]]] = {}
    chunks: dict[str, dict[tuple[int, ...], tuple[int, ...]]] = {}
    for shard in sorted(indexes):
        for item in indexes[shard]:
            shape = (item.dtype, item.size)
            if described.setdefault(item.fqn, shape) != shape:
                raise LayoutError(f"{item.fqn}: shard {shard} holds {shape}, another {described[item.fqn]}")
            if item.dtype != BYTES:
                sizes = chunks.setdefault(item.fqn, {}).setdefault(item.chunk_offsets, item.chunk_sizes)
                if sizes != item.chunk_sizes:
                    raise LayoutError(f"{item.fqn}: two chunks at {item.chunk_offsets} differ in size")
            copies.setdefault(item.key, []).append(Copy(shard, item))
    state_dict_metadata: dict[str, Any] = {}
    for fqn, (dtype, size) in described.items():
        if dtype == BYTES:
            state_dict_metadata[fqn] = BytesStorageMetadata()
            continue
        saved = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in sorted(chunks[fqn].items())]
        properties = TensorProperties(dtype=dtype_of(fqn, dtype))
        state_dict_metadata[fqn] = TensorStorageMetadata(properties, torch.Size(size), saved)
    metadata = Metadata(state_dict_metadata=state_dict_metadata)
    if why := untiled(metadata, whole=whole):
        raise LayoutError(why)
    return metadata, copies


class CoveringPlanner(WeightsOnlyLoadPlanner):
    """DCP's default load planner (non-tensor values loaded weights-only) that refuses a plan leaving
    part of a tensor unread: a snapshot's metadata is assembled from its shards' indexes, and a
    chunk missing from them must fail the load, not leave old values in the state."""

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        read: dict[str, int] = {}
        for item in plan.items:
            read[item.dest_index.fqn] = read.get(item.dest_index.fqn, 0) + math.prod(item.lengths)
        for fqn, value in self.state_dict.items():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if isinstance(value, DTensor) else value
                if read.get(fqn, 0) != local.numel():
                    raise LayoutError(f"{fqn}: the snapshot holds {read.get(fqn, 0)} of its {local.numel()} elements")
        return plan


def dtype_of(fqn: str, name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise LayoutError(f"{fqn}: unknown dtype {name!r}")
    return dtype


def top_level_keys(paths: Mapping[str, list[Any]]) -> set[str]:
    """The keys of the state a snapshot was taken from (what `laid_out`'s paths start with)."""
    return {str(path[0]) for path in paths.values() if path}
