"""A localhost emulator of the GCE metadata server, as strict as the real one.

It serves `/computeMetadata/v1/...` only to requests carrying `Metadata-Flavor: Google`
and refuses anything that came through a proxy (`X-Forwarded-For`), answers with
`Metadata-Flavor: Google`, an `ETag` and `application/text`, and supports the hanging
GET (`?wait_for_change=true&last_etag=...&timeout_sec=N`) that GCP clients use to
learn of a preemption the moment it happens.

Notices (`raise_notice`, or POST /_spotguard/notice with the same parameters as JSON):

    kind="preempt"                                  instance/preempted becomes TRUE
    kind="maintenance", event=EVENT,                instance/maintenance-event becomes EVENT
        window_start_in_s=S (optional)              and instance/upcoming-maintenance
                                                    announces a window starting in S seconds
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from datetime import timedelta
from typing import Any

from aiohttp import web

from cloud_adapters.emulation import MetadataEmulator
from cloud_adapters.notice import isoformat_z, utc_now

METADATA_PREFIX = "/computeMetadata/v1/"
FLAVOR_HEADER = "Metadata-Flavor"
FLAVOR = "Google"
CONTENT_TYPE = "application/text"

PREEMPT = "preempt"
MAINTENANCE = "maintenance"
NO_MAINTENANCE = "NONE"
MAINTENANCE_EVENTS = ("MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE")

# The real server waits indefinitely without `timeout_sec`; an hour keeps a forgotten client bounded.
DEFAULT_WAIT_S = 3600.0


def etag_of(path: str, body: str) -> str:
    """A content-derived ETag: the same value keeps its ETag, any change gives a new one."""
    return hashlib.sha256(f"{path}\0{body}".encode()).hexdigest()[:16]


class GCPMetadataEmulator(MetadataEmulator):
    """The subset of the GCE metadata server that interruption handling reads."""

    cloud = "gcp"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        instance_id: str = "4520031799277581759",
        instance_name: str = "spotguard-emulated-vm",
        project_id: str = "spotguard-emulated",
    ) -> None:
        super().__init__(host, port)
        self.instance_id = instance_id
        self.instance_name = instance_name
        self.project_id = project_id
        self.preempted = False
        self.maintenance_event = NO_MAINTENANCE
        self.upcoming_maintenance: dict[str, Any] | None = None

    # ---- hooks -----------------------------------------------------------------
    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(METADATA_PREFIX + "{path:.*}", self._serve)

    def apply_notice(self, params: dict[str, Any]) -> None:
        params = dict(params)
        kind = params.pop("kind", PREEMPT)
        if kind == PREEMPT:
            self._reject_unknown(params, kind)
            self.preempted = True
        elif kind == MAINTENANCE:
            event = params.pop("event", "TERMINATE_ON_HOST_MAINTENANCE")
            window_start_in_s = params.pop("window_start_in_s", None)
            self._reject_unknown(params, kind)
            if event not in MAINTENANCE_EVENTS:
                raise ValueError(f"maintenance event must be one of {MAINTENANCE_EVENTS}, not {event!r}")
            self.maintenance_event = event
            if window_start_in_s is not None:
                self.upcoming_maintenance = upcoming_window(float(window_start_in_s))
        else:
            raise ValueError(f"gcp notice kind must be {PREEMPT!r} or {MAINTENANCE!r}, not {kind!r}")

    def clear_state(self) -> None:
        self.preempted = False
        self.maintenance_event = NO_MAINTENANCE
        self.upcoming_maintenance = None

    def malformed_response(self, request: web.Request) -> web.StreamResponse:
        return self._answer(request.match_info.get("path", ""), "{not a metadata value")

    # ---- serving -----------------------------------------------------------------
    def _value(self, path: str) -> str | None:
        """The current body at `path`, or None when the server has nothing there (404)."""
        if path == "instance/preempted":
            return "TRUE" if self.preempted else "FALSE"
        if path == "instance/maintenance-event":
            return self.maintenance_event
        if path == "instance/upcoming-maintenance":
            return json.dumps(self.upcoming_maintenance) if self.upcoming_maintenance else None
        return {
            "instance/id": self.instance_id,
            "instance/name": self.instance_name,
            "project/project-id": self.project_id,
        }.get(path)

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get(FLAVOR_HEADER) != FLAVOR:
            return _error(403, "Missing Metadata-Flavor:Google header.")
        if "X-Forwarded-For" in request.headers:
            return _error(403, "Request had an X-Forwarded-For header and was rejected.")
        path = request.match_info["path"]
        body = self._value(path)
        if body is None:
            return _error(404, "Not Found")
        query = request.query
        if query.get("wait_for_change", "").lower() == "true":
            try:
                timeout_s = float(query.get("timeout_sec", DEFAULT_WAIT_S))
            except ValueError:
                return _error(400, "timeout_sec must be a number.")
            body = await self._wait_for_new_value(path, body, query.get("last_etag"), timeout_s)
            if body is None:
                return _error(404, "Not Found")
        return self._answer(path, body)

    async def _wait_for_new_value(self, path: str, body: str, last_etag: str | None, timeout_s: float) -> str | None:
        """Hang until the value at `path` differs from `last_etag` (or from now), or `timeout_s` passes."""
        baseline = last_etag or etag_of(path, body)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        current: str | None = body
        # Every state change wakes every waiter; one that finds its own value unchanged waits on.
        while current is not None and etag_of(path, current) == baseline and (remaining := deadline - loop.time()) > 0:
            await self.wait_for_change(self.version, remaining)
            current = self._value(path)
        return current

    def _answer(self, path: str, body: str) -> web.Response:
        return web.Response(
            status=200,
            body=body.encode(),
            headers={FLAVOR_HEADER: FLAVOR, "ETag": etag_of(path, body), "Content-Type": CONTENT_TYPE},
        )

    @staticmethod
    def _reject_unknown(params: dict[str, Any], kind: str) -> None:
        if params:
            raise ValueError(f"unknown parameters for a gcp {kind!r} notice: {sorted(params)}")


def upcoming_window(start_in_s: float, length_s: float = 3600.0) -> dict[str, Any]:
    """An `instance/upcoming-maintenance` document for a window starting `start_in_s` from now."""
    start = utc_now() + timedelta(seconds=start_in_s)
    return {
        "can_reschedule": False,
        "latest_window_start_time": isoformat_z(start),
        "maintenance_status": "PENDING",
        "type": "SCHEDULED",
        "window_end_time": isoformat_z(start + timedelta(seconds=length_s)),
        "window_start_time": isoformat_z(start),
    }


def _error(status: int, reason: str) -> web.Response:
    """An error page; like the real server it still says `Metadata-Flavor: Google`."""
    return web.Response(status=status, text=reason + "\n", headers={FLAVOR_HEADER: FLAVOR}, content_type="text/html")
