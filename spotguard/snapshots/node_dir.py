"""A node's snapshot directory: where its ranks' snapshots and the replicas it keeps for other nodes live.

    <base>/spotguard-<uid>/<run>/step-<step>/shard-<rank>-of-<world size>.snap
    <base>/spotguard-<uid>/<run>/spare/...      files of freed snapshots, written over by the next ones

`base` is host memory that outlives the training processes (a tmpfs such as /dev/shm), so a
restart of the workers finds what the node held. In it each user has a root of their own
(`private_root`): made 0700 and checked (a directory, not a link, owned by this user, writable by
no one else, in a base where no one else can move it away), so another local user can neither
read a job's weights nor plant a file or a link that the job would write through. `run` keys the
job's checkpoint location (`spotguard.job.topology.location_key`), so jobs sharing a node never
see each other's files. A file under its final name is complete (see `shard_file`); what a crash
left behind as `.part` is swept away with old steps.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import stat
import time
from pathlib import Path

DEFAULT_BASE = "/dev/shm"
BASE_ENV = "SPOTGUARD_SNAPSHOT_DIR"
_STEP = re.compile(r"step-(\d{10})")
_SHARD = re.compile(r"shard-(\d{5})-of-(\d{5})\.snap")
NAME = re.compile(r"step-\d{10}/shard-\d{5}-of-\d{5}\.snap")  # what a peer may ask for or send


class UnusableDir(OSError):
    """The snapshot directory cannot be used safely (or at all) on this node."""


def private_root(base: str | os.PathLike[str]) -> Path:
    """This user's snapshot root in `base`, `<base>/spotguard-<uid>`: made 0700 where absent, and
    refused (UnusableDir, or the OSError that made or read it) unless it is a real directory of
    this user's that no one else can write, on a path no one else can change (`_check_path`)."""
    base = Path(os.path.abspath(base))
    for part in (*reversed(base.parents), base):
        if part.exists():
            continue
        try:  # never writable by others, even for a moment: another local rank may check it at once
            os.mkdir(part, 0o755)
        except FileExistsError:  # another local rank (they start together) made it first
            continue
        part.chmod(0o755)  # not a umask's 0700: others reach their own roots through it
    _check_path(base)
    root = base / f"spotguard-{os.geteuid()}"
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    found = os.lstat(root)  # never follows a link: a planted one is refused, not written through
    if not stat.S_ISDIR(found.st_mode):
        raise UnusableDir(f"{root} is not a directory (a link or a file someone else made?)")
    if found.st_uid != os.geteuid():
        raise UnusableDir(f"{root} belongs to uid {found.st_uid}, not to this user ({os.geteuid()})")
    if _open_to_others(found):  # others could have planted links in it: nothing there can be trusted
        raise UnusableDir(f"{root} is writable by other users: delete it, and it is made anew (0700)")
    if found.st_mode & 0o077:  # ours, but readable by others (as an older version left it)
        os.chmod(root, 0o700)
    return root


def _check_path(base: Path) -> None:
    """Every directory and link from / to `base`, as written and as it resolves, is root's or this
    user's, and one that others may write is sticky: no one else can rename or relink what the
    root is reached through (a base another user made first, say, or a link of theirs)."""
    for path in (base, Path(os.path.realpath(base))):
        for part in (*reversed(path.parents), path):
            found = os.lstat(part)
            if found.st_uid not in (0, os.geteuid()):
                raise UnusableDir(f"{part} belongs to uid {found.st_uid}: they could swap the snapshot root")
            if not stat.S_ISLNK(found.st_mode) and _open_to_others(found) and not found.st_mode & stat.S_ISVTX:
                why = "is writable by other users and not sticky: they could swap the snapshot root"
                raise UnusableDir(f"{part} {why}")


def _open_to_others(found: os.stat_result) -> bool:
    return bool(found.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def name_of(step: int, rank: int, world_size: int) -> str:
    return f"step-{step:010d}/shard-{rank:05d}-of-{world_size:05d}.snap"


@dataclasses.dataclass(frozen=True)
class Held:
    """A complete snapshot file this node holds (not yet verified)."""

    step: int
    rank: int
    world_size: int
    path: Path


class NodeDir:
    def __init__(self, root: str | os.PathLike[str], run: str) -> None:
        self.root = Path(root)
        self.path = self.root / run

    def file(self, name: str) -> Path:
        if not NAME.fullmatch(name):
            raise ValueError(f"not a snapshot file name: {name!r}")
        return self.path / name

    def prepare(self, name: str) -> Path:
        """The path for `name`, its step directory made."""
        path = self.file(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def held(self) -> list[Held]:
        """The complete files here, newest step first."""
        found = []
        for step_dir in _entries(self.path):
            step = _STEP.fullmatch(step_dir.name)
            if step is None:
                continue
            for entry in _entries(step_dir.path):
                shard = _SHARD.fullmatch(entry.name)
                if shard is not None:
                    found.append(Held(int(step[1]), int(shard[1]), int(shard[2]), Path(entry.path)))
        return sorted(found, key=lambda h: (-h.step, h.rank))

    def keep_only(self, steps: set[int], spares: int = 0) -> None:
        """Free every step but `steps`: up to `spares` of their files are kept aside for the next
        snapshot to write over (`take_spare`), the rest deleted, with unfinished `.part` files.

        The node's local ranks sweep at the same moments: a file or a step another one removed first
        is not an error.
        """
        spare_dir = self.path / "spare"
        spare_dir.mkdir(parents=True, exist_ok=True)
        kept = len(list(spare_dir.iterdir()))
        for step_dir in _entries(self.path):
            step = _STEP.fullmatch(step_dir.name)
            if step is None or int(step[1]) in steps:
                continue
            for entry in _entries(step_dir.path):
                if kept >= spares:
                    break
                if not entry.name.endswith(".snap"):
                    continue
                try:
                    os.replace(entry.path, spare_dir / f"{os.getpid()}-{time.monotonic_ns()}")
                    kept += 1
                except FileNotFoundError:
                    pass
            shutil.rmtree(step_dir.path, ignore_errors=True)

    def take_spare(self, dest: Path) -> bool:
        """Move a spare file (its pages already the tmpfs's) to `dest`; False when there is none."""
        for spare in sorted((self.path / "spare").glob("*")):
            try:
                os.replace(spare, dest)
                return True
            except FileNotFoundError:  # another rank took it first
                continue
        return False

    def free_bytes(self) -> int:
        """Room for more files: the file system's free space, and for a tmpfs the memory left too."""
        self.path.mkdir(parents=True, exist_ok=True)
        stat = os.statvfs(self.path)
        free = stat.f_bavail * stat.f_frsize
        available = _mem_available()
        return min(free, available) if available is not None and _on_tmpfs(self.path) else free


def _entries(directory: str | os.PathLike[str]) -> list[os.DirEntry[str]]:
    """What `directory` holds; nothing once it is gone (another local rank's sweep removed it while
    this one listed its parent: `Path.glob` raises then, before Python 3.12), or when it is a file."""
    try:
        with os.scandir(directory) as found:
            return list(found)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _on_tmpfs(path: Path) -> bool:
    """Whether `path` lies on a tmpfs (its pages are RAM), from the longest matching mount point."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return False
    real = os.path.realpath(path)
    best = max(
        (m for m in mounts if real == m[0] or real.startswith(m[0].rstrip("/") + "/")),
        key=lambda m: len(m[0]),
        default=None,
    )
    return best is not None and best[1] == "tmpfs"
