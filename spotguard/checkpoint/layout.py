"""Names inside a checkpoint location: committed step directories, staging siblings, the manifest."""

from __future__ import annotations

import re
import secrets

MANIFEST_NAME = "spotguard.json"
DCP_METADATA_NAME = ".metadata"

_STEP_RE = re.compile(r"^step-(\d{10,})$")
# Staging (`tmp`), download (`dl`) and set-aside (`stale`) siblings of a step directory.
_LEFTOVER_RE = re.compile(r"^\.step-(\d{10,})\.(tmp|dl|stale)-[0-9a-f]+$")


def step_dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return f"step-{step:010d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a `step-NNNNNNNNNN` name, None for anything else."""
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def sibling_name(step: int, kind: str) -> str:
    """A fresh hidden sibling for staging (`tmp`), downloading (`dl`) or setting aside (`stale`)."""
    return f".{step_dir_name(step)}.{kind}-{secrets.token_hex(4)}"


def parse_leftover(name: str) -> int | None:
    """The step of a staging/download/set-aside sibling, None for anything else."""
    match = _LEFTOVER_RE.match(name)
    return int(match.group(1)) if match else None


def manifest_key(step: int) -> str:
    return f"{step_dir_name(step)}/{MANIFEST_NAME}"


def shard_prefix(rank: int) -> str:
    """DCP names the files rank `rank` writes `__<rank>_<i>.distcp`."""
    return f"__{rank}_"
