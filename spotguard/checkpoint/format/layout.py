"""Names inside a checkpoint location: committed step directories, staging siblings, the manifest."""

from __future__ import annotations

import re
import secrets

from cloud_adapters.storage import temp_target

MANIFEST_NAME = "spotguard.json"
DCP_METADATA_NAME = ".metadata"
METADATA_INDEX_NAME = ".metadata.index"  # the same metadata without pickle (metadata_index.py)

_STEP_RE = re.compile(r"^step-(\d{10,})$")
# Staging (`tmp`), download (`dl`) and set-aside (`stale`) siblings of a step directory.
_LEFTOVER_RE = re.compile(r"^\.(step-\d{10,})\.(tmp|dl|stale)-[0-9a-f]+$")
# What a step directory holds: DCP's shards and metadata, its index, and the manifest.
_NAMES = "|".join(re.escape(name) for name in (DCP_METADATA_NAME, METADATA_INDEX_NAME, MANIFEST_NAME))
_FILE_RE = re.compile(rf"^(__\d+_\d+\.distcp|{_NAMES})$")


def step_dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return f"step-{step:010d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a name `step_dir_name` gives, None for anything else (`step-00000000009`, with
    one zero too many, is not spotguard's)."""
    match = _STEP_RE.match(name)
    if match is None or step_dir_name(step := int(match.group(1))) != name:
        return None
    return step


def sibling_name(step: int, kind: str) -> str:
    """A fresh hidden sibling for staging (`tmp`), downloading (`dl`) or setting aside (`stale`)."""
    return f".{step_dir_name(step)}.{kind}-{secrets.token_hex(4)}"


def parse_leftover(name: str) -> int | None:
    """The step of a staging/download/set-aside sibling, None for anything else."""
    match = _LEFTOVER_RE.match(name)
    return parse_step_dir(match.group(1)) if match else None


def is_step_file(name: str) -> bool:
    """A name spotguard writes into a step directory (a shard, DCP's metadata or its index, the manifest, or a
    temporary of one of them): a directory holding anything else is not only ours."""
    return _FILE_RE.match(temp_target(name) or name) is not None


def manifest_key(step: int) -> str:
    return f"{step_dir_name(step)}/{MANIFEST_NAME}"


def shard_prefix(rank: int) -> str:
    """DCP names the files rank `rank` writes `__<rank>_<i>.distcp`."""
    return f"__{rank}_"
