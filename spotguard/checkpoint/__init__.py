"""Sharded checkpoints with torch.distributed.checkpoint: atomic commit, upload, catalog, resume.

Layout: `<checkpoint_dir>/step-<NNNNNNNNNN>/` holds the DCP files and `spotguard.json`,
the manifest, written last. A directory without a manifest does not exist for resume.

The names below are the package's public surface (also exported by `spotguard`, but for
`state_digest`, which the examples use to show that a resumed run is bit-identical); the
modules inside are internal: `format/` (what a committed step is made of), `save/` (the save path),
`resume/` (the resume path) and `moves/` (between tiers and ranks). The layer stands on
`cloud_adapters` and `spotguard.job` (the store, the topology, where leaving ranks meet survivors);
nothing here imports the guard's side.
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
    "MANIFEST_NAME": "spotguard.checkpoint.format.layout",
    "parse_step_dir": "spotguard.checkpoint.format.layout",
    "step_dir_name": "spotguard.checkpoint.format.layout",
    "Manifest": "spotguard.checkpoint.format.manifest",
    "ManifestError": "spotguard.checkpoint.format.manifest",
    "VerifyResult": "spotguard.checkpoint.catalog",
}
# Modules the guides named before checkpoint/ was grouped by path (`spotguard.checkpoint.bounce`...).
_MOVED_MODULES = {
    "bounce": "spotguard.checkpoint.io.bounce",
    "retention": "spotguard.checkpoint.save.retention",
}


def __getattr__(name: str) -> object:
    if name in _MOVED:
        warnings.warn(
            f"spotguard.checkpoint.{name} is internal now: import it from {_MOVED[name]}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(_MOVED[name]), name)
    if name in _MOVED_MODULES:
        warnings.warn(f"spotguard.checkpoint.{name} moved to {_MOVED_MODULES[name]}", DeprecationWarning, stacklevel=2)
        return importlib.import_module(_MOVED_MODULES[name])
    raise AttributeError(f"module 'spotguard.checkpoint' has no attribute {name!r}")
