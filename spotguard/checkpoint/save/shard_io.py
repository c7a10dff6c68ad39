"""How DCP's shard files get written fast: the file system layer under its FileSystemWriter.

Three things make a save faster than a plain `dcp.save` followed by a checksum pass:
the CRC32C of each file (and its SHA-256, with a checkpoint key) is computed from the bytes
as DCP hands them over (no second read); torch.save's own per-record zip CRC32 is switched off
on the threads that write (the manifest's CRC32C already covers every byte; torch.load does not
check the zip's); and on Linux the disk starts writing each file while it is still being filled
(sync_file_range) instead of only at the closing fsync, so serializing and writing overlap. With a `tee`
(`streaming.ShardStreams.open`), each file's bytes also go to the object store part by part
as they are written.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch.serialization
from torch.distributed.checkpoint.filesystem import FileSystem

from spotguard.checkpoint.format.manifest import FileRecord, checksum_file
from spotguard.checkpoint.io.checksums import RunningChecksum
from spotguard.checkpoint.io.libc import libc_function

if TYPE_CHECKING:
    from spotguard.checkpoint.moves.streaming import StreamedFile

_WRITEBACK_STEP = 32 << 20  # start writeback of every this many bytes written


class ChecksummingFileSystem(FileSystem):
    """DCP's local file system, checksumming each file it writes as the bytes go by (SHA-256 too with `sha256`)."""

    def __init__(self, *, sha256: bool = False, tee: Callable[[Path], StreamedFile | None] | None = None) -> None:
        super().__init__()
        self._records: dict[str, FileRecord] = {}
        self._sha256 = sha256
        self._tee = tee

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        tee = None
        try:
            with super().create_stream(path, mode) as raw:
                if mode != "wb":
                    yield raw
                    return
                tee = self._tee(Path(path)) if self._tee is not None else None
                stream = _ChecksummingStream(raw, sha256=self._sha256, tee=tee)
                with without_zip_crc32():  # on this thread, the one that writes the file
                    yield stream
        except BaseException:
            if tee is not None:
                tee.fail("the local write failed")
            raise
        if tee is not None:
            tee.closed(stream.size)
        self._records[os.fspath(path)] = stream.record(Path(path).name)

    def record_for(self, path: Path) -> FileRecord:
        """The inline record when it covers the whole file as it is on disk, else a fresh read."""
        record = self._records.get(os.fspath(path))
        if record is not None and record.size == path.stat().st_size:
            return record
        return checksum_file(path, sha256=self._sha256)


class _ChecksummingStream:
    """A write-only file that keeps the size and CRC32C (and SHA-256) of everything written through it.

    DCP only appends to the shard files it writes (it never seeks), so the running CRC is
    the file's CRC; `record_for` still compares the size with the file on disk.
    """

    def __init__(self, raw: IO[bytes], *, sha256: bool = False, tee: StreamedFile | None = None) -> None:
        self._raw = raw
        self._tee = tee
        self.checksum = RunningChecksum(sha256=sha256)
        self._writeback_from = 0

    @property
    def size(self) -> int:
        return self.checksum.size

    def record(self, name: str) -> FileRecord:
        return self.checksum.record(name)

    def write(self, data: Any) -> int:
        written = self._raw.write(data)
        self.checksum.update(data, written)
        if self.size - self._writeback_from >= _WRITEBACK_STEP:
            start_writeback(self._raw.fileno(), self._writeback_from, self.size - self._writeback_from)
            self._writeback_from = self.size
        if self._tee is not None and self.size >= self._tee.next_boundary:
            self._raw.flush()  # the upload threads read the part back from the file
            self._tee.written(self.size)
        return written

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        self._raw.close()


_sync_file_range = libc_function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; do not wait


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing a range to disk now (a hint: the closing fsync still
    makes it durable). Without it nothing reaches the disk before that fsync, because the
    page cache holds gigabytes of dirty data before background writeback begins. Bytes
    still in Python's write buffer are simply not covered yet; failures (a file system
    without support) are ignored. ctypes releases the GIL for the call."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


_zip_crc32_lock = threading.Lock()
_zip_crc32_users = 0  # where the switch is one for the process: the saves and threads inside
_zip_crc32_before = True
_zip_crc32_scope: str | None = None  # "thread", "process" or "unknown"; learnt at the first save
_zip_crc32_local = threading.local()


def _switch_scope() -> str:
    """Whether torch keeps the zip CRC32 switch per thread ("thread": torch 2.13, whose serialization
    config holds each context's own overrides) or one for the process ("process": older releases);
    "unknown" when the probe could not tell. Learnt by flipping it on a thread of our own and looking
    from this one meanwhile; that thread then puts it back."""
    seen = torch.serialization.get_crc32_options()
    flipped, looked = threading.Event(), threading.Event()

    def flip() -> None:
        try:
            torch.serialization.set_crc32_options(not seen)
            flipped.set()
            looked.wait(5.0)
        finally:
            torch.serialization.set_crc32_options(seen)

    thread = threading.Thread(target=flip, name="spotguard-probe", daemon=True)
    try:
        thread.start()
    except RuntimeError:  # no thread to be had
        return "unknown"
    scope = "unknown"
    if flipped.wait(5.0):
        scope = "thread" if torch.serialization.get_crc32_options() == seen else "process"
    looked.set()
    thread.join(5.0)
    return scope


@contextlib.contextmanager
def without_zip_crc32() -> Iterator[None]:
    """Let torch.save skip the CRC32 of each zip record while our saves run, on the calling thread.

    DCP writes every tensor with torch.save, and that zip CRC32 is over half of torch.save's time.
    Every thread that writes a file enters this (`ChecksummingFileSystem.create_stream`). Where torch
    keeps the switch per thread, each thread turns off its own and puts its own back; where it is one
    for the process, it is counted: saves and their writing threads overlap, and the user's setting
    comes back when the last one ends. Where the probe could not tell, the switch is left alone.
    """
    global _zip_crc32_users, _zip_crc32_before, _zip_crc32_scope
    if not hasattr(torch.serialization, "set_crc32_options"):  # torch < 2.5: nothing to switch
        yield
        return
    with _zip_crc32_lock:
        if _zip_crc32_scope is None:
            _zip_crc32_scope = _switch_scope()
        if _zip_crc32_scope == "thread":
            depth = getattr(_zip_crc32_local, "depth", 0)
            if depth == 0:
                _zip_crc32_local.before = torch.serialization.get_crc32_options()
                torch.serialization.set_crc32_options(False)
            _zip_crc32_local.depth = depth + 1
        elif _zip_crc32_scope == "process":
            if _zip_crc32_users == 0:
                _zip_crc32_before = torch.serialization.get_crc32_options()
                torch.serialization.set_crc32_options(False)
            _zip_crc32_users += 1
    try:
        yield
    finally:
        with _zip_crc32_lock:
            if _zip_crc32_scope == "thread":
                _zip_crc32_local.depth -= 1
                if _zip_crc32_local.depth == 0:
                    torch.serialization.set_crc32_options(_zip_crc32_local.before)
            elif _zip_crc32_scope == "process":
                _zip_crc32_users -= 1
                if _zip_crc32_users == 0:
                    torch.serialization.set_crc32_options(_zip_crc32_before)
