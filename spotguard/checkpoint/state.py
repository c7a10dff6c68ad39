"""User state <-> the flat dict `torch.distributed.checkpoint` saves and loads.

Modules and optimizers go through DCP's state_dict helpers so that optimizer state is
keyed by parameter name (not by id) and DDP's `module.` prefix disappears: a checkpoint
from a DDP run loads into a plain module and back.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


class IfSaved:
    """A state entry that a checkpoint may lack: loaded when the step has it, left as it is otherwise.

    For what only one rank owns, under a per-rank key (its RNG): a rank that is new at a larger
    world size finds none of its own, and the step still loads for everything else. Only a
    top-level entry of the state may be one.
    """

    def __init__(self, value: Any) -> None:
        if not _is_stateful(value):
            raise TypeError(f"IfSaved takes an object with state_dict and load_state_dict, not {type(value).__name__}")
        self.value = value


def unwrapped(value: Any) -> Any:
    """A state entry's object: an `IfSaved`'s, or the entry itself."""
    return value.value if isinstance(value, IfSaved) else value


def optional_keys(state: Mapping[str, Any]) -> list[str]:
    """The keys of `state` whose entries are `IfSaved`."""
    return [key for key, value in state.items() if isinstance(value, IfSaved)]


def _model_for(name: str, optim: torch.optim.Optimizer, state: Mapping[str, Any]) -> nn.Module:
    """The module in `state` that owns every parameter `optim` updates."""
    wanted = {id(p) for group in optim.param_groups for p in group["params"]}
    for value in state.values():
        if isinstance(value, nn.Module) and wanted <= {id(p) for p in value.parameters()}:
            return value
    raise ValueError(
        f"state[{name!r}] is an optimizer whose parameters belong to no nn.Module in the state; "
        "put the model it trains into the same state dict"
    )


def to_dcp(state: Mapping[str, Any], *, to_load: bool = False) -> dict[str, Any]:
    """The DCP state dict for `state` (tensors share storage with the live objects); `to_load`: made to load a
    checkpoint into, so an optimizer that has no state yet gets it zeroed, with no arithmetic (`_zeroed_state`)."""
    if not isinstance(state, Mapping):
        raise TypeError(f"checkpoint state must be a dict, not {type(state).__name__}")
    out: dict[str, Any] = {}
    for key, value in state.items():
        value = unwrapped(value)
        if isinstance(value, nn.Module):
            out[key] = get_model_state_dict(value)
        elif isinstance(value, torch.optim.Optimizer):
            if to_load and not value.state:
                _zeroed_state(value)
            out[key] = get_optimizer_state_dict(_model_for(key, value, state), value)
        elif _is_stateful(value):
            out[key] = value.state_dict()
        elif _holds_if_saved(value):
            raise TypeError(f"state[{key!r}] holds an IfSaved below the top level: make it an entry of the state")
        else:
            out[key] = value
    return out


def _zeroed_state(optim: torch.optim.Optimizer) -> None:
    """Give an optimizer that took no step its state's tensors, zeroed, for a load to overwrite. DCP would take a
    step of zero gradients at a learning rate of 0: as much arithmetic as a training step's (2 s for AdamW over
    1 GB of state on 2 cores). This takes that step over stand-ins of the parameters on `meta`, where nothing
    is computed, then gives each parameter what its stand-in got, allocated on its device and zeroed (its
    step count as DCP's step leaves it; other values may differ from that step's, and the load sets them). An
    optimizer that reads values in its step fails on `meta`: its state is then left to DCP's step."""
    stand_ins: dict[torch.Tensor, torch.Tensor] = {}
    groups = [group["params"] for group in optim.param_groups]
    rates = [group.get("lr") for group in optim.param_groups]
    made = False
    try:
        for group in optim.param_groups:
            group["params"] = [_stand_in(p, stand_ins) for p in group["params"]]
            if "lr" in group:
                group["lr"] = 0.0
        optim.step()
        made = True
    except Exception:  # noqa: BLE001 - DCP's own step makes the state instead
        pass
    finally:
        for group, params, rate in zip(optim.param_groups, groups, rates, strict=True):
            group["params"] = params
            if "lr" in group:
                group["lr"] = rate
    state = {q: optim.state.pop(q, None) for q in stand_ins.values()}
    if made:  # each parameter the step gave an entry (none: a stateless optimizer, which DCP's step then takes)
        for p, q in stand_ins.items():
            if state[q] is None:  # a frozen one
                continue
            optim.state[p] = {
                name: torch.zeros_like(v, device=p.device) if isinstance(v, torch.Tensor) and v.is_meta else v
                for name, v in state[q].items()
            }


def _stand_in(p: torch.Tensor, stand_ins: dict[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A parameter like `p` on `meta`, with a gradient of zeros where `p` is trained (the same one for a
    parameter listed twice)."""
    if p not in stand_ins:
        q = stand_ins[p] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        if p.requires_grad:
            q.grad = torch.zeros_like(q)
    return stand_ins[p]


def _holds_if_saved(value: Any) -> bool:
    if isinstance(value, IfSaved):
        return True
    if isinstance(value, Mapping):
        return any(_holds_if_saved(v) for v in value.values())
    return isinstance(value, (list, tuple)) and any(_holds_if_saved(v) for v in value)


def load_from_dcp(state: MutableMapping[str, Any], loaded: Mapping[str, Any]) -> None:
    """Push a state dict that `dcp.load` filled (built by `to_dcp(state)`) back into `state`.

    `IfSaved` entries that `loaded` lacks (dropped because the step has none) are left as they are.
    """
    for key, value in state.items():
        if isinstance(value, IfSaved):
            if key not in loaded:
                continue
            value = value.value
        if isinstance(value, nn.Module):
            set_model_state_dict(value, loaded[key])
        elif isinstance(value, torch.optim.Optimizer):
            set_optimizer_state_dict(_model_for(key, value, state), value, loaded[key])
        elif _is_stateful(value):
            value.load_state_dict(loaded[key])
        elif isinstance(value, torch.Tensor):
            if loaded[key] is not value:
                value.copy_(loaded[key])
        else:
            state[key] = loaded[key]


def state_digest(state_dict: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over the names, dtypes and bytes of a state_dict's tensors: equal digests mean
    bit-identical weights (how the tests and the demo compare a resumed run with an uninterrupted one)."""
    h = hashlib.sha256()
    for name, value in sorted(state_dict.items()):
        tensor = value.detach().to("cpu").contiguous()
        h.update(f"{name}:{tensor.dtype}:".encode())
        h.update(ctypes.string_at(tensor.data_ptr(), tensor.numel() * tensor.element_size()))
    return h.hexdigest()


def tensors_of(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors of a (DCP) state dict (a DTensor's local shard)."""
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
