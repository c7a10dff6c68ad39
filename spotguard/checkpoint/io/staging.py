"""Background saves stall training only for a copy into buffers that outlive the save.

The first background save allocates one host buffer per tensor of the state (pinned memory
for CUDA tensors); later saves copy into the same buffers, so a save costs the training
thread a memcpy (CPU) or a device-to-host copy (CUDA) and no allocation or page faults. CUDA
copies run `non_blocking` on a side stream that first waits for the training stream, and the
training thread waits for them before it goes on: the next optimizer step can then never
overwrite a tensor whose copy has not finished. The background thread serialises and writes
from the buffers. A state whose tensors change (new keys, shapes or dtypes) gets new buffers
for what changed, and buffers nothing uses any more are dropped.

Blocking saves (an emergency; not the survivors' and leaving ranks' saves of a departure) of a
state on a GPU stage too once a background save has allocated the buffers (tensors the background
saves did not hold get buffers then, pinned at the emergency's cost): the device-to-host copy
into them runs at the copy's full speed (one H100: 8 GB in 0.15 s). Allocating them for the
emergency alone would cost more than it saves (pinning 8 GB took 3.2 s), so without a background
save before, the write copies through the small pinned pool as it goes (`pipelined_write`).

Memory: one staged copy of the state in host RAM, kept from one background save to the next.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from spotguard.checkpoint.state import tensors_of

Key = tuple[Any, ...]  # where a tensor sits in the state, and its shape, dtype and device type


class Stager:
    """Copies a (DCP) state dict into reused host buffers; one save at a time uses them."""

    def __init__(self) -> None:
        self._buffers: dict[Key, torch.Tensor] = {}
        self._stream: torch.cuda.Stream | None = None

    def speeds_up(self, state_dict: Mapping[str, Any]) -> bool:
        """Whether a blocking save of `state_dict` should stage first: it holds GPU tensors and buffers exist."""
        return bool(self._buffers) and on_device(state_dict)

    @property
    def nbytes(self) -> int:
        """Host memory the buffers hold now."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """The state with every tensor replaced by its staged copy, complete when this returns.

        The previous staged copy must no longer be in use (the Checkpointer finishes the
        background save before it stages the next one).
        """
        used: set[Key] = set()
        cuda = [False]
        staged = self._copy(state_dict, (), used, cuda)
        if cuda[0]:
            self._stream.synchronize()  # type: ignore[union-attr]
        for path in set(self._buffers) - used:
            del self._buffers[path]
        return staged

    def _copy(self, tree: Any, path: Key, used: set[Key], cuda: list[bool]) -> Any:
        if isinstance(tree, DTensor):  # stage the local shard; the spec (mesh, placements) stays as it is
            local = self._tensor(tree.to_local(), path, used, cuda)
            return DTensor(local, tree._spec, requires_grad=False)  # no move back to the mesh's device
        if isinstance(tree, torch.Tensor):
            return self._tensor(tree, path, used, cuda)
        if isinstance(tree, Mapping):
            return {k: self._copy(v, (*path, k), used, cuda) for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(self._copy(v, (*path, i), used, cuda) for i, v in enumerate(tree))
        return copy.deepcopy(tree)

    def _tensor(self, tensor: torch.Tensor, path: Key, used: set[Key], cuda: list[bool]) -> torch.Tensor:
        tensor = tensor.detach()
        key = (*path, tuple(tensor.shape), tensor.dtype, tensor.device.type)
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            self._buffers[key] = buffer
        used.add(key)
        if tensor.is_cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=tensor.device)
            self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(self._stream):
                buffer.copy_(tensor, non_blocking=True)
            cuda[0] = True
        else:
            buffer.copy_(tensor)
        return buffer


def on_device(tree: Any) -> bool:
    """Whether a (DCP) state dict holds tensors outside host memory."""
    return any(t.device.type != "cpu" for t in tensors_of(tree))
