"""GCP interruption notices from the GCE metadata server.

Two sources, one per kind of notice, each a hanging GET on one metadata key so that
a change arrives the moment it happens rather than at the next poll:

- `instance/preempted` turns `TRUE` when a Spot/preemptible VM is being taken back
  (about 30 s before it stops);
- `instance/maintenance-event` announces host maintenance: `TERMINATE_ON_HOST_MAINTENANCE`
  (GPU VMs cannot live-migrate; the window start comes from `instance/upcoming-maintenance`,
  else about an hour) or `MIGRATE_ON_HOST_MAINTENANCE` (an advisory: the VM lives on).
"""

from __future__ import annotations

import json
import logging
import time
from datetime import datetime
from typing import Any

from cloud_adapters.endpoints import MetadataResponse, MetadataSession, resolve_metadata_url
from cloud_adapters.notice import (
    INTERRUPTION,
    MAINTENANCE,
    Notice,
    NoticeSource,
    NoticeSourceError,
    deadline_after,
    isoformat_z,
    parse_iso8601,
    utc_now,
)

log = logging.getLogger(__name__)

DEFAULT_URL = "http://metadata.google.internal"
HOST_ENV = "GCE_METADATA_HOST"
METADATA_PATH = "/computeMetadata/v1/"
FLAVOR_HEADERS = {"Metadata-Flavor": "Google"}

PREEMPTED_KEY = "instance/preempted"
MAINTENANCE_KEY = "instance/maintenance-event"
UPCOMING_KEY = "instance/upcoming-maintenance"

PREEMPTION_NOTICE_S = 30.0  # GCP stops a preempted VM about 30 s after the notice
TERMINATE_NOTICE_S = 3600.0  # GPU VMs hear of terminating maintenance about an hour ahead

DEFAULT_HANG_S = 60  # timeout_sec of the hanging GET
DEFAULT_REQUEST_TIMEOUT_S = 5.0  # connect/read timeout, added to the hang for hanging GETs
NO_ETAG_INTERVAL_S = 1.0  # without an ETag to hang on, a plain GET this often (the watcher's interval)
RETRY_503 = 3  # the server answers 503 for a moment during live migration
RETRY_503_SLEEP_S = 0.25


def notice_sources(metadata_url: str | None = None) -> list[NoticeSource]:
    """The GCP sources: preemption and host maintenance, both hanging GETs."""
    base_url = resolve_metadata_url(metadata_url, HOST_ENV, DEFAULT_URL)
    return [PreemptionSource(base_url), MaintenanceSource(base_url)]


def probe(metadata_url: str | None = None, timeout_s: float = 0.3) -> bool:
    """True when a GCE metadata server answers `instance/id` and says `Metadata-Flavor: Google`."""
    base_url = resolve_metadata_url(metadata_url, HOST_ENV, DEFAULT_URL)
    with MetadataSession(FLAVOR_HEADERS) as session:
        try:
            answer = session.get(base_url + METADATA_PATH + "instance/id", timeout=timeout_s)
        except NoticeSourceError:
            return False
    return answer.status_code == 200 and answer.headers.get("Metadata-Flavor") == "Google"


def _require_ok(answer: MetadataResponse, path: str) -> MetadataResponse:
    if answer.status_code != 200:
        raise NoticeSourceError(
            f"GCE metadata {path} answered HTTP {answer.status_code}: {answer.text.strip()[:200]!r}"
        )
    return answer


class _MetadataKeySource:
    """Follows one metadata key with the hanging GET and turns its value into a notice.

    The first poll reads the value at once; each later poll waits on the server until
    the value differs from the last ETag seen, or `hang_timeout_s` passes. An answer
    without an ETag (something in between stripped it) makes the next poll a plain GET
    one interval later: a hang without `last_etag` waits for a change from the moment it
    starts, so it would sit out a change made since the last answer.
    A notice keeps the time it was first seen, so its key and deadline stay the same
    on every poll until the value goes back to normal.
    """

    key_path = ""
    normal_value = ""
    blocking = True

    def __init__(
        self,
        base_url: str,
        hang_timeout_s: int = DEFAULT_HANG_S,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    ) -> None:
        if int(hang_timeout_s) < 1:
            raise ValueError(f"hang_timeout_s must be at least 1 second, got {hang_timeout_s!r}")
        self.base_url = base_url
        self.name = f"gcp:{self.key_path}"
        self.hang_timeout_s = int(hang_timeout_s)
        self.request_timeout_s = request_timeout_s
        self._session = MetadataSession(FLAVOR_HEADERS)
        self._polled = False
        self._etag: str | None = None
        self._since: tuple[str, datetime] | None = None  # (value, first seen) of the current notice

    def poll(self) -> Notice | None:
        params: dict[str, Any] = {}
        read_timeout = self.request_timeout_s
        if self._polled and self._etag:
            params = {"wait_for_change": "true", "last_etag": self._etag, "timeout_sec": self.hang_timeout_s}
            read_timeout += self.hang_timeout_s
        elif self._polled:
            time.sleep(NO_ETAG_INTERVAL_S)  # a blocking source paces itself
        answer = _require_ok(self._get(self.key_path, params, read_timeout), self.key_path)
        self._polled = True
        self._etag = answer.headers.get("ETag")
        value = answer.text.strip()
        if value == self.normal_value:
            self._since = None
            return None
        first_seen = self._since[1] if self._since and self._since[0] == value else utc_now()
        notice = self.interpret(value, first_seen)
        self._since = (value, first_seen)
        return notice

    def interpret(self, value: str, detected_at: datetime) -> Notice:
        """The notice for a value other than `normal_value`; NoticeSourceError for an unknown one."""
        raise NotImplementedError

    def close(self) -> None:
        self._session.close()

    def _get(self, path: str, params: dict[str, Any], read_timeout: float) -> MetadataResponse:
        """GET a metadata key, retrying the brief 503s of a live migration; NoticeSourceError without an answer."""
        url = self.base_url + METADATA_PATH + path
        for attempt in range(RETRY_503 + 1):
            answer = self._session.get(url, params=params, timeout=(self.request_timeout_s, read_timeout))
            if answer.status_code != 503 or attempt == RETRY_503:
                break
            log.debug("GCE metadata %s answered 503 (attempt %d); retrying", path, attempt + 1)
            time.sleep(RETRY_503_SLEEP_S)
        return answer

    def _notice(
        self, kind: str, action: str, deadline: datetime | None, detected_at: datetime, **detail: Any
    ) -> Notice:
        return Notice(
            cloud="gcp",
            kind=kind,
            action=action,
            deadline=deadline,
            detected_at=detected_at,
            source=self.name,
            key=f"{self.name}:{detail['value']}:{isoformat_z(detected_at)}",
            detail=detail,
        )


class PreemptionSource(_MetadataKeySource):
    """`instance/preempted`: TRUE once the VM is being preempted (stops about 30 s later)."""

    key_path = PREEMPTED_KEY
    normal_value = "FALSE"

    def interpret(self, value: str, detected_at: datetime) -> Notice:
        if value != "TRUE":
            raise NoticeSourceError(f"GCE metadata {self.key_path} answered {value[:100]!r}, expected TRUE or FALSE")
        return self._notice(
            INTERRUPTION, "preempt", deadline_after(PREEMPTION_NOTICE_S, detected_at), detected_at, value=value
        )


class MaintenanceSource(_MetadataKeySource):
    """`instance/maintenance-event`: terminating maintenance interrupts; live migration is an advisory."""

    key_path = MAINTENANCE_KEY
    normal_value = "NONE"
    actions = {
        "TERMINATE_ON_HOST_MAINTENANCE": (INTERRUPTION, "terminate-on-host-maintenance"),
        "MIGRATE_ON_HOST_MAINTENANCE": (MAINTENANCE, "migrate-on-host-maintenance"),
    }

    def interpret(self, value: str, detected_at: datetime) -> Notice:
        if value not in self.actions:
            raise NoticeSourceError(
                f"GCE metadata {self.key_path} answered {value[:100]!r}, expected NONE or one of {sorted(self.actions)}"
            )
        kind, action = self.actions[value]
        window = self._upcoming_window()
        if window and window.get("window_start_time"):
            deadline: datetime | None = parse_iso8601(window["window_start_time"])
        elif kind == INTERRUPTION:
            deadline = deadline_after(TERMINATE_NOTICE_S, detected_at)
        else:
            deadline = None
        return self._notice(kind, action, deadline, detected_at, value=value, upcoming_maintenance=window)

    def _upcoming_window(self) -> dict[str, Any] | None:
        """The `instance/upcoming-maintenance` document, or None when absent or unusable.

        A window only refines the deadline, so a failure to read it must not hold back the notice.
        """
        try:
            answer = self._get(UPCOMING_KEY, {}, self.request_timeout_s)
            if answer.status_code == 404:  # no maintenance scheduled
                return None
            window = json.loads(_require_ok(answer, UPCOMING_KEY).text)
            if not isinstance(window, dict):
                raise ValueError("not a JSON object")
            if window.get("window_start_time"):
                parse_iso8601(window["window_start_time"])
            return window
        except (NoticeSourceError, ValueError) as exc:
            log.warning("GCE metadata %s unusable (%s); using the default deadline", UPCOMING_KEY, exc)
            return None
