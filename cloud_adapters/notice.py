"""What an interruption notice is, and the protocol every source of notices follows.

A `Notice` is cloud-neutral: the cloud-specific clients translate their answers
into it, and everything downstream (watcher, broadcast, checkpoint) reads only this.
"""

from __future__ import annotations

import dataclasses
import email.utils
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol, runtime_checkable

INTERRUPTION = "interruption"  # the VM is going away: save now
REBALANCE = "rebalance"  # advisory: elevated risk of interruption (AWS)
MAINTENANCE = "maintenance"  # advisory: scheduled maintenance that may not stop us
KINDS = (INTERRUPTION, REBALANCE, MAINTENANCE)


class NoticeSourceError(Exception):
    """A source got an answer it cannot use (bad status, malformed body, bad time).

    The message says what was wrong; the watcher logs it once and retries.
    """


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def isoformat_z(when: datetime) -> str:
    """ISO-8601 in UTC with a `Z` suffix and millisecond precision."""
    return when.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_iso8601(text: str) -> datetime:
    """Parse `2015-01-05T18:02:00Z` (and offsets); naive times are taken as UTC."""
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except (ValueError, AttributeError) as exc:
        raise NoticeSourceError(f"unparseable ISO-8601 time {text!r}") from exc
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def parse_rfc1123(text: str) -> datetime:
    """Parse `Mon, 19 Sep 2016 18:29:47 GMT` (HTTP dates, Azure NotBefore)."""
    try:
        when = email.utils.parsedate_to_datetime(text.strip())
    except (TypeError, ValueError, AttributeError) as exc:
        raise NoticeSourceError(f"unparseable RFC 1123 time {text!r}") from exc
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


@dataclasses.dataclass(frozen=True)
class Notice:
    """One distinct notice from one source.

    `key` identifies the notice for de-duplication: the same event seen on two
    polls has the same key. `deadline` is when the VM is expected to go away
    (None when the cloud gives no time, e.g. advisories without a window).
    """

    cloud: str  # "aws" | "gcp" | "azure" | "signal"
    kind: str  # one of KINDS
    action: str  # what the cloud says it will do: terminate, stop, hibernate, preempt, SIGTERM...
    deadline: datetime | None
    detected_at: datetime
    source: str  # which endpoint or mechanism said so, e.g. "aws:spot/instance-action"
    key: str
    detail: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)
    node: str | None = None  # the node it is about, once a job has said (several nodes may share a host)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"notice kind must be one of {KINDS}, not {self.kind!r}")

    @property
    def is_interruption(self) -> bool:
        return self.kind == INTERRUPTION

    def seconds_left(self, now: datetime | None = None) -> float | None:
        if self.deadline is None:
            return None
        return (self.deadline - (now or utc_now())).total_seconds()

    def describe_deadline(self, now: datetime | None = None) -> str:
        """For people: "in 28.4 s", "due now" once the time the cloud gave has passed, or "unknown"."""
        left = self.seconds_left(now)
        if left is None:
            return "unknown"
        return f"in {left:.1f} s" if left > 0 else f"due now (passed {-left:.1f} s ago)"

    def earlier_than(self, other: Notice, slack_s: float = 0.0) -> bool:
        """Whether this notice's deadline comes earlier than `other`'s by more than `slack_s` (a
        deadline where there was none counts as earlier)."""
        if self.deadline is None:
            return False
        return other.deadline is None or (other.deadline - self.deadline).total_seconds() > slack_s

    def to_json(self) -> dict[str, Any]:
        return {
            "cloud": self.cloud,
            "kind": self.kind,
            "action": self.action,
            "deadline": isoformat_z(self.deadline) if self.deadline else None,
            "detected_at": isoformat_z(self.detected_at),
            "source": self.source,
            "key": self.key,
            "detail": self.detail,
            "node": self.node,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Notice:
        return cls(
            cloud=data["cloud"],
            kind=data["kind"],
            action=data["action"],
            deadline=parse_iso8601(data["deadline"]) if data.get("deadline") else None,
            detected_at=parse_iso8601(data["detected_at"]),
            source=data["source"],
            key=data["key"],
            detail=data.get("detail") or {},
            node=data.get("node"),
        )


def deadline_after(seconds: float, now: datetime | None = None) -> datetime:
    return (now or utc_now()) + timedelta(seconds=seconds)


@runtime_checkable
class NoticeSource(Protocol):
    """One kind of notice from one place (one endpoint, or the signal handlers).

    `poll()` checks once and returns the current notice or None; it raises
    `NoticeSourceError` (or a transport error) when the answer is unusable.
    A `blocking` source waits inside `poll()` for a change (GCP's hanging GET,
    signals), so the watcher calls it back to back instead of on an interval; one
    that can end that wait early has `wake()`, which the watcher calls as it stops.
    A non-blocking source may set `poll_every = N` to be polled every Nth interval
    only (advisories announced long ahead). A source whose notices are all advisories
    sets `advisory = True`: after a failure the watcher may back off longer on it,
    while any other source is polled again within one interval.
    """

    name: str
    blocking: bool

    def poll(self) -> Notice | None: ...

    def close(self) -> None: ...
