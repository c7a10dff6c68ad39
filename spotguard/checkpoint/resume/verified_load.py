"""One step loaded into the user's state by DCP, trusting only what its manifest vouches for."""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from spotguard.checkpoint.comm import Comm
from spotguard.checkpoint.errors import CheckpointError
from spotguard.checkpoint.format.auth import signature_problem
from spotguard.checkpoint.format.layout import DCP_METADATA_NAME, METADATA_INDEX_NAME
from spotguard.checkpoint.format.manifest import Manifest, checksum_bytes, mismatch
from spotguard.checkpoint.format.metadata_index import read_index
from spotguard.checkpoint.format.safe_pickle import WeightsOnlyLoadPlanner, load_metadata
from spotguard.checkpoint.resume.local_chunks import local_boxes
from spotguard.checkpoint.resume.shard_read import read_checked
from spotguard.checkpoint.state import load_from_dcp, optional_keys

log = logging.getLogger(__name__)


class VerifiedReader(FileSystemReader):
    """A DCP reader that trusts only what the manifest vouches for, and never unpickles with a general unpickler.

    `.metadata` is a pickle: its bytes are checked against the manifest in memory (with a
    checkpoint `key`, the manifest's HMAC and the file's SHA-256 too), then unpickled with only
    DCP's metadata types allowed. When the manifest lists `.metadata.index` and the reader is given
    `state_dict` (the DCP form of the state it loads into), that index is read instead (checked
    the same way, then parsed without pickle), keeping only the chunks this rank loads
    (`local_boxes`). Every shard the metadata points to must be a manifest file; non-tensor
    values are loaded by `WeightsOnlyLoadPlanner`. The shard files are read by `threads` threads and
    checked as they are read (`read_checked`): a damaged one raises `Damaged` at its end.
    """

    def __init__(
        self,
        path: Path,
        manifest: Manifest,
        key: bytes | None = None,
        *,
        threads: int = 4,
        state_dict: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(path)
        self.threads = threads
        self.key = key
        # Checked again here, not only by _verify: the manifest read now is the one whose files DCP reads.
        if key is not None and (unsigned := signature_problem(manifest, key)):
            raise CheckpointError(f"{path}: {unsigned}")
        self.manifest = manifest
        # Read here rather than in read_metadata, whose errors DCP logs as "metadata not found".
        if state_dict is not None and manifest.file(METADATA_INDEX_NAME) is not None:
            listed = {f.name for f in manifest.files}
            self.metadata = read_index(self._checked(METADATA_INDEX_NAME), local_boxes(state_dict), listed.__contains__)
        else:  # an older step, or one whose metadata no index could say
            self.metadata = load_metadata(self._checked(DCP_METADATA_NAME))

    def _checked(self, name: str) -> bytes:
        """The bytes of the step's file `name`, as its manifest record vouches for them."""
        record = self.manifest.file(name)
        if record is None:
            raise CheckpointError(f"{self.path}: the manifest does not list {name}")
        data, sha256 = (self.path / name).read_bytes(), self.key is not None
        wrong = mismatch(checksum_bytes(name, data, sha256=sha256), record, sha256=sha256)
        if wrong:
            raise CheckpointError(f"{self.path}/{wrong}")
        return data

    def read_metadata(self) -> Any:  # no rank kwarg: DCP must not fall back to rank-local metadata
        return self.metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not isinstance(planner, WeightsOnlyLoadPlanner):  # any other would unpickle non-tensor values freely
            raise CheckpointError(f"VerifiedReader needs a WeightsOnlyLoadPlanner, not a {type(planner).__name__}")
        records = {r.name: r for r in self.manifest.files}
        read_checked(
            self.path, plan, planner, self.storage_data, records, threads=self.threads, sha256=self.key is not None
        )
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        listed = {f.name for f in self.manifest.files}
        unlisted = {info.relative_path for info in self.storage_data.values()} - listed
        if unlisted:
            raise CheckpointError(
                f"{self.path}: DCP metadata points at files the manifest does not list: {sorted(unlisted)}"
            )


def load_verified(reader: VerifiedReader, loaded: dict[str, Any], state: MutableMapping[str, Any], comm: Comm) -> None:
    """Load `loaded` (the DCP form of `state`) from the step `reader` reads, then into `state`; a key
    the step was saved without (an optional one, `state.optional_keys`) is left as it is."""
    saved = _saved_keys(reader.metadata)
    for key in optional_keys(state):
        if key not in saved:
            del loaded[key]
            log.info(
                "rank %d: %s has no %r (saved by %d ranks): left as it is",
                comm.rank,
                reader.path.name,
                key,
                reader.manifest.world_size,
            )
    with comm.dcp_args() as dist_args:
        dcp.load(loaded, storage_reader=reader, planner=WeightsOnlyLoadPlanner(), **dist_args)
    load_from_dcp(state, loaded)


def _saved_keys(metadata: Any) -> set[str]:
    """The top-level keys of the state a step was saved from."""
    paths = metadata.planner_data  # flat name -> its path in the state: "rng_1.packed" -> ("rng_1", "packed")
    if isinstance(paths, dict) and paths:
        return {path[0] for path in paths.values()}
    return set(metadata.state_dict_metadata)  # saved without flattening: the names are the keys
