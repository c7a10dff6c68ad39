"""AWS notices from the instance metadata service (IMDSv2).

One source per kind of notice, as aws-node-termination-handler has one monitor
per IMDS path; all of them share one `IMDSClient` and so one session token:

    spot/instance-action                  -> interruption (terminate | stop | hibernate), deadline = time
    autoscaling/target-lifecycle-state    -> interruption "asg-terminate" once it reads Terminated
    events/recommendations/rebalance      -> rebalance (advisory, no deadline)
    events/maintenance/scheduled          -> maintenance (advisory), earliest active event

IMDS throttles without a published limit, so `poll()` makes one attempt (plus one
token re-fetch on 401) and raises on anything else; the watcher owns backoff.
A token is kept only if it looks like one, and dropped when a GET with it gets no
answer, so one bad answer to the token PUT never blinds the sources for its TTL.

One event, one notice: the spot instance-action and the rebalance recommendation are
keyed by their path (one of each per instance), so an IMDS that serves a `time` or
`noticeTime` that moves from answer to answer still makes one notice; the watcher takes
a deadline brought forward as an update.

The spot deadline is read on IMDS's clock (the answer's `Date` header, in whole seconds,
so taken as the latest time it can stand for) from the moment the request was sent: a
host clock that is off neither shortens nor drops the notice, and the deadline is never
later than the served `time` (at most about a second early). A `time` already past is
due now. Any answer at spot/instance-action means an interruption (the path is 404 until
one): an answer that cannot be read (not JSON, an unknown action, no usable time) is
logged and taken as an interruption due 2 minutes after it was first seen, less the
clock's slack: a needless save beats a missed interruption.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from datetime import datetime, timedelta
from typing import Any, Callable

from cloud_adapters.endpoints import MetadataResponse, MetadataSession, MetadataTimeout, resolve_metadata_url
from cloud_adapters.notice import (
    INTERRUPTION,
    MAINTENANCE,
    REBALANCE,
    Notice,
    NoticeSource,
    NoticeSourceError,
    isoformat_z,
    parse_iso8601,
    parse_rfc1123,
    utc_now,
)

log = logging.getLogger(__name__)

DEFAULT_URL = "http://169.254.169.254"
ENDPOINT_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"  # the variable boto3 and the AWS CLI read
TOKEN_PATH = "/latest/api/token"
TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
TOKEN_TTL_S = 21600  # the maximum IMDS allows: one PUT every six hours
TOKEN_REFRESH_MARGIN_S = 60.0  # renew this long before expiry so no GET races the expiry
# IMDSv2 tokens are base64 (RFC 7235's token68 alphabet), bounded. Anything else (a proxy's HTML page) is no token.
_TOKEN = re.compile(r"[A-Za-z0-9._~+/=-]{1,512}")
META_PREFIX = "/latest/meta-data/"
DEFAULT_TIMEOUT_S = 2.0  # IMDS is link-local: anything slower is a fault, not load

SPOT_ACTIONS = ("terminate", "stop", "hibernate")
SPOT_NOTICE_S = 120.0  # AWS: the action comes two minutes after the notice
CLOCK_SLACK_S = 2.0  # IMDS's times are in whole seconds
UNREADABLE_NOTICE_S = SPOT_NOTICE_S - CLOCK_SLACK_S  # an answer without a usable time was posted moments ago
DATE_RESOLUTION = timedelta(seconds=1)  # an HTTP Date of 10:00:05 was read at any time up to 10:00:06
# An ASG gives no time in IMDS. Without a lifecycle hook the instance is shut down
# within moments (the signal path then covers the rest); with one, the hook's
# heartbeat decides. Neither is visible here, so budget like a spot interruption.
ASG_TERMINATE_GRACE_S = 120.0
INACTIVE_EVENT_STATES = ("completed", "canceled")
_LIFECYCLE_STATE = re.compile(r"^[A-Za-z]+(:[A-Za-z]+)?$")  # InService, Terminated, Warmed:Running...
_JSON_TYPE_NAMES = {dict: "object", list: "array"}


def _excerpt(body: str, limit: int = 120) -> str:
    return repr(body[:limit] + ("..." if len(body) > limit else ""))


def _fetch_token(session: MetadataSession, base_url: str, timeout_s: float) -> tuple[str, float]:
    """PUT for an IMDSv2 session token; returns the token and its TTL in seconds."""
    url = base_url + TOKEN_PATH
    try:
        resp = session.put(url, headers={TOKEN_TTL_HEADER: str(TOKEN_TTL_S)}, timeout=timeout_s)
    except MetadataTimeout as exc:
        if not exc.connected:
            raise
        # Connected but no answer: the classic sign of a container one hop beyond the PUT response hop limit.
        raise NoticeSourceError(
            f"IMDSv2 token request to {url} got no answer within {timeout_s:g} s "
            "(in a container? the instance's http-put-response-hop-limit must be at least 2)"
        ) from exc
    token = resp.text.strip()
    if resp.status_code != 200 or not token:
        raise NoticeSourceError(f"IMDSv2 token request to {url} answered {resp.status_code}: {_excerpt(resp.text)}")
    if not _TOKEN.fullmatch(token):
        raise NoticeSourceError(
            f"IMDSv2 token request to {url} answered 200 but not an IMDSv2 token: {_excerpt(token)}"
        )
    try:
        ttl = float(resp.headers.get(TOKEN_TTL_HEADER, TOKEN_TTL_S))
    except ValueError:
        ttl = float(TOKEN_TTL_S)
    return token, ttl


class IMDSClient:
    """GETs under /latest/meta-data/ with a cached IMDSv2 token, shared by the AWS sources.

    The lock guards the token only: a slow GET for an advisory never holds up the spot notice.
    """

    def __init__(self, base_url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.base_url = base_url
        self.timeout_s = timeout_s
        self._session = MetadataSession()
        self._lock = threading.Lock()  # one token fetch at a time
        self._token: str | None = None
        self._token_renew_at = 0.0  # time.monotonic() after which the token is renewed

    def get(self, path: str) -> MetadataResponse | None:
        """The answer at `path` (relative to /latest/meta-data/), or None when IMDS answers 404."""
        token = self._current_token()
        resp = self._get(path, token)
        if resp.status_code == 401:
            log.info("IMDS refused the session token (401); fetching a new one")
            resp = self._get(path, self._current_token(refused=token))
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise NoticeSourceError(f"IMDS answered {resp.status_code} for {path}: {_excerpt(resp.text)}")
        return resp

    def close(self) -> None:
        """Release pooled connections (a later GET reconnects)."""
        self._session.close()

    def _get(self, path: str, token: str) -> MetadataResponse:
        url = self.base_url + META_PREFIX + path
        try:
            return self._session.get(url, headers={TOKEN_HEADER: token}, timeout=self.timeout_s)
        except Exception:
            self._drop(token)  # it may be what broke the request: the next poll fetches a new one
            raise

    def _current_token(self, refused: str | None = None) -> str:
        """The token to use: fetched when there is none, it is due for renewal, or it is the `refused` one."""
        with self._lock:
            if self._token is None or self._token == refused or time.monotonic() >= self._token_renew_at:
                self._token, ttl = _fetch_token(self._session, self.base_url, self.timeout_s)
                self._token_renew_at = time.monotonic() + ttl - min(TOKEN_REFRESH_MARGIN_S, ttl / 2)
                log.debug("IMDSv2 token fetched from %s (ttl %g s)", self.base_url, ttl)
            return self._token

    def _drop(self, token: str) -> None:
        """Forget `token`, unless another thread has replaced it already."""
        with self._lock:
            if self._token == token:
                self._token = None


class _IMDSSource:
    """One IMDS path polled for one kind of notice; subclasses turn its body into a Notice."""

    path = ""
    blocking = False
    poll_every = 1  # watcher intervals between polls

    def __init__(self, client: IMDSClient) -> None:
        self.client = client
        self.name = f"aws:{self.path}"

    def poll(self) -> Notice | None:
        answer = self.client.get(self.path)
        return None if answer is None else self.parse(answer.text, utc_now())

    def close(self) -> None:
        self.client.close()

    def parse(self, body: str, now: datetime) -> Notice | None:
        raise NotImplementedError

    def _notice(
        self, kind: str, action: str, deadline: datetime | None, now: datetime, key: str | None, detail: dict[str, Any]
    ) -> Notice:
        """`key`: which event of this path it is; None when the path holds one event per instance."""
        return Notice(
            cloud="aws",
            kind=kind,
            action=action,
            deadline=deadline,
            detected_at=now,
            source=self.name,
            key=self.name if key is None else f"{self.name}:{key}",
            detail=detail,
        )

    def _error(self, what: str, body: str) -> NoticeSourceError:
        return NoticeSourceError(f"{self.name}: {what} in {_excerpt(body)}")

    def _json(self, body: str, expected: type) -> Any:
        try:
            data = json.loads(body)
        except ValueError:
            raise self._error("malformed JSON", body) from None
        if not isinstance(data, expected):
            raise self._error(f"expected a JSON {_JSON_TYPE_NAMES[expected]}", body)
        return data

    def _field(self, data: dict[str, Any], field: str, body: str) -> Any:
        if field not in data:
            raise self._error(f"missing field {field!r}", body)
        return data[field]

    def _time(self, parse: Callable[[str], datetime], text: Any, body: str) -> datetime:
        try:
            return parse(text)
        except NoticeSourceError as exc:
            raise self._error(str(exc), body) from None


class SpotInstanceActionSource(_IMDSSource):
    """The two-minute spot interruption notice: `{"action": ..., "time": ...}`, 404 until then."""

    path = "spot/instance-action"

    def __init__(self, client: IMDSClient) -> None:
        super().__init__(client)
        self._first_seen: datetime | None = None  # while the path answers: one notice, one detection time
        self._deadline: datetime | None = None  # the earliest deadline read so far

    def poll(self) -> Notice | None:
        sent = utc_now()
        answer = self.client.get(self.path)
        if answer is None:
            self._first_seen = self._deadline = None
            return None
        return self.parse(answer.text, utc_now(), answer.date, sent)

    def parse(self, body: str, now: datetime, imds_now: datetime | None = None, sent: datetime | None = None) -> Notice:
        """`imds_now`: IMDS's clock when it answered (its `Date`), else the host's clock is used;
        `sent`: the host's clock when the request went out (default `now`)."""
        first = self._first_seen is None
        self._first_seen = self._first_seen or now
        try:
            action, when, data = self._read(body)
            deadline = self._deadline_of(when, sent or now, imds_now, first)
        except NoticeSourceError as exc:
            if first:
                log.warning("%s; taking it as an interruption due %g s after first sight", exc, UNREADABLE_NOTICE_S)
            action, data = "unknown", {"unreadable": body[:200]}
            deadline = self._first_seen + timedelta(seconds=UNREADABLE_NOTICE_S)
        self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)
        return self._notice(INTERRUPTION, action, self._deadline, self._first_seen, None, data)

    def _read(self, body: str) -> tuple[str, datetime, dict[str, Any]]:
        data = self._json(body, dict)
        action = self._field(data, "action", body)
        if action not in SPOT_ACTIONS:
            raise self._error(f"unknown action {action!r} (expected one of {', '.join(SPOT_ACTIONS)})", body)
        return action, self._time(parse_iso8601, self._field(data, "time", body), body), data

    def _deadline_of(self, when: datetime, sent: datetime, imds_now: datetime | None, first: bool) -> datetime:
        """`when` on the host's clock, never later than the cloud's: read against the latest time
        IMDS's `Date` can stand for, from when the request was sent."""
        if imds_now is None:
            left = (when - sent).total_seconds()
        else:
            skew = (sent - imds_now).total_seconds()
            if first and abs(skew) > CLOCK_SLACK_S:
                log.warning("the host clock is %+.0f s off IMDS's; reading the spot notice time on IMDS's clock", skew)
            left = (when - (imds_now + DATE_RESOLUTION)).total_seconds()
        if left > SPOT_NOTICE_S + CLOCK_SLACK_S:
            if first:
                log.warning(
                    "spot notice time %s is %.0f s away, beyond the 2 minutes AWS promises; taking %g s",
                    isoformat_z(when),
                    left,
                    SPOT_NOTICE_S,
                )
            left = SPOT_NOTICE_S
        elif left <= 0 and first:
            log.warning("spot notice time %s has passed already: due now", isoformat_z(when))
        return sent + timedelta(seconds=max(left, 0.0))


class ASGLifecycleSource(_IMDSSource):
    """The Auto Scaling target lifecycle state; 404 when the instance is in no group."""

    path = "autoscaling/target-lifecycle-state"

    def __init__(self, client: IMDSClient) -> None:
        super().__init__(client)
        self._terminated_since: datetime | None = None  # first poll that read Terminated: a stable deadline

    def poll(self) -> Notice | None:
        notice = super().poll()
        if notice is None:
            self._terminated_since = None
        return notice

    def parse(self, body: str, now: datetime) -> Notice | None:
        state = body.strip()
        if not _LIFECYCLE_STATE.match(state):
            raise self._error("unexpected lifecycle state", body)
        if state != "Terminated":
            return None
        since = self._terminated_since = self._terminated_since or now
        deadline = since + timedelta(seconds=ASG_TERMINATE_GRACE_S)
        return self._notice(INTERRUPTION, "asg-terminate", deadline, since, state, {"target_lifecycle_state": state})


class RebalanceSource(_IMDSSource):
    """The rebalance recommendation: an advisory that often precedes the spot notice."""

    path = "events/recommendations/rebalance"
    advisory = True
    poll_every = 5  # advisory, and it comes minutes ahead: every 5th interval saves IMDS calls (and the GIL)

    def parse(self, body: str, now: datetime) -> Notice:
        data = self._json(body, dict)
        self._time(parse_iso8601, self._field(data, "noticeTime", body), body)
        # One recommendation per instance: a noticeTime that moves from answer to answer is still that one.
        return self._notice(REBALANCE, "rebalance", None, now, None, data)


class MaintenanceSource(_IMDSSource):
    """Scheduled maintenance events (`[]` when none); the earliest active one is the notice."""

    path = "events/maintenance/scheduled"
    advisory = True
    poll_every = 30  # scheduled days ahead

    def parse(self, body: str, now: datetime) -> Notice | None:
        active: list[tuple[datetime, dict[str, Any]]] = []
        for event in self._json(body, list):
            if not isinstance(event, dict):
                raise self._error("expected every event to be a JSON object", body)
            if str(self._field(event, "State", body)).lower() in INACTIVE_EVENT_STATES:
                continue
            self._field(event, "Code", body)
            active.append((self._time(parse_rfc1123, self._field(event, "NotBefore", body), body), event))
        if not active:
            return None
        not_before, event = min(active, key=lambda pair: pair[0])
        key = event.get("EventId") or f"{event['Code']}:{event['NotBefore']}"
        return self._notice(MAINTENANCE, str(event["Code"]), not_before, now, key, event)


def notice_sources(metadata_url: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[NoticeSource]:
    """The AWS sources, most urgent first, sharing one IMDS client and token."""
    client = IMDSClient(resolve_metadata_url(metadata_url, ENDPOINT_ENV, DEFAULT_URL), timeout_s)
    return [
        SpotInstanceActionSource(client),
        ASGLifecycleSource(client),
        RebalanceSource(client),
        MaintenanceSource(client),
    ]


def probe(metadata_url: str | None = None, timeout_s: float = 0.3) -> bool:
    """True when an IMDSv2 token PUT succeeds at the resolved endpoint (cloud detection)."""
    base_url = resolve_metadata_url(metadata_url, ENDPOINT_ENV, DEFAULT_URL)
    with MetadataSession() as session:
        try:
            _fetch_token(session, base_url, timeout_s)
        except NoticeSourceError as exc:
            log.debug("no AWS metadata service: %s", exc)
            return False
    return True
