"""What a survivor of an in-process recovery keeps of its state: its own tensors at the step the job goes on
from, loaded into the next generation's state in memory, with no read of the snapshots or of the checkpoint
dir.

Only a state that every rank holds whole qualifies (DDP's replicas: no DTensor, no sharded tensor), in host
memory (kept on a device, the old tensors and the new model's would be there together until the load), of
the agreed step of a departure, on every rank of the new generation, each under the keys its new state has
(a rank that changed its number would find another rank's per-rank entries): anything else is resharded
from the snapshot in the nodes' memory, or read from the durable checkpoint, as before. When nodes join,
the ranks that were there keep the step the same way: the joining ranks read the snapshot of it (taken for
them), while the others load their own tensors (`snapshots.loading.HeldHere`).

An optimizer is kept in its own form (`Optimizer.state_dict()`: its state by its parameters' order), which
loads into the new one as it is, sharing the tensors: DCP's form would first give the new optimizer a state
of its own with a step of zeros (2 s for AdamW over 1 GB of state on this VM's 2 cores), only to drop it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch

from spotguard.checkpoint.comm import Comm
from spotguard.checkpoint.state import load_from_dcp, to_dcp, unwrapped

log = logging.getLogger(__name__)

MEMORY = "memory"  # a resume's source: this process's own tensors


@dataclasses.dataclass(frozen=True)
class KeptOptimizer:
    """An optimizer's own state dict, with its parameters' shapes group by group (what must match to load it)."""

    state: dict[str, Any] = dataclasses.field(repr=False)
    shapes: tuple[tuple[tuple[int, ...], ...], ...]


@dataclasses.dataclass(frozen=True)
class Kept:
    """The state one rank kept at `step` (per entry: an optimizer's own state dict, else the entry's DCP state
    dict, sharing the old objects' storage), or nothing (`step` None: a rank that joined, or one whose state
    was not whole); `durable`: whether the step is committed in the checkpoint dir too."""

    step: int | None = None
    state: Mapping[str, Any] | None = dataclasses.field(default=None, repr=False)
    durable: bool = True


def keep(step: int, state: Mapping[str, Any], goes_on: Sequence[int] | None = None, *, durable: bool = True) -> Kept:
    """What this rank keeps of `state` at `step` for the job's next generation, of the old ranks `goes_on` in
    order (None: the same ranks): its state when it holds the whole of it and keeps its number, else nothing
    (said in the log when the state could not be read: then the step is read from the snapshots or the
    checkpoint, as without this). Local: a module whose parameters are not plain tensors in host memory
    (FSDP's, on a device) is not asked for its state dict, which may be a collective."""
    try:
        return _keep(step, state, goes_on, durable)
    except Exception:  # noqa: BLE001 - invariant 3: never into the training loop
        log.exception("the state of step %d cannot be kept in this process", step)
        return Kept()


def _keep(step: int, state: Mapping[str, Any], goes_on: Sequence[int] | None, durable: bool) -> Kept:
    if goes_on is not None and tuple(goes_on) != tuple(range(len(goes_on))):
        return Kept()  # a survivor's number changes, and with it its per-rank entries
    modules = [unwrapped(v) for v in state.values()]
    tensors = [t for m in modules if isinstance(m, torch.nn.Module) for t in (*m.parameters(), *m.buffers())]
    if not whole(tensors):
        return Kept()
    held: dict[str, Any] = {}
    for key, value in state.items():
        optimizer = _optimizer(value)
        if optimizer is None:
            held[key] = to_dcp({key: value})[key]
        else:
            held[key] = KeptOptimizer(optimizer.state_dict(), _shapes(optimizer))
    return Kept(step, held, durable) if whole(held) else Kept()


def whole(tree: Any) -> bool:
    """Whether a kept state holds its tensors whole, in host memory: none is a shard of a larger one (a DTensor,
    a ShardedTensor), so a rank holding it needs nothing of the other ranks', and none is on a device."""
    if isinstance(tree, torch.Tensor):
        return type(tree) in (torch.Tensor, torch.nn.Parameter) and tree.device.type == "cpu"
    if isinstance(tree, KeptOptimizer):
        return whole(tree.state)
    if isinstance(tree, Mapping):
        return all(whole(value) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return all(whole(value) for value in tree)
    return True


def load_kept(kept: Kept, state: MutableMapping[str, Any], comm: Comm, fit: bool | None = None) -> int | None:
    """A collective of the new generation: the step loaded into `state` from what each rank kept, when every
    rank kept the same step under the keys of its `state` (its optimizers over parameters of the same shapes);
    else None, with `state` untouched. `fit`: whether this rank's `fits`, when the caller knows already."""
    steps = comm.all_gather(kept.step if (fits(kept, state) if fit is None else fit) else None)
    if steps[0] is None or any(s != steps[0] for s in steps):
        return None
    load_own(kept, state)
    return kept.step


def fits(kept: Kept, state: Mapping[str, Any]) -> bool:
    """Whether `kept` holds a step under the keys of `state`, its modules' tensors and its optimizers' parameters
    of the same shapes (what the load would otherwise fail on, part of the state loaded)."""
    if kept.step is None or kept.state is None or set(kept.state) != set(state):
        return False
    for key, value in state.items():
        optimizer, held = _optimizer(value), kept.state[key]
        if (optimizer is None) != (not isinstance(held, KeptOptimizer)):
            return False
        if optimizer is not None and _shapes(optimizer) != held.shapes:
            return False
        module = unwrapped(value)
        if isinstance(module, torch.nn.Module) and not _same_layout(key, module, held):
            return False
    return True


def _same_layout(key: str, module: torch.nn.Module, held: Mapping[str, Any]) -> bool:
    """Whether `module` is whole (else its state dict may be a collective: not asked for) and its state dict has
    the names and shapes of `held`."""
    return whole([*module.parameters(), *module.buffers()]) and _layout(to_dcp({key: module})[key]) == _layout(held)


def _layout(tree: Any) -> Any:
    """A state dict's names and tensor shapes."""
    if isinstance(tree, torch.Tensor):
        return tuple(tree.shape)
    if isinstance(tree, Mapping):
        return {name: _layout(value) for name, value in tree.items()}
    return None


def load_own(kept: Kept, state: MutableMapping[str, Any]) -> None:
    """Load what this rank kept into `state`, which it `fits` (this rank alone)."""
    held: Mapping[str, Any] = kept.state  # type: ignore[assignment]
    for key, value in state.items():  # first: their groups were checked, and nothing is copied
        if (optimizer := _optimizer(value)) is not None:
            optimizer.load_state_dict(held[key].state)
    rest = {key: value for key, value in state.items() if _optimizer(value) is None}
    load_from_dcp(rest, held)
    state.update(rest)  # a plain value is replaced, not loaded into


def _optimizer(value: Any) -> torch.optim.Optimizer | None:
    value = unwrapped(value)
    return value if isinstance(value, torch.optim.Optimizer) else None


def _shapes(optimizer: torch.optim.Optimizer) -> tuple[tuple[tuple[int, ...], ...], ...]:
    return tuple(tuple(tuple(p.shape) for p in group["params"]) for group in optimizer.param_groups)
