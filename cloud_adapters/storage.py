"""Durable storage for checkpoints: one small protocol and a local filesystem store.

`open_store(url)` is in cloud_adapters/stores.py: it imports the bucket stores, which import this module.

Keys are relative to the store's root (the bucket prefix or directory given in the
URL) and always use `/`. The checkpoint layer only ever talks to this protocol,
so a local path, a shared filesystem and every object store behave the same.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable
from urllib.parse import unquote, urlsplit

# Called with the number of bytes moved since the last call; long transfers report progress through it.
Progress = Callable[[int], None]


class StoreError(Exception):
    """A storage operation failed for good (after the store's own retries)."""


class NotFound(StoreError):
    """The key does not exist."""


class AlreadyExists(StoreError):
    """A create-only write found the key already there."""


class Abandoned(StoreError):
    """A transfer cancelled because its caller gave up on it (at a deadline)."""


class Unreachable(StoreError):
    """The store did not answer, or only with transient errors (network, throttling, 5xx), by the call's deadline.

    Nothing is known about the object: it may be fine and readable once the store is back.
    """


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int


@runtime_checkable
class ObjectStore(Protocol):
    url: str  # the root, e.g. "s3://bucket/run-7" or "/mnt/ckpt/run-7"

    def put_file(self, local_path: str | Path, key: str, *, progress: Progress | None = None) -> None: ...

    def put_bytes(self, key: str, data: bytes, *, create_only: bool = False) -> None: ...

    def get_file(self, key: str, local_path: str | Path, *, progress: Progress | None = None) -> None: ...

    def get_bytes(self, key: str) -> bytes: ...

    def list(self, prefix: str = "") -> list[ObjectInfo]: ...

    def exists(self, key: str) -> bool: ...

    def delete(self, keys: Iterable[str]) -> None: ...


class PartUpload(Protocol):
    """One object written as numbered parts (from 1; S3 and Azure take them in any order and in
    parallel, GCS one after another); readers see nothing until `complete()`, which assembles the
    parts in number order."""

    def put_part(self, number: int, data: bytes) -> None: ...

    def complete(self) -> None: ...

    def abort(self) -> None: ...


@runtime_checkable
class PartsStore(Protocol):
    """A store that can write an object part by part while its bytes are still being produced (S3, Azure, GCS).

    Every part but the last must hold at least `min_part_size` bytes (GCS: a multiple of 256 KiB;
    its `min_part_size`, its upload chunk, is one); an object has at most `max_parts`.
    """

    min_part_size: int
    max_parts: int

    def start_parts(self, key: str) -> PartUpload: ...


def fsync_path(path: str | Path) -> None:
    """Flush a file's data, or a directory's entries (a rename or a new file in it), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_TEMP_RE = re.compile(r"^\.(.+)\.[0-9a-f]{12}\.tmp$")


def temp_target(name: str) -> str | None:
    """The file name a `fill_then_rename` temporary (`.NAME.<hex>.tmp`) stands for; None for any other name."""
    match = _TEMP_RE.match(name)
    return match.group(1) if match else None


def fill_then_rename(
    path: str | Path, fill: Callable[[str], None], *, durable: bool = False, exclusive: bool = False
) -> None:
    """Let `fill(tmp)` write a temporary sibling of `path`, then move it into place.

    A failure never leaves a partial `path`. `durable` fsyncs the file before the
    rename and the directory after it. `exclusive` fails with AlreadyExists instead of
    replacing an existing file (link() is atomic and refuses an existing target, unlike rename()).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(target.parent / f".{target.name}.{secrets.token_hex(6)}.tmp")
    # Created as every other file is (mode 0666 less the umask), not mkstemp's 0600: readers running
    # as another user on shared storage must be able to read a manifest as they read the shards.
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    try:
        fill(tmp)
        if durable:
            fsync_path(tmp)
        if exclusive:
            try:
                os.link(tmp, target)
            except FileExistsError as exc:
                raise AlreadyExists(str(target)) from exc
        else:
            os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    if durable:
        fsync_path(target.parent)


def write_durably(path: Path, data: bytes, *, exclusive: bool = False) -> None:
    """Write `data` to `path` atomically and durably (see fill_then_rename)."""
    fill_then_rename(path, lambda tmp: Path(tmp).write_bytes(data), durable=True, exclusive=exclusive)


class LocalStore:
    """A directory on a local or shared filesystem (NFS, Lustre, FUSE mounts of buckets).

    Its objects are the regular files below the root. Symlinks are never followed, so
    nothing outside the root is listed, read or deleted through the store.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().resolve()
        self.url = str(self.root)

    def path(self, key: str) -> Path:
        """`root/key`; StoreError for a key that leads elsewhere (`..`, an absolute key, through a symlink)."""
        path = self.root / key
        if not path.is_relative_to(self.root) or path.resolve() != path:
            raise StoreError(f"{self.url}: key {key!r} leads outside the store (.., absolute, or a symlink)")
        return path

    def put_file(self, local_path: str | Path, key: str, *, progress: Progress | None = None) -> None:
        fill_then_rename(self.path(key), lambda tmp: _copy_file(local_path, tmp, progress), durable=True)

    def put_bytes(self, key: str, data: bytes, *, create_only: bool = False) -> None:
        write_durably(self.path(key), data, exclusive=create_only)

    def append_bytes(self, key: str, data: bytes) -> None:
        """Append `data` to the file `key` (created if missing) in one O_APPEND write.

        Writers appending whole lines never interleave within a line; a writer killed mid-write
        leaves a torn last line, which readers of such a file must skip.
        """
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def get_file(self, key: str, local_path: str | Path, *, progress: Progress | None = None) -> None:
        try:
            fill_then_rename(local_path, lambda tmp: _copy_file(self.path(key), tmp, progress))
        except FileNotFoundError as exc:
            raise NotFound(f"{self.url}/{key}") from exc

    def get_bytes(self, key: str) -> bytes:
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError as exc:
            raise NotFound(f"{self.url}/{key}") from exc

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        if not self.root.is_dir():
            return []
        found = []
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                full = Path(dirpath) / name
                key = full.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    try:
                        info = full.lstat()
                    except FileNotFoundError:  # removed while we walked
                        continue
                    if stat.S_ISREG(info.st_mode):  # a symlink is no object: it may lead out of the store
                        found.append(ObjectInfo(key, info.st_size))
        return sorted(found, key=lambda o: o.key)

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.path(key).unlink(missing_ok=True)

    def delete_tree(self, prefix: str) -> None:
        """Remove a whole directory at once (cheaper than key by key on a filesystem)."""
        shutil.rmtree(self.path(prefix), ignore_errors=True)


def _copy_file(src: str | Path, dst: str | Path, progress: Progress | None, chunk: int = 8 << 20) -> None:
    """Copy `src` into `dst` (`progress` after each chunk): in the kernel where it can, else by reads and writes."""
    with open(src, "rb") as reader, open(dst, "wb") as writer:
        if _copy_in_kernel(reader.fileno(), writer.fileno(), progress, chunk):
            return
        while block := reader.read(chunk):
            writer.write(block)
            if progress:
                progress(len(block))


# Where copy_file_range cannot copy between these two files at all (another filesystem on an older kernel, no
# such call, a filesystem without it, a container's seccomp filter, CIFS's EIO): nothing is copied yet, and reads
# and writes do it (a real error raises there again).
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM, errno.EBADF, errno.EIO}


def _copy_in_kernel(source: int, target: int, progress: Progress | None, chunk: int) -> bool:
    """Copy the file `source` into `target` with copy_file_range, the bytes never passing through this process
    (a reflink on XFS or btrfs, a server-side copy on NFS 4.2): True once done, False when it cannot begin
    (nothing copied: older kernels also answer 0 bytes, not an error, for filesystems they cannot copy between)."""
    if not hasattr(os, "copy_file_range"):
        return False
    size, copied = os.fstat(source).st_size, 0
    try:
        while count := os.copy_file_range(source, target, chunk):
            copied += count
            if progress:
                progress(count)
    except OSError as exc:
        if copied or exc.errno not in _NO_KERNEL_COPY:
            raise
        return False
    if copied == size:
        return True
    if copied:
        raise OSError(errno.EIO, f"copy_file_range stopped after {copied} of {size} bytes")
    return False


def split_bucket_url(url: str) -> tuple[str, str]:
    """`s3://bucket/a/b` -> ("bucket", "a/b"); raises ValueError for a URL without a bucket."""
    parts = urlsplit(url)
    if not parts.netloc:
        raise ValueError(f"{url!r} names no bucket; expected {parts.scheme}://BUCKET[/PREFIX]")
    return parts.netloc, parts.path.strip("/")


def file_url_path(url: str) -> str:
    """The absolute path of `file:///abs/path` or `file://localhost/abs/path` (RFC 8089).

    Anything else after `file://` is a host or a relative path that would be silently misread.
    """
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
        raise ValueError(
            f"{url!r} is not a local file URL: write file:///ABSOLUTE/PATH (three slashes) or a plain path"
        )
    return unquote(parts.path)
