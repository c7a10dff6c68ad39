"""Who holds which bytes of a state: the planning behind a save by the survivors alone.

DCP takes a plain tensor (DDP, anything replicated) as held by every rank, and a DTensor
shard as held by every rank of its device mesh whose coordinates match on the mesh
dimensions that are not `Replicate` (HSDP keeps each shard on every replica group).
When some ranks are leaving, the survivors can write everything one of them holds; only a
shard that lives on leaving ranks alone must be handed over first, and of the leaving ranks
that hold it, the lowest one hands it over, so that it arrives once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import SavePlan
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from spotguard.checkpoint.errors import CheckpointError


def flat(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The state dict as DCP plans it: one entry per fully qualified name."""
    return flatten_state_dict(dict(state_dict))[0]


def holders(tensor: DTensor, rank: int) -> set[int]:
    """The global ranks that hold the same local shard of `tensor` as `rank` does."""
    mesh = tensor.device_mesh.mesh
    found = (mesh == rank).nonzero()
    if len(found) == 0:  # not in the tensor's mesh: it holds none of it
        return set()
    coordinate = found[0].tolist()
    index = tuple(slice(None) if p.is_replicate() else c for p, c in zip(tensor.placements, coordinate))
    return set(mesh[index].flatten().tolist())


def hands_over(value: Any, rank: int, survivors: set[int]) -> bool:
    """Whether leaving `rank` must hand over its part of `value`: no survivor holds it, and
    `rank` is the lowest of the ranks that do."""
    if isinstance(value, DTensor):
        owners = holders(value, rank)
        return bool(owners) and not owners & survivors and rank == min(owners)
    # Other sharded types (ShardedTensor) do not say who else holds a shard: hand it over.
    return _is_sharded(value)


def expects_handoff(flat_state: Mapping[str, Any], rank: int, survivors: set[int]) -> bool:
    """Whether leaving `rank` holds anything the survivors must receive before they save.

    Every rank answers the same from its own state: the sharding is the same everywhere.
    """
    return any(hands_over(value, rank, survivors) for value in flat_state.values())


def unique_shards(
    state_dict: Mapping[str, Any], rank: int, survivors: set[int]
) -> list[tuple[WriteItem, torch.Tensor]]:
    """The shards leaving `rank` must hand over, as DCP write items with their local tensors (on
    their device: the handoff copies each to the host as it sends it, never all at once)."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(dict(state_dict), is_coordinator=False)
    out = []
    for item in planner.create_local_plan().items:
        if item.type == WriteItemType.SHARD and hands_over(planner.state_dict[item.index.fqn], rank, survivors):
            tensor = planner.resolve_data(item)
            out.append((item, tensor))
    return out


def _is_sharded(value: Any) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(value, ShardedTensor)


class SurvivorPlanner(DefaultSavePlanner):
    """DCP's default save planning, plus the shards handed over by leaving ranks.

    The global plan must cover every tensor whole: DCP checks that only when more than one
    rank saves, and a save by one survivor must not commit a step with a shard missing.
    """

    def __init__(self, received: Iterable[tuple[WriteItem, torch.Tensor]] = ()) -> None:
        super().__init__()
        self._received: dict[MetadataIndex, torch.Tensor] = {}
        self._extra: list[WriteItem] = []
        for item, tensor in received:
            self._received[item.index] = tensor
            self._extra.append(item)

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self.plan = dataclasses.replace(plan, items=plan.items + self._extra)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        tensor = self._received.get(index)
        return tensor if tensor is not None else super().lookup_object(index)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = super().create_global_plan(all_plans)
        gaps = coverage_gaps(metadata)
        if gaps:
            raise CheckpointError("the survivors do not hold the whole state: " + "; ".join(gaps[:3]))
        return plans, metadata


def coverage_gaps(metadata: Metadata) -> list[str]:
    """Tensors whose saved chunks do not add up to the whole tensor (chunks never overlap:
    DCP's own validation refuses that)."""
    gaps = []
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        whole = math.prod(entry.size)
        covered = sum(math.prod(chunk.sizes) for chunk in entry.chunks)
        if covered != whole:
            gaps.append(f"{fqn}: {covered} of {whole} elements")
    return gaps
