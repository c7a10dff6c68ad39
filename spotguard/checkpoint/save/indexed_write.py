"""The files rank 0 writes after the shards: DCP's `.metadata`, its index (format/metadata_index.py),
and the same bytes again when nothing they are made of changed since the job's last save."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

from spotguard.checkpoint.format.layout import DCP_METADATA_NAME, METADATA_INDEX_NAME
from spotguard.checkpoint.format.metadata_index import index_bytes


class IndexedWriter(FileSystemWriter):
    """A `FileSystemWriter` that writes the index of `.metadata` beside it, through its `fs` (so that
    `ChecksummingFileSystem` records it like any file), unless the metadata holds what no index says."""

    def storage_meta(self) -> None:
        """None in the metadata: DCP's names the temporary stage directory and a fresh id, which nothing
        reads back, and which would make the `.metadata` of two saves of one plan differ."""
        return None

    def finish(self, metadata: Metadata, results: list[Any]) -> None:
        super().finish(metadata, results)  # fills metadata.storage_data, then pickles it
        data = index_bytes(metadata)
        if data is not None:
            self.write_file(METADATA_INDEX_NAME, data)

    def write_file(self, name: str, data: bytes) -> None:
        """`name` in the stage directory (fresh, so nothing is overwritten), synced."""
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
            stream.write(data)
            if self.sync_files:
                os.fsync(stream.fileno())


@dataclasses.dataclass
class MetadataFiles:
    """The files rank 0 wrote after the shards at the job's last save, and what they were made of:
    the global metadata (the same object while the cached plan is reused) and where every rank's items
    went. A save that matches both writes the same bytes again instead of pickling every chunk anew
    (at 1,024 ranks of an FSDP2 model, seconds of an emergency's deadline). Rank 0 holds the bytes."""

    made_of: tuple[Metadata, Any] | None = None
    files: dict[str, bytes] = dataclasses.field(default_factory=dict)

    def reuse(self, metadata: Metadata, placements: Any) -> dict[str, bytes] | None:
        """The files to write again, or None when something they are made of changed."""
        if self.made_of is None or self.made_of[0] is not metadata or self.made_of[1] != placements:
            return None
        return self.files

    def keep(self, metadata: Metadata, placements: Any, stage_dir: Path) -> None:
        names = (DCP_METADATA_NAME, METADATA_INDEX_NAME)
        self.files = {name: (stage_dir / name).read_bytes() for name in names if (stage_dir / name).exists()}
        self.made_of = (metadata, placements)
