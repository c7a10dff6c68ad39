"""Sharded checkpoints with torch.distributed.checkpoint: atomic commit, upload, catalog, resume.

Layout: `<checkpoint_dir>/step-<NNNNNNNNNN>/` holds the DCP files and `spotguard.json`,
the manifest, written last. A directory without a manifest does not exist for resume.
"""

from spotguard.checkpoint.catalog import CheckpointInfo, VerifyResult, list_checkpoints, verify_checkpoint
from spotguard.checkpoint.checkpointer import Checkpointer, SaveReport
from spotguard.checkpoint.errors import CheckpointError, CheckpointUnavailable
from spotguard.checkpoint.layout import MANIFEST_NAME, parse_step_dir, step_dir_name
from spotguard.checkpoint.manifest import Manifest, ManifestError
from spotguard.checkpoint.state import IfSaved, state_digest

__all__ = [
    "MANIFEST_NAME",
    "CheckpointError",
    "CheckpointUnavailable",
    "CheckpointInfo",
    "Checkpointer",
    "IfSaved",
    "Manifest",
    "ManifestError",
    "SaveReport",
    "VerifyResult",
    "list_checkpoints",
    "parse_step_dir",
    "state_digest",
    "step_dir_name",
    "verify_checkpoint",
]
