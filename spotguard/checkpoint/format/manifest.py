"""The manifest (`spotguard.json`): what a committed step holds, with a CRC32C for every file.

It is written last; its presence is what makes a step directory exist for resume,
and its checksums are what make anything else in the directory trustworthy. With a
checkpoint key (`auth`), every file also has a SHA-256 and the manifest an HMAC; both are
optional fields, so a manifest with them loads in a version that ignores them, and one
without them here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import platform
import stat
from pathlib import Path
from typing import Any

import google_crc32c

from cloud_adapters.notice import NoticeSourceError, parse_iso8601

FORMAT_VERSION = 1
# emergency: an interruption; periodic: every N steps; interval: every N seconds;
# rebalance: an AWS rebalance recommendation; manual: guard.save().
# "snapshot-resume": the durable save that follows a resume from the nodes' memory
REASONS = ("emergency", "periodic", "interval", "rebalance", "manual", "snapshot-resume")
_CHUNK = 8 << 20


class ManifestError(ValueError):
    """A manifest is missing, unreadable, or not one this version understands."""


@dataclasses.dataclass(frozen=True)
class FileRecord:
    name: str  # relative to the step directory
    size: int
    crc32c: str  # 8 hex digits
    sha256: str | None = None  # 64 hex digits, recorded only when saving with a checkpoint key

    def to_json(self) -> dict[str, Any]:
        out = {"name": self.name, "size": self.size, "crc32c": self.crc32c}
        return out if self.sha256 is None else {**out, "sha256": self.sha256}


@dataclasses.dataclass(frozen=True)
class Manifest:
    step: int
    reason: str
    world_size: int
    created_at: str  # ISO-8601, UTC, `Z`
    files: tuple[FileRecord, ...]
    notice: dict[str, Any] | None = None
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    # The global ranks that wrote the files, in the order of DCP's file ranks (`__<i>_*` is saved_by[i]),
    # and the ranks that were leaving (their nodes reclaimed) when the step was saved.
    saved_by: tuple[int, ...] = ()
    leaving: tuple[int, ...] = ()
    hmac: str | None = None  # HMAC-SHA256 of `unsigned_bytes()` in hex, when saved with a checkpoint key
    run: str | None = None  # the run that committed it (see runs.py); None in manifests from before run ids
    # The job identity of the location (see identity.py), written once the Guard's snapshots have read it;
    # a lost spotguard-job.json is re-adopted from it. None in manifests from before, or without snapshots.
    job: str | None = None
    format_version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, name: str) -> FileRecord | None:
        return next((f for f in self.files if f.name == name), None)

    def to_bytes(self) -> bytes:
        body = {
            "format_version": self.format_version,
            "step": self.step,
            "reason": self.reason,
            "notice": self.notice,
            "world_size": self.world_size,
            "created_at": self.created_at,
            "total_bytes": self.total_bytes,
            "files": [f.to_json() for f in self.files],
            "versions": self.versions,
            "saved_by": list(self.saved_by),
            "leaving": list(self.leaving),
        }
        if self.run is not None:
            body["run"] = self.run
        if self.job is not None:
            body["job"] = self.job
        if self.hmac is not None:
            body["hmac"] = self.hmac
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()

    def unsigned_bytes(self) -> bytes:
        """The canonical body an HMAC covers: everything this version reads, except the HMAC itself."""
        return dataclasses.replace(self, hmac=None).to_bytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        try:
            body = json.loads(data)
            if body["format_version"] != FORMAT_VERSION:
                raise ManifestError(
                    f"manifest format {body['format_version']} is not supported (expected {FORMAT_VERSION})"
                )
            files = tuple(
                FileRecord(_file_name(f["name"]), int(f["size"]), str(f["crc32c"]), _hex_or_none(f.get("sha256")))
                for f in body["files"]
            )
            return cls(
                step=int(body["step"]),
                reason=str(body["reason"]),
                world_size=int(body["world_size"]),
                created_at=_timestamp(body["created_at"]),
                files=files,
                notice=body.get("notice"),
                versions=dict(body.get("versions") or {}),
                saved_by=tuple(int(r) for r in body.get("saved_by") or ()),
                leaving=tuple(int(r) for r in body.get("leaving") or ()),
                hmac=_hex_or_none(body.get("hmac")),
                run=_hex_or_none(body.get("run")),
                job=_identity_or_none(body.get("job")),
            )
        except ManifestError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise ManifestError(f"malformed manifest: {exc}") from exc


def _file_name(name: object) -> str:
    """A manifest file name, which must name a file inside the step directory and nothing else."""
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise ManifestError(f"manifest lists an unsafe file name {name!r}")
    return name


def _hex_or_none(value: object) -> str | None:
    """An optional digest field: absent, or a hex string (anything else is a malformed manifest)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value or any(c not in "0123456789abcdef" for c in value):
        raise ManifestError(f"manifest has a malformed hex value {value!r}")
    return value


def is_identity(value: object) -> bool:
    """Whether `value` can be a job identity (identity.py): up to 64 letters and digits."""
    return isinstance(value, str) and value.isalnum() and len(value) <= 64


def _identity_or_none(value: object) -> str | None:
    if value is not None and not is_identity(value):
        raise ManifestError(f"manifest has a malformed job identity {value!r}")
    return value  # type: ignore[return-value]


def _timestamp(value: object) -> str:
    """The commit time, which must be ISO-8601: retention orders steps by it."""
    try:
        parse_iso8601(str(value))
    except NoticeSourceError:
        raise ManifestError(f"manifest has an unreadable created_at {value!r}") from None
    return str(value)


def crc32c_hex(data: bytes) -> str:
    return f"{google_crc32c.value(data):08x}"


def checksum_file(path: Path, *, sha256: bool = False) -> FileRecord:
    """Size and CRC32C of a file (and its SHA-256 when asked), read in chunks (never whole into memory)."""
    crc = google_crc32c.Checksum()
    sha = hashlib.sha256() if sha256 else None
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc.update(chunk)
            if sha is not None:
                sha.update(chunk)
            size += len(chunk)
    return FileRecord(path.name, size, crc.hexdigest().decode(), sha.hexdigest() if sha else None)


def checksum_bytes(name: str, data: bytes, *, sha256: bool = False) -> FileRecord:
    """The record of a file whose bytes are in memory."""
    return FileRecord(name, len(data), crc32c_hex(data), hashlib.sha256(data).hexdigest() if sha256 else None)


def mismatch(actual: FileRecord, record: FileRecord, *, sha256: bool = False) -> str | None:
    """None when `actual` (what is there) matches `record` (the manifest's), else what differs.

    With `sha256` the manifest must vouch for the file with a SHA-256 too: a CRC32C can be forged.
    """
    if actual.size != record.size:
        return f"{record.name}: size {actual.size} != {record.size} in the manifest"
    if actual.crc32c != record.crc32c:
        return f"{record.name}: crc32c {actual.crc32c} != {record.crc32c} in the manifest"
    if sha256 and record.sha256 is None:
        return f"{record.name}: no SHA-256 in the manifest"
    if sha256 and actual.sha256 != record.sha256:
        return f"{record.name}: sha256 {actual.sha256} != {record.sha256} in the manifest"
    return None


def check_file(path: Path, record: FileRecord, *, sha256: bool = False, contents: bool = True) -> str | None:
    """None when `path` matches the record (its SHA-256 too, with `sha256`), else a one-line description.

    Without `contents` only what needs no read: present, a regular file, of the right size.
    """
    try:
        info = path.lstat()
    except FileNotFoundError:
        return f"{record.name}: missing"
    if not stat.S_ISREG(info.st_mode):  # a symlink could lead anywhere: a step holds its own files only
        return f"{record.name}: not a regular file" + (" (a symlink)" if stat.S_ISLNK(info.st_mode) else "")
    if info.st_size != record.size:  # before reading it all
        return f"{record.name}: size {info.st_size} != {record.size} in the manifest"
    if not contents:
        return None
    return mismatch(checksum_file(path, sha256=sha256 and record.sha256 is not None), record, sha256=sha256)


def versions() -> dict[str, str]:
    import torch

    return {"spotguard": _spotguard_version(), "torch": torch.__version__, "python": platform.python_version()}


def _spotguard_version() -> str:
    try:
        return importlib.metadata.version("spotguard")
    except importlib.metadata.PackageNotFoundError:  # running from a source checkout
        import spotguard

        return getattr(spotguard, "__version__", "unknown")
