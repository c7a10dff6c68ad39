"""Accelerate: a guarded hand-written loop.

    with guarded(accelerator, "s3://bucket/run", models=[model], optimizers=[optimizer],
                 schedulers=[scheduler], dataloader=train_loader) as run:
        step = run.resume()
        for epoch, batch in run.batches(num_epochs):
            ...  # forward, accelerator.backward, optimizer.step, scheduler.step
            if run.step(step):
                break
            step += 1

What is saved, through spotguard's DCP path (agreed step, atomic manifest-last commit): the
models, optimizers and schedulers (as `accelerator.prepare` returned them), the data position
(epoch, batches of it drawn) and each rank's RNG state (under a per-rank key). Resume loads
them, and `batches()` goes on from the saved position with `accelerator.skip_first_batches`,
setting the loader's epoch (its shuffle) and putting each rank's RNG back at the point it was
saved, so that the data order and the random draws (dropout) go on exactly.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator

from spotguard.guard import Guard
from spotguard.integrations.packed import Packed


class GuardedLoop:
    """What `guarded` returns: a context manager (the Guard's) with `resume`, `batches` and `step`."""

    def __init__(self, accelerator: Accelerator, guard: Guard, state: dict[str, Any], dataloader: Any) -> None:
        self.accelerator = accelerator
        self.guard = guard
        self._dataloader = dataloader
        self._position = (0, 0)  # epoch, batches of it drawn
        self._rng: dict[str, Any] | None = None  # restored, to be put back when the data reaches it
        self._state = {
            **state,
            "data": Packed(lambda: self._position, self._restore_position),
            f"rng_{accelerator.process_index}": Packed(_rng_state, self._restore_rng),
        }

    @property
    def emergency_saved(self) -> bool:
        """True once an emergency checkpoint was committed (then the loop should have stopped)."""
        return self.guard.emergency_saved

    def __enter__(self) -> GuardedLoop:
        self.guard.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.guard.__exit__(*exc)  # after an emergency, exits 143 (75 when nothing was committed)

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
            loader = self.accelerator.skip_first_batches(self._dataloader, skip) if skip else self._dataloader
            if hasattr(loader, "set_epoch"):  # the shuffle of this epoch, also for the skipping copy
                loader.set_epoch(epoch)
            if not skip:  # saved before this epoch's iterator was made, as it is now
                self._put_rng_back()
            drawn = skip
            for batch in loader:
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


def guarded(
    accelerator: Accelerator,
    checkpoint_dir: str,
    cloud: str = "auto",
    *,
    models: Sequence[torch.nn.Module],
    optimizers: Sequence[torch.optim.Optimizer] = (),
    schedulers: Sequence[Any] = (),
    dataloader: Any = None,
    **options: Any,
) -> GuardedLoop:
    """A Guard (same `options`) over what `accelerator.prepare` returned, with the data position and RNG."""
    state: dict[str, Any] = {f"model{i}": model for i, model in enumerate(models)}
    for i, optimizer in enumerate(optimizers):  # DCP's helpers want the torch optimizer inside Accelerate's
        state[f"optim{i}"] = getattr(optimizer, "optimizer", optimizer)
    for i, scheduler in enumerate(schedulers):
        state[f"scheduler{i}"] = scheduler
    return GuardedLoop(accelerator, Guard(checkpoint_dir, cloud, **options), state, dataloader)


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
