"""Accelerate: a guarded hand-written loop (see `spotguard.integrations.loop` for the loop's shape).

    with guarded(accelerator, "s3://bucket/run", models=[model], optimizers=[optimizer],
                 schedulers=[scheduler], dataloader=train_loader) as run:
        ...

Pass what `accelerator.prepare` returned. On resume, `run.batches()` skips the interrupted
epoch's drawn batches with `accelerator.skip_first_batches` and sets the loader's epoch (its
shuffle), also on the skipping copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from accelerate import Accelerator

from spotguard.guard import Guard
from spotguard.integrations.loop import EpochBatches, GuardedLoop, guarded_loop


def guarded(
    accelerator: Accelerator,
    checkpoint_dir: str,
    cloud: str | None = None,
    *,
    models: Sequence[torch.nn.Module],
    optimizers: Sequence[torch.optim.Optimizer] = (),
    schedulers: Sequence[Any] = (),
    dataloader: Any = None,
    **options: Any,
) -> GuardedLoop:
    """A Guard (same `options`) over what `accelerator.prepare` returned, with the data position and RNG."""
    guard = Guard(checkpoint_dir, cloud, **options)
    return guarded_loop(
        guard, accelerator.process_index, _epoch_batches(accelerator), models, optimizers, schedulers, dataloader
    )


def _epoch_batches(accelerator: Accelerator) -> EpochBatches:
    def epoch_batches(dataloader: Any, epoch: int, skip: int) -> Any:
        loader = accelerator.skip_first_batches(dataloader, skip) if skip else dataloader
        if hasattr(loader, "set_epoch"):  # the shuffle of this epoch, also for the skipping copy
            loader.set_epoch(epoch)
        return loader

    return epoch_batches
