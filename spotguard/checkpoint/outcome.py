"""What a save reports, and the record of a commit that crosses the saving group's ranks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import datetime
from typing import Any

# Called on rank 0 as a save goes: ("committed" | "upload-plan" | "durable" | "not-durable", details).
SaveEvents = Callable[..., Any]
# Called on every rank when a save ends, background ones too: (step, reason, report or None, error or None).
SaveOutcomes = Callable[[int, str, "SaveReport | None", "str | None"], Any]


@dataclasses.dataclass(frozen=True)
class SaveReport:
    step: int
    reason: str
    bytes: int
    files: int
    write_s: float  # DCP write + checksums (slowest phase end on rank 0's clock)
    commit_s: float  # gather, manifest, rename
    upload_s: float  # local commit -> durable; 0.0 without an object store
    location: str  # where the committed step is: the durable copy when there is one
    durable: bool  # committed in checkpoint_dir, not only in local_dir
    margin_s: float | None  # seconds left before the deadline when the step became durable
    started_at: datetime
    committed_at: datetime
    durable_at: datetime | None
    local_location: str | None = None  # the committed local copy, when staging in local_dir
    error: str | None = None  # why it is not durable
    stall_s: float = 0.0  # how long save() held its caller (the training thread): the whole save when waited for
    streamed_bytes: int = 0  # of this rank's files, sent to the object store while they were written


@dataclasses.dataclass(frozen=True)
class LocalCommit:
    """The saving group's rank 0 to every rank of the group (broadcast): the step committed at
    `path` (`created`: now; else an earlier copy was kept), or why nothing was committed."""

    error: str | None = None
    path: str = ""
    created: bool = False
    bytes: int = 0
    files: int = 0
