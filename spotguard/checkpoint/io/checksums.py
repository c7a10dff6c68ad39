"""CRC32C (and SHA-256 with a checkpoint key) of bytes as they go by: no second pass over a file, no
copy of the buffer. Every tier's checks use these: DCP's shard files, snapshots, handoffs, reads."""

from __future__ import annotations

import hashlib
from typing import Any

import google_crc32c
import numpy

from spotguard.checkpoint.format.manifest import FileRecord

# The checksum runs holding the GIL (see _ChecksummingStream.write); slices this small keep
# each hold to ~0.1 ms, so a training thread running beside a background save is not stalled.
_CRC_SLICE = 1 << 20


def crc32c_extend(crc: int, data: Any) -> int:
    """`crc` extended over any buffer (a memoryview, an ndarray, bytes), without a copy."""
    view = memoryview(data).cast("B")
    for start in range(0, len(view), _CRC_SLICE):
        # google_crc32c takes only read-only buffers without a release hook: bytes (a copy) or
        # an ndarray view of the same memory (no copy) -- torch.save hands us memoryviews.
        crc = google_crc32c.extend(crc, numpy.frombuffer(view[start : start + _CRC_SLICE], numpy.uint8))
    return crc


class RunningChecksum:
    """Size, CRC32C and (with `sha256`) SHA-256 of a file's bytes seen in order, as it is written or read."""

    def __init__(self, *, sha256: bool) -> None:
        self.size = 0
        self.crc = 0
        # Only with a checkpoint key: a save without one costs nothing more. hashlib releases
        # the GIL while it hashes a large buffer, so this needs no slicing like the CRC.
        self._sha256 = hashlib.sha256() if sha256 else None

    def update(self, data: Any, nbytes: int) -> None:
        """`data` (any buffer) came next in the file: `nbytes` bytes."""
        self.crc = crc32c_extend(self.crc, data)
        if self._sha256 is not None:
            self._sha256.update(data)
        self.size += nbytes

    def record(self, name: str) -> FileRecord:
        return FileRecord(name, self.size, f"{self.crc:08x}", self._sha256.hexdigest() if self._sha256 else None)
