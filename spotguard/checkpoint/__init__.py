"""Sharded checkpoints with torch.distributed.checkpoint: atomic commit, upload, catalog, resume.

Layout: `<checkpoint_dir>/step-<NNNNNNNNNN>/` holds the DCP files and `spotguard.json`,
the manifest, written last. A directory without a manifest does not exist for resume.

The names below are the package's public surface (also exported by `spotguard`, but for
`state_digest`, which the examples use to show that a resumed run is bit-identical); the
modules inside are internal. Nothing here imports the guard's own modules: the checkpoint
layer stands on `cloud_adapters` and `spotguard.job.kvstore` alone.
"""

import importlib
import warnings

from spotguard.checkpoint.catalog import CheckpointInfo, list_checkpoints, verify_checkpoint
from spotguard.checkpoint.checkpointer import Checkpointer, SaveReport
from spotguard.checkpoint.errors import CheckpointError, CheckpointUnavailable
from spotguard.checkpoint.state import IfSaved, state_digest

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointUnavailable",
    "Checkpointer",
    "IfSaved",
    "SaveReport",
    "list_checkpoints",
    "state_digest",
    "verify_checkpoint",
]

# Exported here by earlier versions; internal now, importable from their modules.
_MOVED = {
    "MANIFEST_NAME": "spotguard.checkpoint.layout",
    "parse_step_dir": "spotguard.checkpoint.layout",
    "step_dir_name": "spotguard.checkpoint.layout",
    "Manifest": "spotguard.checkpoint.manifest",
    "ManifestError": "spotguard.checkpoint.manifest",
    "VerifyResult": "spotguard.checkpoint.catalog",
}


def __getattr__(name: str) -> object:
    if name in _MOVED:
        warnings.warn(
            f"spotguard.checkpoint.{name} is internal now: import it from {_MOVED[name]}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'spotguard.checkpoint' has no attribute {name!r}")
