"""The resume path: the newest good step found and loaded, each file read once, checked as it is read,
and only what the manifest vouches for."""

import importlib
import warnings


def __getattr__(name: str) -> object:
    if name == "RESUME_TIMEOUT_S":  # named here by the guides before the resume path became a folder
        warnings.warn(
            "spotguard.checkpoint.resume.RESUME_TIMEOUT_S moved to spotguard.checkpoint.resume.newest",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module("spotguard.checkpoint.resume.newest").RESUME_TIMEOUT_S
    raise AttributeError(f"module 'spotguard.checkpoint.resume' has no attribute {name!r}")
