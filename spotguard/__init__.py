"""spotguard: keep distributed PyTorch training alive on spot / preemptible VMs."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from cloud_adapters.notice import Notice

__version__ = "0.1.0"

# What a training script meets, and where it lives. Loaded on first use: most of it pulls in torch,
# and `spotguard watch` and the emulators should stay light.
_LAZY = {
    "Guard": "spotguard.guard",
    "GuardOptions": "spotguard.options",
    "NoticeOptions": "spotguard.options",
    "SaveOptions": "spotguard.options",
    "StorageOptions": "spotguard.options",
    "ExitOptions": "spotguard.options",
    "CoordinationOptions": "spotguard.options",
    "SnapshotOptions": "spotguard.options",
    "HealthOptions": "spotguard.options",
    "Checkpointer": "spotguard.checkpoint.checkpointer",
    "SaveReport": "spotguard.checkpoint.checkpointer",
    "IfSaved": "spotguard.checkpoint.state",
    "CheckpointError": "spotguard.checkpoint.errors",
    "CheckpointUnavailable": "spotguard.checkpoint.errors",
    "CheckpointInfo": "spotguard.checkpoint.catalog",
    "list_checkpoints": "spotguard.checkpoint.catalog",
    "verify_checkpoint": "spotguard.checkpoint.catalog",
    "ResumableSampler": "spotguard.data",
    "ResumableBatchSampler": "spotguard.data",
    "run": "spotguard.inprocess.runner",
    "Context": "spotguard.inprocess.context",
    "Recovery": "spotguard.inprocess.context",
    "JoinError": "spotguard.inprocess.joining",
}

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointUnavailable",
    "Checkpointer",
    "Context",
    "CoordinationOptions",
    "ExitOptions",
    "Guard",
    "GuardOptions",
    "HealthOptions",
    "IfSaved",
    "JoinError",
    "Notice",
    "NoticeOptions",
    "ResumableBatchSampler",
    "ResumableSampler",
    "Recovery",
    "SaveOptions",
    "SaveReport",
    "SnapshotOptions",
    "StorageOptions",
    "__version__",
    "list_checkpoints",
    "run",
    "verify_checkpoint",
]

if TYPE_CHECKING:
    from spotguard.checkpoint.catalog import CheckpointInfo, list_checkpoints, verify_checkpoint
    from spotguard.checkpoint.checkpointer import Checkpointer, SaveReport
    from spotguard.checkpoint.errors import CheckpointError, CheckpointUnavailable
    from spotguard.checkpoint.state import IfSaved
    from spotguard.data import ResumableBatchSampler, ResumableSampler
    from spotguard.guard import Guard
    from spotguard.inprocess.context import Context, Recovery
    from spotguard.inprocess.joining import JoinError
    from spotguard.inprocess.runner import run
    from spotguard.options import (
        CoordinationOptions,
        ExitOptions,
        GuardOptions,
        HealthOptions,
        NoticeOptions,
        SaveOptions,
        SnapshotOptions,
        StorageOptions,
    )


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'spotguard' has no attribute {name!r}")
