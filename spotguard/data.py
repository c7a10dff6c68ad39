"""A sampler that resumes exactly where the job stopped, at any world size.

`DistributedSampler` gives rank r every world_size-th index of the epoch's order, so restarting it
with another world size (or from the epoch's start) repeats or skips samples. Here the epoch has
one global, seeded order, consumed in **global batches** of `world_size * batch_size` indices:

    order = permutation(len(dataset), seed + epoch)
    step at global position p:  rank r takes order[p + r*b : p + (r+1)*b];  p += world_size * b

Only the global position and the epoch are state (`state_dict` / `load_state_dict`: put the
sampler in the Guard's `state`). After a resume at any world size the remaining indices of the
epoch are exactly the unconsumed ones, split by the *current* world size. The tail of an epoch
smaller than one global batch is skipped (as `drop_last`), never padded with repeats, so every
rank runs the same number of steps; the next epoch's order is a fresh permutation.

DataLoader workers prefetch indices ahead of training, so the sampler cannot tell from its own
iteration what was trained on: call `advance()` once per training step (after the step, before
`guard.step()`), and the saved position is exactly what the model has seen.

Map-style datasets only: the sampler hands out indices. An iterable dataset has no indices to
hand out; resuming it exactly needs the dataset's own state (e.g. torchdata's
`StatefulDataLoader`), and its split across ranks is the dataset's business.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    """This rank's indices of each global batch, from the saved global position (use as `sampler=`
    with `DataLoader(batch_size=batch_size)`).

    Args:
        data: the map-style dataset (anything with `len()`) or its length.
        batch_size: samples per rank per step.
        seed: the epoch's order is a permutation seeded with `seed + epoch`; the same on every rank.
        shuffle: False keeps the dataset's order (0, 1, 2, ...) every epoch.
        rank: this process's rank; default: the default process group's (0 without one).
        world_size: the number of ranks; default: the default process group's (1 without one).
    """

    def __init__(
        self,
        data: Sized | int,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        size = data if isinstance(data, int) else len(data)
        _require_int(size=size, batch_size=batch_size, seed=seed)
        if size <= 0 or batch_size <= 0:
            raise ValueError(f"dataset length and batch_size must be positive, got {size} and {batch_size}")
        distributed = dist.is_available() and dist.is_initialized()
        world_size = world_size if world_size is not None else dist.get_world_size() if distributed else 1
        rank = rank if rank is not None else dist.get_rank() if distributed else 0
        _require_int(rank=rank, world_size=world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.size = size
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.position = 0  # indices of this epoch's order consumed by the whole job

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_size

    def steps_left(self) -> int:
        """Training steps left in this epoch at the current world size."""
        return (self.size - self.position) // self.global_batch

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning; the epoch already current (e.g. resumed) keeps its position."""
        _require_int(epoch=epoch)
        if epoch != self.epoch:
            self.epoch = epoch
            self.position = 0

    def advance(self, steps: int = 1) -> None:
        """Record that the job trained `steps` more global batches (call once per training step)."""
        _require_int(steps=steps)
        if steps < 0 or steps > self.steps_left():
            raise ValueError(f"cannot advance {steps} steps: {self.steps_left()} left in epoch {self.epoch}")
        self.position += steps * self.global_batch

    def order(self) -> list[int]:
        """The whole epoch's global order."""
        if not self.shuffle:
            return list(range(self.size))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def batches(self) -> Iterator[list[int]]:
        """This rank's share of each remaining global batch of the epoch."""
        order = self.order()
        start = self.position  # a snapshot: loaders prefetch, `advance()` moves the live position
        first = self.rank * self.batch_size
        for p in range(start, start + self.steps_left() * self.global_batch, self.global_batch):
            yield order[p + first : p + first + self.batch_size]

    def __iter__(self) -> Iterator[int]:
        for batch in self.batches():
            yield from batch

    def __len__(self) -> int:
        return self.steps_left() * self.batch_size

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "size": self.size, "seed": self.seed,
                "shuffle": self.shuffle}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = {"size": self.size, "seed": self.seed, "shuffle": self.shuffle}
        saved = {k: state[k] for k in mine}
        if saved != mine:
            raise ValueError(f"the checkpoint's sampler was made for another order ({saved}), this one is {mine}")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


class ResumableBatchSampler(ResumableSampler):
    """The same, yielding this rank's batch of each step (use as `batch_sampler=`)."""

    def __iter__(self) -> Iterator[list[int]]:  # type: ignore[override]
        return self.batches()

    def __len__(self) -> int:
        return self.steps_left()


def _require_int(**values: Any) -> None:
    for name, value in values.items():
        try:
            if isinstance(value, bool) or operator.index(value) != value:
                raise TypeError
        except TypeError:
            raise TypeError(f"{name} must be an int, not {type(value).__name__} ({value!r})") from None
