"""CRC32C (and SHA-256 with a checkpoint key) of bytes as they go by: no second pass over a file, no
copy of the buffer. Every tier's checks use these: DCP's shard files, snapshots, handoffs, reads."""

from __future__ import annotations

import functools
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


# CRC32C's polynomial, bit-reversed as the CRC is computed (least significant bit first).
_CRC32C_POLY = 0x82F63B78


def _crc32c_mulmod(a: int, b: int) -> int:
    """a(x) * b(x) modulo CRC32C's polynomial, both in the CRC's bit-reversed form (x**0 is 1 << 31)."""
    product = 0
    bit = 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _CRC32C_POLY if b & 1 else b >> 1
    return product


def _crc32c_powers() -> list[int]:
    """x**(2**k) modulo the polynomial, k = 0..63 (x is 1 << 30 reversed): each the square of the one before."""
    powers = [1 << 30]
    for _ in range(63):
        powers.append(_crc32c_mulmod(powers[-1], powers[-1]))
    return powers


_X_POW_2K = _crc32c_powers()


def crc32c_combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """The CRC32C of bytes A followed by bytes B, from A's CRC32C, B's and B's length.

    Appending B to A multiplies A's register by x**(8 * len(B)) modulo the polynomial and adds B's (the
    CRC's initial and final inversions cancel out, as they are the same for A, B and A + B). So pieces of
    a file checksummed by different threads, in any order, give the file's CRC32C once folded in order.
    """
    return _crc32c_mulmod(_shift(length_b), crc_a) ^ crc_b


@functools.lru_cache(maxsize=4096)  # a file's pieces are mostly of a few lengths
def _shift(length: int) -> int:
    """x**(8 * length) modulo the polynomial."""
    shift = 1 << 31  # x**0
    bits, k = 8 * length, 0
    while bits:
        if bits & 1:
            shift = _crc32c_mulmod(_X_POW_2K[k], shift)
        bits >>= 1
        k += 1
    return shift


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
