"""Framework bookkeeping (loop counters, trainer state, RNG) as one value of a checkpoint.

DCP flattens nested dicts key by key and loads into the structure the fresh process has, which
differs from the saved one whenever bookkeeping grew keys during training (a best score, a
dataloader state). Packing it with `torch.save` into one bytes value keeps the structure fixed;
it is read back with `torch.load(weights_only=True)`, so a checkpoint still cannot run code.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch


class Packed:
    """A Stateful whose whole state is `get()`, handed back to `put(value)` on load."""

    def __init__(self, get: Callable[[], Any], put: Callable[[Any], None]) -> None:
        self._get = get
        self._put = put

    def state_dict(self) -> dict[str, bytes]:
        buffer = io.BytesIO()
        torch.save(self._get(), buffer)
        return {"packed": buffer.getvalue()}

    def load_state_dict(self, state: dict[str, bytes]) -> None:
        self._put(torch.load(io.BytesIO(state["packed"]), weights_only=True))
