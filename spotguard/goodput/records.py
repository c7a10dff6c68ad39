"""The goodput ledger's records: one typed record per event, written by the Guard (through
`spotguard.goodput.ledger.Ledger`) and read by `spotguard report`, so that both sides share one schema.

Each line of the ledger is one record as a JSON object: its fields, `event` (the record's kind),
`v` (LEDGER_VERSION when it was written; a line without `v` predates versions and has version 1's
layout) and the stamp the writer adds (`segment`, `seq`, `at`). A reader skips records of a newer
version or of an event it does not know, and ignores fields it does not know, so an older
`spotguard report` still reads what it understands of a newer ledger.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from cloud_adapters.notice import parse_iso8601

LEDGER_VERSION = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Record:
    """What every record has: the writer's stamp (one run segment, its sequence number, the time)."""

    EVENT: ClassVar[str]
    segment: str = ""
    seq: int = 0
    at: str = ""  # ISO 8601, UTC

    def to_json(self) -> dict[str, Any]:
        return {"event": self.EVENT, "v": LEDGER_VERSION, **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Start(Record):
    """A run segment began (a Guard started and made its checkpointer)."""

    EVENT: ClassVar[str] = "start"
    world_size: int
    node: str | None = None
    save_interval_s: float | str | None = None
    save_every: int | None = None
    version: str | None = None  # spotguard's


@dataclasses.dataclass(frozen=True, kw_only=True)
class Resume(Record):
    """`guard.resume()` finished: the step loaded (None: a fresh start) and the time it took."""

    EVENT: ClassVar[str] = "resume"
    step: int | None
    next_step: int
    resume_s: float
    run: str | None = None
    tier: str | None = None  # where the step came from: "durable" (a checkpoint) or "snapshot" (the nodes' memory)
    resharded: list[int] | None = None  # a snapshot taken at another world size: [then, now]
    since_previous_s: float | None = None  # from the previous segment's last record (set by the writer)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Save(Record):
    """A save ended; its measurements when it committed."""

    EVENT: ClassVar[str] = "save"
    step: int
    reason: str | None = None
    ok: bool = True
    error: str | None = None
    bytes: int | None = None
    stall_s: float | None = None  # the training thread's time in the call
    write_s: float | None = None
    commit_s: float | None = None
    upload_s: float | None = None
    streamed_bytes: int | None = None
    durable: bool | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoticeSeen(Record):
    """A notice this job acted on: an interruption (with the agreed step and the save's outcome) or a
    rebalance recommendation."""

    EVENT: ClassVar[str] = "notice"
    kind: str
    cloud: str | None = None
    action: str | None = None
    source: str | None = None
    node: str | None = None
    deadline: str | None = None
    detected_at: str | None = None
    agreed_step: int | None = None
    committed: bool = False
    durable: bool = False
    margin_s: float | None = None  # deadline less the time the save was durable
    leaving: tuple[int, ...] = ()  # the ranks of the nodes reclaimed


@dataclasses.dataclass(frozen=True, kw_only=True)
class Progress(Record):
    """A heartbeat: the last step trained (bounds what a hard kill hides)."""

    EVENT: ClassVar[str] = "progress"
    last_step: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Exit(Record):
    """The segment's last record: why it ended and the exit code spotguard ended it with (None: it
    returned to the caller)."""

    EVENT: ClassVar[str] = "exit"
    code: int | None
    why: str
    committed: bool = False
    last_step: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SilentEnd(Record):
    """The job ended on a failure that came without a notice (spotguard.health): a node lost, a hang."""

    EVENT: ClassVar[str] = "silent-failure"
    cause: str  # "peer-lost" or "hang"
    culprit: str | None = None  # the lost node, or the ranks that held the others up
    noticed_after_s: float | None = None  # the silence or the stall when it was declared
    seen_by: str | None = None
    last_step: int | None = None
    repeated: bool = False  # a hang at the step the previous start hung at (ended with the no-restart code)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recovered(Record):
    """The segment began with an in-process recovery (`spotguard.run`): the survivors of a departure or a
    loss went on in their processes, or nodes joined them, in a new generation of the job, without a restart."""

    EVENT: ClassVar[str] = "recovered"
    cause: str  # "interruption": a node announced its departure; "peer-lost": a node went silent; "join"
    generation: int
    world_before: int
    world_after: int
    step: int | None  # the step the job went on from (the agreed one, or after a loss the one resumed)
    paused_s: float | None = None  # the last step before the recovery -> the first step at the new size
    formed_s: float | None = None  # ... -> the new generation's process group formed
    resumed_s: float | None = None  # ... -> the state loaded: training again (the first step is in `paused_s`)
    # where the state came from: "memory" (the process's own tensors), "snapshot" (the nodes' memory), "durable"
    source: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class CadenceChange(Record):
    """The automatic save interval changed (`save_interval_s="auto"`)."""

    EVENT: ClassVar[str] = "cadence"
    interval_s: float
    save_cost_s: float | None
    rate_per_h: float
    interruptions: int
    hours: float
    bound: str | None
    explain: str
    name: str = "save"  # what the interval is between (ledgers written before it have saves only)


RECORDS: dict[str, type[Record]] = {
    cls.EVENT: cls for cls in (Start, Resume, Save, NoticeSeen, Progress, Exit, CadenceChange, SilentEnd, Recovered)
}
_STAMP = ("segment", "seq", "at")


def parse(entry: Any) -> Record | None:
    """The record of one ledger line's JSON value. None for a record this version does not know (a
    newer version, an unknown event): skipped. ValueError for anything that is no ledger record."""
    if not isinstance(entry, dict) or not {"event", *_STAMP} <= entry.keys():
        raise ValueError("not a ledger record")
    parse_iso8601(entry["at"])
    version = entry.get("v", 1)
    cls = RECORDS.get(entry["event"])
    if cls is None or not isinstance(version, int) or version > LEDGER_VERSION:
        return None
    known = {f.name for f in dataclasses.fields(cls)}
    fields = {k: v for k, v in entry.items() if k in known}
    if "leaving" in fields:
        fields["leaving"] = tuple(fields["leaving"] or ())
    try:
        return cls(**fields)
    except TypeError as exc:  # a required field missing
        raise ValueError(f"not a {cls.EVENT} record: {exc}") from None
