"""Which part of each saved tensor this rank loads: what a rank needs of `.metadata.index`."""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list
from torch.distributed.tensor import DTensor

from spotguard.checkpoint.format.metadata_index import Box


def local_boxes(state_dict: dict[str, Any]) -> dict[str, list[Box]]:
    """Of each DTensor in `state_dict` (the DCP form of a state, flattened as DCP's load planner
    flattens it), the boxes this rank loads, as DCP's planner computes them (`_create_chunk_list`):
    none where the rank is outside its mesh. Any other value is left out (its chunks are all kept)."""
    flat, _ = flatten_state_dict(state_dict)
    boxes: dict[str, list[Box]] = {}
    for fqn, value in flat.items():
        if isinstance(value, DTensor):
            inside = value.device_mesh.get_coordinate() is not None
            boxes[fqn] = [(c.offsets, c.sizes) for c in _create_chunk_list(value)] if inside else []
    return boxes
