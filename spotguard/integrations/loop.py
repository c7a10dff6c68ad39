"""A guarded hand-written loop, shared by the Accelerate and Fabric helpers.

    with guarded(..., models=[model], optimizers=[optimizer], schedulers=[scheduler],
                 dataloader=train_loader) as run:
        step = run.resume()
        for epoch, batch in run.batches(num_epochs):
            ...  # forward, backward, optimizer.step, scheduler.step
            if run.step(step):
                break
            step += 1

What is saved, through spotguard's DCP path (agreed step, atomic manifest-last commit): the
models, optimizers and schedulers, the data position (epoch, batches of it drawn) and each rank's
RNG state (under a per-rank key: a rank new at a larger world size finds none and keeps its own).
Resume loads them, and `batches()` goes on from the saved position: the framework's
`EpochBatches` sets the epoch's shuffle and skips the batches already drawn, and each rank's RNG
is put back at the point it was saved, so that the data order and the random draws (dropout) go
on exactly.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from spotguard.checkpoint import IfSaved
from spotguard.guard import Guard
from spotguard.integrations.packed import Packed

# (dataloader, epoch, batches to skip) -> that epoch's batches after the skipped ones, with its shuffle.
EpochBatches = Callable[[Any, int, int], Iterable[Any]]


class GuardedLoop:
    """What `guarded` returns: a context manager (the Guard's) with `resume`, `batches` and `step`."""

    def __init__(
        self, guard: Guard, state: dict[str, Any], rank: int, dataloader: Any, epoch_batches: EpochBatches
    ) -> None:
        self.guard = guard
        self._dataloader = dataloader
        self._epoch_batches = epoch_batches
        self._position = (0, 0)  # epoch, batches of it drawn
        self._rng: dict[str, Any] | None = None  # restored, to be put back when the data reaches it
        self._state = {
            **state,
            "data": Packed(lambda: self._position, self._restore_position),
            f"rng_{rank}": IfSaved(Packed(_rng_state, self._restore_rng)),  # none for a rank new at this world size
        }

    @property
    def emergency_saved(self) -> bool:
        """True once an emergency checkpoint was committed (then the loop should have stopped)."""
        return self.guard.emergency_saved

    def __enter__(self) -> GuardedLoop:
        self.guard.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.guard.close(exc)  # after an emergency, exits 143 (75 when nothing was committed)

    def resume(self) -> int:
        """Load the newest committed checkpoint; the step to start from (0 if none)."""
        return self.guard.resume(self._state)

    def step(self, step: int) -> bool:
        """Call after every optimizer step; True (on every rank) once the emergency checkpoint is committed."""
        return self.guard.step(step, self._state)

    def batches(self, epochs: int) -> Iterator[tuple[int, Any]]:
        """(epoch, batch) for the epochs left, from the position resumed (the batches after it)."""
        if self._dataloader is None:
            raise ValueError("batches() needs guarded(..., dataloader=train_loader)")
        start, skip = self._position
        if skip and skip >= _length(self._dataloader):  # saved after an epoch's last batch
            start, skip = start + 1, 0
        for epoch in range(start, epochs):
            if not skip:  # saved before this epoch's iterator was made, as it is now
                self._put_rng_back()
            drawn = skip
            for batch in self._epoch_batches(self._dataloader, epoch, skip):
                self._put_rng_back()  # saved after the interrupted epoch's iterator was made: now it is
                drawn += 1
                self._position = (epoch, drawn)
                yield epoch, batch
            skip = 0

    def _restore_position(self, position: tuple[int, int]) -> None:
        self._position = tuple(position)  # type: ignore[assignment]

    def _restore_rng(self, state: dict[str, Any]) -> None:
        self._rng = state

    def _put_rng_back(self) -> None:
        if self._rng is not None:
            _set_rng_state(self._rng)
            self._rng = None


def guarded_loop(
    guard: Guard,
    rank: int,
    epoch_batches: EpochBatches,
    models: Sequence[torch.nn.Module],
    optimizers: Sequence[Any],
    schedulers: Sequence[Any],
    dataloader: Any,
) -> GuardedLoop:
    """The loop's state: what the framework's `setup`/`prepare` returned, under fixed keys."""
    state: dict[str, Any] = {f"model{i}": model for i, model in enumerate(models)}
    for i, optimizer in enumerate(optimizers):  # DCP's helpers want the torch optimizer inside the wrapper
        state[f"optim{i}"] = getattr(optimizer, "optimizer", optimizer)
    for i, scheduler in enumerate(schedulers):
        state[f"scheduler{i}"] = scheduler
    return GuardedLoop(guard, state, rank, dataloader, epoch_batches)


def _length(dataloader: Any) -> float:
    try:
        return len(dataloader)
    except TypeError:  # an iterable dataset: skipping past its end just ends the epoch
        return float("inf")


def _rng_state() -> dict[str, Any]:
    """This rank's random state in types `weights_only` loads (numpy's key array as a list)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (kind, keys.tolist(), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
