"""An Azure Instance Metadata Service on localhost: Scheduled Events and instance metadata.

Strict like the real service: every request needs `Metadata: true` and a supported
`api-version`, requests carrying `X-Forwarded-For` are refused, and more than
5 requests in any one second get 429. Events follow the platform's life cycle:
Scheduled -> Started (at NotBefore, or when a StartRequest acknowledges it, with
NotBefore cleared) -> removed; every change bumps DocumentIncarnation.
"""

from __future__ import annotations

import asyncio
import collections
import email.utils
import time
import uuid
from typing import Any

from aiohttp import web

from cloud_adapters.emulation import MetadataEmulator
from cloud_adapters.notice import deadline_after

DEFAULT_VM_NAME = "spotguard-vm-0"
EVENT_TYPES = ("Freeze", "Reboot", "Redeploy", "Preempt", "Terminate")
SCHEDULED_EVENTS_VERSIONS = ("2017-11-01", "2019-01-01", "2019-08-01", "2020-07-01")
INSTANCE_VERSIONS = (
    "2017-08-01",
    "2018-10-01",
    "2019-06-01",
    "2020-06-01",
    "2020-09-01",
    "2020-10-01",
    "2021-01-01",
    "2021-02-01",
    "2021-05-01",
    "2021-12-13",
)
RATE_LIMIT_PER_S = 5


def _error(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


class AzureMetadataEmulator(MetadataEmulator):
    """Azure IMDS. `raise_notice()` with no arguments schedules a Preempt of this VM in 30 s."""

    cloud = "azure"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        vm_name: str = DEFAULT_VM_NAME,
        rate_limit: bool = True,
        first_call_delay_s: float = 0.0,
        started_remove_after_s: float = 1.0,
    ) -> None:
        super().__init__(host, port)
        self.vm_name = vm_name
        self.rate_limit = rate_limit
        self.first_call_delay_s = first_call_delay_s
        self.started_remove_after_s = started_remove_after_s
        self.acknowledged: list[str] = []  # EventIds named in StartRequests, in order
        self.incarnation = 0
        self._events: dict[str, dict[str, Any]] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._recent: collections.deque[float] = collections.deque()  # request times in the last second
        self._enabled_at: float | None = None  # when Scheduled Events answers, set by the first call
        self._instance = {
            "compute": {
                "azEnvironment": "AzurePublicCloud",
                "evictionPolicy": "Delete",
                "location": "westeurope",
                "name": vm_name,
                "osType": "Linux",
                "priority": "Spot",
                "resourceGroupName": "spotguard",
                "subscriptionId": "00000000-0000-0000-0000-000000000000",
                "vmId": str(uuid.uuid4()),
                "vmScaleSetName": "",
                "vmSize": "Standard_NC24ads_A100_v4",
                "zone": "1",
            },
            "network": {"interface": []},
        }

    # ---- driving the emulator ----------------------------------------------------
    def raise_notice(  # type: ignore[override]
        self,
        event_type: str = "Preempt",
        resources: list[str] | None = None,
        not_before_in_s: float | None = 30,
        event_id: str | None = None,
        not_before: str | None = None,
    ) -> str:
        """Schedule an event and return its EventId.

        `resources` defaults to this VM; `not_before_in_s=None` leaves NotBefore empty;
        `not_before` sets the raw NotBefore text (to feed clients odd values).
        """
        params = _event_params(
            {
                "event_type": event_type,
                "resources": resources,
                "not_before_in_s": not_before_in_s,
                "event_id": event_id,
                "not_before": not_before,
            }
        )
        super().raise_notice(**params)
        return params["event_id"]

    def events(self) -> list[dict[str, Any]]:
        """A copy of the current events, as the service would list them (safe from any thread)."""
        return [dict(event) for event in list(self._events.values())]  # list() snapshots under the GIL

    # ---- MetadataEmulator hooks ----------------------------------------------------
    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/metadata/scheduledevents", self._get_events)
        app.router.add_post("/metadata/scheduledevents", self._post_events)
        app.router.add_get("/metadata/instance", self._get_instance)
        app.router.add_get("/metadata/instance/{path:.+}", self._get_instance)

    def apply_notice(self, params: dict[str, Any]) -> None:
        params = _event_params(params)
        event_id = params["event_id"]
        after = params["not_before_in_s"]
        if params["not_before"] is not None:
            not_before = params["not_before"]
        elif after is None:
            not_before = ""
        else:
            not_before = email.utils.format_datetime(deadline_after(after), usegmt=True)
        self._cancel_timer(event_id)
        self._events[event_id] = {
            "EventId": event_id,
            "EventStatus": "Scheduled",
            "EventType": params["event_type"],
            "ResourceType": "VirtualMachine",
            "Resources": params["resources"] or [self.vm_name],
            "NotBefore": not_before,
            "Description": f"Virtual machine is going to be {_DESCRIPTIONS[params['event_type']]}.",
            "EventSource": "Platform",
            "DurationInSeconds": 9 if params["event_type"] == "Freeze" else -1,
        }
        self.incarnation += 1
        if after is not None:
            self._timers[event_id] = self._loop.call_later(max(after, 0), self._start_event, event_id)

    def clear_state(self) -> None:
        for event_id in list(self._timers):
            self._cancel_timer(event_id)
        if self._events:
            self._events.clear()
            self.incarnation += 1

    def malformed_response(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200, text='{"DocumentIncarnation": 1, "Events": [', content_type="application/json")

    # ---- event life cycle (on the server loop) -----------------------------------
    def _start_event(self, event_id: str) -> None:
        event = self._events.get(event_id)
        if event is None or event["EventStatus"] == "Started":
            return
        event["EventStatus"] = "Started"
        event["NotBefore"] = ""  # the platform blanks NotBefore once an event has started
        self.incarnation += 1
        self._cancel_timer(event_id)
        self._timers[event_id] = self._loop.call_later(self.started_remove_after_s, self._remove_event, event_id)

    def _remove_event(self, event_id: str) -> None:
        self._timers.pop(event_id, None)
        if self._events.pop(event_id, None) is not None:
            self.incarnation += 1

    def _cancel_timer(self, event_id: str) -> None:
        timer = self._timers.pop(event_id, None)
        if timer is not None:
            timer.cancel()

    # ---- HTTP --------------------------------------------------------------------------
    def _refuse(self, request: web.Request, versions: tuple[str, ...]) -> web.Response | None:
        """The answer for a request the real IMDS would refuse, or None to serve it."""
        if self.rate_limit:
            now = time.monotonic()
            while self._recent and self._recent[0] <= now - 1.0:
                self._recent.popleft()
            if len(self._recent) >= RATE_LIMIT_PER_S:
                response = _error(429, "Too many requests")
                response.headers["Retry-After"] = "1"  # the window is one second
                return response
            self._recent.append(now)
        if "X-Forwarded-For" in request.headers:
            return _error(400, "Bad request. Requests with X-Forwarded-For header are not allowed")
        if request.headers.get("Metadata", "").lower() != "true":
            return _error(400, "Bad request. Required metadata header not specified")
        newest = list(reversed(versions[-3:]))
        version = request.query.get("api-version")
        if not version:
            return _error(
                400, "Bad request. api-version was not specified in the request", **{"newest-versions": newest}
            )
        if version not in versions:
            return _error(
                400,
                "Bad request. api-version is invalid or was not specified in the request",
                **{"newest-versions": newest},
            )
        return None

    async def _get_events(self, request: web.Request) -> web.Response:
        refused = self._refuse(request, SCHEDULED_EVENTS_VERSIONS)
        if refused is not None:
            return refused
        # The first request switches Scheduled Events on; until then every answer waits.
        now = self._loop.time()
        if self._enabled_at is None:
            self._enabled_at = now + self.first_call_delay_s
        if self._enabled_at > now:
            await asyncio.sleep(self._enabled_at - now)
        return web.json_response({"DocumentIncarnation": self.incarnation, "Events": self.events()})

    async def _post_events(self, request: web.Request) -> web.Response:
        refused = self._refuse(request, SCHEDULED_EVENTS_VERSIONS)
        if refused is not None:
            return refused
        try:
            body = await request.json()
            event_ids = [item["EventId"] for item in body["StartRequests"]]
        except (ValueError, KeyError, TypeError):
            return _error(400, 'Bad request. Expected {"StartRequests": [{"EventId": "..."}]}')
        unknown = [event_id for event_id in event_ids if event_id not in self._events]
        if unknown:
            return _error(400, f"Bad request. Unknown EventId {', '.join(map(str, unknown))}")
        for event_id in event_ids:
            self.acknowledged.append(event_id)
            self._start_event(event_id)
        return web.Response(status=200)

    async def _get_instance(self, request: web.Request) -> web.Response:
        refused = self._refuse(request, INSTANCE_VERSIONS)
        if refused is not None:
            return refused
        node: Any = self._instance
        for part in filter(None, request.match_info.get("path", "").split("/")):
            if not isinstance(node, dict) or part not in node:
                return _error(404, "Not found")
            node = node[part]
        fmt = request.query.get("format", "json" if isinstance(node, (dict, list)) else "text")
        if fmt == "text" and not isinstance(node, (dict, list)):
            return web.Response(text=str(node), content_type="text/plain")
        if fmt == "json" and isinstance(node, (dict, list)):
            return web.json_response(node)
        return _error(400, f"Bad request. format={fmt} is not supported for this path")


_DESCRIPTIONS = {
    "Freeze": "paused for a few seconds",
    "Reboot": "rebooted",
    "Redeploy": "redeployed to another host",
    "Preempt": "evicted (Spot)",
    "Terminate": "deleted",
}


def _event_params(params: dict[str, Any]) -> dict[str, Any]:
    """Validate notice parameters (from Python or the control endpoint) and fill the defaults."""
    event_type = params.get("event_type") or "Preempt"
    if event_type not in EVENT_TYPES:
        raise ValueError(f"event_type must be one of {EVENT_TYPES}, not {event_type!r}")
    resources = params.get("resources")
    if resources is not None and (not isinstance(resources, list) or not all(isinstance(r, str) for r in resources)):
        raise ValueError(f"resources must be a list of VM names, not {resources!r}")
    after = params.get("not_before_in_s", 30)
    return {
        "event_type": event_type,
        "resources": resources,
        "not_before_in_s": None if after is None else float(after),
        "event_id": params.get("event_id") or str(uuid.uuid4()).upper(),
        "not_before": params.get("not_before"),
    }
