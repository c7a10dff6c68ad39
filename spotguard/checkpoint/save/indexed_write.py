"""DCP's file writer whose coordinator also writes `.metadata.index` (format/metadata_index.py)."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

from spotguard.checkpoint.format.layout import METADATA_INDEX_NAME
from spotguard.checkpoint.format.metadata_index import index_bytes


class IndexedWriter(FileSystemWriter):
    """A `FileSystemWriter` that writes the index of `.metadata` beside it, through its `fs` (so that
    `ChecksummingFileSystem` records it like any file), unless the metadata holds what no index says."""

    def finish(self, metadata: Metadata, results: list[Any]) -> None:
        with _gc_paused():
            super().finish(metadata, results)  # fills metadata.storage_data, then pickles it
            data = index_bytes(metadata)
        if data is None:
            return
        with self.fs.create_stream(self.fs.concat_path(self.path, METADATA_INDEX_NAME), "wb") as stream:
            stream.write(data)
            if self.sync_files:
                os.fsync(stream.fileno())


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No collection while a million chunks' objects are walked: they make no cycles, and each
    collection that the new objects set off would scan them all (a third of the index's time, a
    tenth of the pickle's, at 256 ranks)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
