"""Azure interruption notices: Scheduled Events from the Instance Metadata Service (IMDS).

`GET /metadata/scheduledevents` lists the platform's upcoming events for every VM
of the deployment; only those whose `Resources` name this VM concern us. `Preempt`
(Spot eviction) and `Terminate` take the VM away; `Freeze`, `Reboot` and
`Redeploy` are maintenance. Acknowledging an event (`ack`) lets the platform go
ahead before `NotBefore` once our checkpoint is safe.

This VM's name comes from `compute/name`, is checked (1-64 letters, digits, `-`, `_`,
`.`), and is read again every 5 minutes and at every poll while it is unknown. While
it is unknown (IMDS failed or answered something that is no VM name), a `Preempt`
naming any VM (any entry of its `Resources`) counts as ours: a needless emergency
save costs far less than a missed eviction. Other events need the name.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from datetime import datetime
from typing import Any

from cloud_adapters.endpoints import MetadataResponse, MetadataSession, normalise_base_url, resolve_metadata_url
from cloud_adapters.notice import (
    INTERRUPTION,
    MAINTENANCE,
    Notice,
    NoticeSource,
    NoticeSourceError,
    deadline_after,
    parse_rfc1123,
    utc_now,
)

log = logging.getLogger(__name__)

DEFAULT_METADATA_URL = "http://169.254.169.254"
SCHEDULED_EVENTS_PATH = "/metadata/scheduledevents"
SCHEDULED_EVENTS_API_VERSION = "2020-07-01"
INSTANCE_PATH = "/metadata/instance"
INSTANCE_API_VERSION = "2021-02-01"
METADATA_HEADERS = {"Metadata": "true"}
_EVENTS_QUERY = {"api-version": SCHEDULED_EVENTS_API_VERSION}

POLL_TIMEOUT_S = 2.0
# Scheduled Events is switched on by the first request, which can take up to two minutes to answer.
PRIME_TIMEOUT_S = 120.0
# A Preempt/Terminate without NotBefore has already started; Azure guarantees at least 30 s for Preempt.
UNTIMED_INTERRUPTION_S = 30.0
# IMDS allows 5 requests/s per VM; spacing our own requests a little wider never trips its 429.
MIN_REQUEST_INTERVAL_S = 0.25

INTERRUPTING_EVENTS = ("Preempt", "Terminate")
VM_NAME_REFRESH_S = 300.0  # read the name again this often (and at every poll while it is unknown)
# Azure VM names: 1-64 letters, digits, '-', '_', '.'; scale-set instances read like vmss_3.
_VM_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def _error_for(response: MetadataResponse, what: str) -> NoticeSourceError:
    """A one-line error for an answer that is not a success."""
    if response.status_code == 429:
        retry_after = response.headers.get("Retry-After")
        hint = f"; Retry-After {retry_after} s" if retry_after else ""
        return NoticeSourceError(f"rate limited by Azure IMDS on {what} (HTTP 429, at most 5 requests/s){hint}")
    body = response.text.strip().replace("\n", " ")[:200]
    return NoticeSourceError(f"Azure IMDS answered HTTP {response.status_code} on {what}: {body}")


class ScheduledEventsSource:
    """Polls Scheduled Events and reports the most severe event that names this VM."""

    blocking = False

    def __init__(
        self,
        base_url: str,
        vm_name: str | None = None,
        *,
        timeout_s: float = POLL_TIMEOUT_S,
        prime_timeout_s: float = PRIME_TIMEOUT_S,
    ) -> None:
        self.base_url = normalise_base_url(base_url)
        self.name = f"azure:scheduledevents@{self.base_url}"
        self.timeout_s = timeout_s
        self.prime_timeout_s = prime_timeout_s
        self._vm_name = vm_name  # None while unknown
        self._name_given = vm_name is not None  # a given name is never read from IMDS
        self._name_due = 0.0  # time.monotonic() at which the name is read again
        self._name_error: str | None = None  # the last failure to read it, logged once
        self._session = MetadataSession(METADATA_HEADERS)
        self._events_url = f"{self.base_url}{SCHEDULED_EVENTS_PATH}"
        self._lock = threading.Lock()  # one request at a time, spaced for the rate limit
        self._last_request = 0.0
        # EventId -> (first seen, last known deadline): notices stay stable from poll to poll.
        self._seen: dict[str, tuple[datetime, datetime | None]] = {}

    # ---- NoticeSource ------------------------------------------------------------
    def poll(self) -> Notice | None:
        return self._check(self.timeout_s)

    def prime(self, timeout_s: float | None = None) -> Notice | None:
        """The first call after boot, with a timeout long enough for IMDS to switch Scheduled Events on."""
        return self._check(self.prime_timeout_s if timeout_s is None else timeout_s)

    def ack(self, notice: Notice) -> None:
        """Tell the platform it may start the event now (POST StartRequests)."""
        event_id = (notice.detail.get("event") or {}).get("EventId")
        if notice.cloud != "azure" or not event_id:
            raise ValueError(f"not an Azure scheduled event notice: {notice.key!r}")
        body = {"StartRequests": [{"EventId": event_id}]}
        try:
            response = self._request("POST", self._events_url, self.timeout_s, params=_EVENTS_QUERY, json_body=body)
        except NoticeSourceError as exc:
            raise NoticeSourceError(f"could not acknowledge Azure event {event_id}: {exc}") from exc
        if not response.ok:
            raise _error_for(response, f"acknowledging event {event_id}")
        log.info("acknowledged Azure scheduled event %s (%s)", event_id, notice.action)

    def close(self) -> None:
        self._session.close()

    # ---- internals -----------------------------------------------------------------
    @property
    def vm_name(self) -> str | None:
        """This VM's name (given, or as last read from instance metadata); None while unknown."""
        return self._vm_name

    def _refresh_vm_name(self) -> None:
        """Read the name when it is unknown or due; a failure keeps the last good one (or None)."""
        if self._name_given or (self._vm_name is not None and time.monotonic() < self._name_due):
            return
        try:
            name = self._read_vm_name()
        except NoticeSourceError as exc:
            if str(exc) != self._name_error:
                consequence = f"keeping {self._vm_name}" if self._vm_name else "until known, any VM's Preempt is ours"
                log.warning("could not read the Azure VM name (%s); %s", exc, consequence)
            self._name_error = str(exc)
            return
        self._name_error = None
        self._name_due = time.monotonic() + VM_NAME_REFRESH_S
        if name != self._vm_name:
            log.info("Azure VM name is %s", name)
            self._vm_name = name

    def _read_vm_name(self) -> str:
        url = f"{self.base_url}{INSTANCE_PATH}/compute/name"
        params = {"api-version": INSTANCE_API_VERSION, "format": "text"}
        response = self._request("GET", url, self.timeout_s, params=params)
        if not response.ok:
            raise _error_for(response, "compute/name")
        name = response.text.strip()
        if not _VM_NAME.fullmatch(name):
            raise NoticeSourceError(f"Azure IMDS answered compute/name with no VM name: {name[:100]!r}")
        return name

    def _request(self, method: str, url: str, timeout_s: float, **kwargs: Any) -> MetadataResponse:
        """One request, spaced for the rate limit; NoticeSourceError when no answer comes."""
        with self._lock:
            wait = self._last_request + MIN_REQUEST_INTERVAL_S - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                return self._session.request(method, url, timeout=timeout_s, **kwargs)
            finally:
                self._last_request = time.monotonic()

    def _check(self, timeout_s: float) -> Notice | None:
        self._refresh_vm_name()
        vm_name = self._vm_name
        response = self._request("GET", self._events_url, timeout_s, params=_EVENTS_QUERY)
        if not response.ok:
            raise _error_for(response, "scheduledevents")
        try:
            document = response.json()
        except ValueError as exc:
            raise NoticeSourceError(f"malformed Scheduled Events document (not JSON): {response.text[:100]!r}") from exc
        return self._notice_from(document, vm_name)

    def _notice_from(self, document: Any, vm_name: str | None) -> Notice | None:
        if not isinstance(document, dict) or not isinstance(document.get("Events"), list):
            raise NoticeSourceError(f"malformed Scheduled Events document: {json.dumps(document)[:100]}")
        incarnation = document.get("DocumentIncarnation")
        ours = [event for event in document["Events"] if _names_vm(event, vm_name)]
        now = utc_now()
        notices = [self._notice_for(event, incarnation, vm_name, now) for event in ours]
        self._seen = {n.detail["event"]["EventId"]: (n.detected_at, n.deadline) for n in notices}
        if not notices:
            return None
        return min(notices, key=_severity)

    def _notice_for(self, event: dict[str, Any], incarnation: Any, vm_name: str | None, now: datetime) -> Notice:
        event_id, event_type = event.get("EventId"), event.get("EventType")
        if not isinstance(event_id, str) or not event_id or not isinstance(event_type, str):
            raise NoticeSourceError(f"malformed Scheduled Event (no EventId/EventType): {json.dumps(event)[:200]}")
        if event_id not in self._seen:
            log.info(
                "Azure scheduled event %s: %s %s for %s, NotBefore %r",
                event_id,
                event.get("EventStatus"),
                event_type,
                vm_name or "this VM (name unknown: any VM's Preempt counts)",
                event.get("NotBefore"),
            )
        first_seen, known_deadline = self._seen.get(event_id, (now, None))
        interrupting = event_type in INTERRUPTING_EVENTS
        not_before = event.get("NotBefore") or ""
        if not_before:
            deadline: datetime | None = parse_rfc1123(not_before)
        elif known_deadline is not None:
            deadline = known_deadline  # NotBefore is blanked once the event starts: keep what we knew
        else:
            # Untimed from the start: count from when we first saw it, so every poll agrees.
            deadline = deadline_after(UNTIMED_INTERRUPTION_S, first_seen) if interrupting else None
        return Notice(
            cloud="azure",
            kind=INTERRUPTION if interrupting else MAINTENANCE,
            action=event_type.lower(),
            deadline=deadline,
            detected_at=first_seen,
            source=f"azure:scheduledevents/{event_type}",
            key=f"azure:{event_id}",
            detail={"document_incarnation": incarnation, "vm_name": vm_name, "event": event},
        )


def _names_vm(event: Any, vm_name: str | None) -> bool:
    resources = event.get("Resources") if isinstance(event, dict) else None
    if not isinstance(resources, list):
        raise NoticeSourceError(f"malformed Scheduled Event (Resources is not a list): {json.dumps(event)[:200]}")
    if vm_name is None:  # our name is unknown: a Preempt of any VM is taken as ours
        return event.get("EventType") == "Preempt" and bool(resources)
    # Azure resource names are case-insensitive.
    return vm_name.casefold() in (str(name).casefold() for name in resources)


def _severity(notice: Notice) -> tuple[bool, bool, datetime]:
    """Sort key: interruptions first, then the earliest deadline; untimed ones last."""
    return (not notice.is_interruption, notice.deadline is None, notice.deadline or notice.detected_at)


def notice_sources(metadata_url: str | None = None) -> list[NoticeSource]:
    """Azure's one source of notices: Scheduled Events."""
    return [ScheduledEventsSource(resolve_metadata_url(metadata_url, None, DEFAULT_METADATA_URL))]


def probe(metadata_url: str | None = None, timeout_s: float = 0.3) -> bool:
    """True when an Azure IMDS answers instance metadata at the resolved endpoint."""
    base_url = resolve_metadata_url(metadata_url, None, DEFAULT_METADATA_URL)
    with MetadataSession(METADATA_HEADERS) as session:
        try:
            response = session.get(
                f"{base_url}{INSTANCE_PATH}", params={"api-version": INSTANCE_API_VERSION}, timeout=timeout_s
            )
            return response.status_code == 200 and isinstance(response.json(), dict)
        except (NoticeSourceError, ValueError):
            return False
