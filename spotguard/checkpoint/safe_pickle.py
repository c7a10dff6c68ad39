"""Read the pickles in a checkpoint without letting them run code.

DCP's `.metadata` is a pickle, and DCP's default planner loads every non-tensor value of
a state with `torch.load(weights_only=False)`: either would run whatever code the writer of
the checkpoint chose. Here `.metadata` goes through an unpickler that admits only the types
real DCP metadata holds, and non-tensor values through `torch.load(weights_only=True)`. Both
also admit what the user allowed with `torch.serialization.add_safe_globals`.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import re
from typing import IO, Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

_HINT = "to allow a type of your own: torch.serialization.add_safe_globals([...])"


class RefusedPickle(pickle.UnpicklingError):
    """A pickle in a checkpoint names a global that is not allowed, or is not what it should be."""


def _name(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def _metadata_globals() -> dict[str, Any]:
    """Every global the `.metadata` of a real checkpoint refers to, by the name its pickle uses.

    Found by recording the globals in checkpoints of plain, DDP and FSDP2 (2 ranks) modules
    with Adam/AdamW/SGD state, an LR scheduler, and tensors and plain values of many kinds.
    """
    dcp_types = (
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorStorageMetadata,
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        _MEM_FORMAT_ENCODING,  # how TensorProperties pickles its memory format
        _StorageInfo,
        torch.Size,
    )
    allowed = {_name(t): t for t in dcp_types}
    allowed.update({f"torch.{name}": v for name, v in vars(torch).items() if isinstance(v, torch.dtype)})
    allowed["torch.serialization._get_layout"] = torch.serialization._get_layout  # how a torch.layout pickles
    # StorageMeta.checkpoint_id is the writer's path; Python 3.13 moved PosixPath to pathlib._local.
    allowed["pathlib.PosixPath"] = allowed["pathlib._local.PosixPath"] = pathlib.PosixPath
    return allowed


_METADATA_GLOBALS = _metadata_globals()


def _user_globals() -> dict[str, Any]:
    """What `torch.serialization.add_safe_globals` allowed (read on every use: it may grow)."""
    allowed = {}
    for entry in torch.serialization.get_safe_globals():
        obj, name = entry if isinstance(entry, tuple) else (entry, _name(entry))
        allowed[name] = obj
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # Looked up by name, never imported: importing a module can run code too.
        full = f"{module}.{name}"
        allowed = {**_user_globals(), **_METADATA_GLOBALS}.get(full)
        if allowed is None:
            raise RefusedPickle(f"refused to unpickle global {full} (not a DCP metadata type; {_HINT})")
        return allowed


def load_metadata(data: bytes) -> Metadata:
    """DCP's `.metadata` from its bytes, unpickled with nothing but the allowed globals."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except RefusedPickle:
        raise
    except Exception as exc:  # a pickle that only uses allowed globals can still be garbage
        raise RefusedPickle(f"unreadable DCP metadata: {type(exc).__name__}: {exc}") from None
    if not isinstance(metadata, Metadata):
        raise RefusedPickle(f"DCP metadata unpickles to a {type(metadata).__name__}, not a Metadata")
    return metadata


def load_value(stream: IO[bytes], fqn: str) -> Any:
    """A non-tensor value DCP stored with torch.save, loaded with torch's weights-only unpickler."""
    try:
        return torch.load(stream, weights_only=True)
    except Exception as exc:
        stream.seek(0)
        try:
            refused = torch.serialization.get_unsafe_globals_in_checkpoint(stream)
        except Exception:  # not even a torch.save file: the load's own error says enough
            refused = []
        if refused:
            raise RefusedPickle(f"{fqn}: refused to unpickle global {', '.join(refused)} ({_HINT})") from None
        raise RefusedPickle(f"{fqn}: not loadable with weights_only=True: {_one_line(exc)}") from None


def _one_line(exc: Exception) -> str:
    """The gist of torch's several-paragraph weights-only error (the whole message otherwise)."""
    text = str(exc)
    gist = re.search(r"WeightsUnpickler error:\s*(.*?)\s*(?:\n\n|$)", text, re.DOTALL)
    return " ".join((gist.group(1) if gist else text).split())


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor values are loaded with `load_value`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = load_value(value, fqn)
        # Where DefaultLoadPlanner.load_bytes puts the value it loads with weights_only=False.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded
