"""Lightning Fabric: a guarded hand-written loop (see `spotguard.integrations.loop` for its shape).

    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(loader)
    with guarded(fabric, "s3://bucket/run", models=[model], optimizers=[optimizer],
                 dataloader=loader) as run:
        ...

Pass what `fabric.setup` / `fabric.setup_dataloaders` returned. Fabric's dataloader sets its
sampler's epoch from how many times it was iterated; on resume `run.batches()` sets that count to
the saved epoch (so the shuffle is that epoch's) and skips the batches already drawn by drawing
them (Fabric has no cheaper skip). The Guard owns SIGTERM: Fabric installs no handler of its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import lightning
import torch
from lightning.fabric import Fabric
from lightning.fabric.wrappers import _FabricDataLoader, _FabricModule

from spotguard.guard import Guard
from spotguard.integrations.loop import GuardedLoop, guarded_loop


def guarded(
    fabric: Fabric,
    checkpoint_dir: str,
    cloud: str | None = None,
    *,
    models: Sequence[torch.nn.Module],
    optimizers: Sequence[torch.optim.Optimizer] = (),
    schedulers: Sequence[Any] = (),
    dataloader: Any = None,
    **options: Any,
) -> GuardedLoop:
    """A Guard (same `options`) over what `fabric.setup` returned, with the data position and RNG."""
    if dataloader is not None and not isinstance(dataloader, _FabricDataLoader):
        raise ValueError("dataloader must be what fabric.setup_dataloaders(...) returned")
    if dataloader is not None and not hasattr(dataloader, "_num_iter_calls"):
        # Without it the resumed epoch's shuffle could not be set: refuse now rather than resume a wrong data order.
        raise RuntimeError(
            f"this Lightning ({lightning.__version__}) keeps no `_num_iter_calls` on Fabric's dataloader, which "
            "spotguard.integrations.fabric sets to resume an epoch's shuffle (tested with Lightning 2.6)"
        )
    guard = Guard(checkpoint_dir, cloud, **options)
    # The strategy's module (DDP, FSDP) inside Fabric's wrapper, whose state dict keys differ from its parameters'.
    models = [m._forward_module if isinstance(m, _FabricModule) else m for m in models]
    return guarded_loop(guard, fabric.global_rank, _epoch_batches, models, optimizers, schedulers, dataloader)


def _epoch_batches(dataloader: _FabricDataLoader, epoch: int, skip: int) -> Any:
    dataloader._num_iter_calls = epoch  # Fabric sets the sampler's epoch from this count as iteration starts
    return itertools.islice(dataloader, skip, None)
