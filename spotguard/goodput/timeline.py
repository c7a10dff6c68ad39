"""What happened and when, on this rank: notice, agreed step, save, commit, margin."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from datetime import datetime
from typing import Any

from cloud_adapters.notice import isoformat_z, utc_now

log = logging.getLogger("spotguard.timeline")  # the name its lines had before goodput/ was a package


@dataclasses.dataclass(frozen=True)
class Entry:
    at: datetime
    elapsed_s: float  # since the first entry
    event: str
    detail: dict[str, Any]

    def line(self) -> str:
        extra = "  ".join(f"{k}={v}" for k, v in self.detail.items())
        return f"{isoformat_z(self.at)}  +{self.elapsed_s:7.3f}s  {self.event:<18} {extra}".rstrip()


class Timeline:
    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self._t0: float | None = None
        self._lock = threading.Lock()

    def add(self, event: str, **detail: Any) -> Entry:
        now = time.monotonic()
        with self._lock:
            if self._t0 is None:
                self._t0 = now
            entry = Entry(utc_now(), now - self._t0, event, detail)
            self.entries.append(entry)
        log.info("%s", entry.line())
        return entry

    def format(self) -> str:
        return "\n".join(e.line() for e in self.entries)
