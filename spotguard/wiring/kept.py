"""What a survivor of an in-process recovery keeps of its state: its own tensors at the step the job goes on
from, loaded into the next generation's state with a copy in memory, with no read of the snapshots or of
the checkpoint dir.

Only a state that every rank holds whole qualifies (DDP's replicas: no DTensor, no sharded tensor), in host
memory (kept on a device, the old tensors and the new model's would be there together until the load), of
the agreed step of a departure, on every rank of the new generation, each under the keys its new state has
(a rank that changed its number would find another rank's per-rank entries): anything else is resharded
from the snapshot in the nodes' memory, or read from the durable checkpoint, as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from spotguard.checkpoint.comm import Comm
from spotguard.checkpoint.state import load_from_dcp, to_dcp

MEMORY = "memory"  # a resume's source: this process's own tensors


@dataclasses.dataclass(frozen=True)
class Kept:
    """The state one rank kept at `step` (its DCP state dict, sharing the old objects' storage), or nothing
    (`step` None: a rank that joined, or one whose state was not whole)."""

    step: int | None = None
    state: Mapping[str, Any] | None = dataclasses.field(default=None, repr=False)


def keep(step: int, state: Mapping[str, Any]) -> Kept:
    """What this rank keeps of `state` at `step`: its state dict when it holds the whole of it, else nothing."""
    flat = to_dcp(state)
    return Kept(step, flat) if whole(flat) else Kept()


def whole(tree: Any) -> bool:
    """Whether a DCP state dict holds its tensors whole, in host memory: none is a shard of a larger one (a
    DTensor, a ShardedTensor), so a rank holding it needs nothing of the other ranks', and none is on a device."""
    if isinstance(tree, torch.Tensor):
        return type(tree) in (torch.Tensor, torch.nn.Parameter) and tree.device.type == "cpu"
    if isinstance(tree, Mapping):
        return all(whole(value) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return all(whole(value) for value in tree)
    return True


def load_kept(kept: Kept, state: MutableMapping[str, Any], comm: Comm) -> int | None:
    """A collective of the new generation: the step loaded into `state` from what each rank kept, when every
    rank kept the same step under the keys of its `state`; else None, with `state` untouched."""
    fits = kept.step is not None and kept.state is not None and set(kept.state) == set(state)
    steps = comm.all_gather(kept.step if fits else None)
    if steps[0] is None or any(s != steps[0] for s in steps):
        return None
    load_from_dcp(state, kept.state)  # type: ignore[arg-type]
    return kept.step
