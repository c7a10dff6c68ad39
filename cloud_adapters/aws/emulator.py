"""An EC2 instance metadata service (IMDSv2 required) on localhost.

As strict as the real one where clients can get it wrong: a token PUT needs
`X-aws-ec2-metadata-token-ttl-seconds` between 1 and 21600 (else 400) and is
refused when it carries `X-Forwarded-For` (403); every GET needs a live token
(else 401); metadata is text/plain, absent paths are 404, directories list
their entries. Notices (see `raise_notice`):

    interruption   spot/instance-action {"action": ..., "time": ...} (+ spot/termination-time)
    rebalance      events/recommendations/rebalance {"noticeTime": ...}
    asg-terminate  autoscaling/target-lifecycle-state reads Terminated
    maintenance    an entry in events/maintenance/scheduled

Extra fault mode "token-expiry": every token issued so far stops being valid.
`set_metadata(path, body)` serves any body as is (replaying a captured answer).
`clock_offset_s` sets IMDS's clock apart from the host's: every time it serves (notice
times, the `Date` header) is shifted by it, as a host with a skewed clock would see them.
"""

from __future__ import annotations

import email.utils
import json
import secrets
import time
from datetime import datetime, timedelta
from http import HTTPStatus
from typing import Any

from aiohttp import web

from cloud_adapters.emulation import MetadataEmulator
from cloud_adapters.notice import deadline_after, utc_now

TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
MAX_TOKEN_TTL_S = 21600
FAULT_TOKEN_EXPIRY = "token-expiry"

NOTICE_KINDS = ("interruption", "rebalance", "asg-terminate", "maintenance")
SPOT_ACTIONS = ("terminate", "stop", "hibernate")
MAINTENANCE_CODES = {
    "instance-reboot": "scheduled reboot",
    "system-reboot": "scheduled reboot",
    "system-maintenance": "scheduled maintenance",
    "instance-retirement": "scheduled instance retirement",
    "instance-stop": "The instance is running on degraded hardware",
}
MAINTENANCE_WINDOW_S = 2 * 3600  # NotAfter - NotBefore


def _iso(when: datetime) -> str:
    """IMDS's instance-action time: `2026-11-22T10:02:00Z`, whole seconds."""
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def _event_time(when: datetime) -> str:
    """The scheduled-events time: `21 Jan 2019 09:00:43 GMT` (day not zero-padded)."""
    return f"{when.day} {when:%b %Y %H:%M:%S} GMT"


def _error(status: int) -> web.Response:
    """IMDS's error pages are small HTML documents."""
    title = f"{status} - {HTTPStatus(status).phrase}"
    body = (
        '<?xml version="1.0" encoding="iso-8859-1"?>\n'
        f"<html><head><title>{title}</title></head><body><h1>{title}</h1></body></html>\n"
    )
    return web.Response(status=status, text=body, content_type="text/html")


class AWSMetadataEmulator(MetadataEmulator):
    cloud = "aws"
    extra_faults = (FAULT_TOKEN_EXPIRY,)

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        in_asg: bool = False,
        clock_offset_s: float = 0.0,
        moving_times: bool = False,
    ) -> None:
        """`in_asg`: serve autoscaling/target-lifecycle-state (InService until an asg-terminate).
        `clock_offset_s`: how far IMDS's clock is ahead of the host's (-100: the host is 100 s fast).
        `moving_times`: serve the instance-action `time` as "now + in_s" and the rebalance
        `noticeTime` as "now" on every request, as some IMDS implementations do."""
        super().__init__(host, port)
        self.in_asg = in_asg
        self.clock_offset_s = clock_offset_s
        self.moving_times = moving_times
        self._action_in_s = 0.0
        self.instance_id = "i-" + secrets.token_hex(9)[:17]
        self.tokens_issued = 0  # successful token PUTs, so tests can see the client's caching
        self._tokens: dict[str, float] = {}  # token -> time.monotonic() at which it expires
        self._instance_action: dict[str, str] | None = None
        self._rebalance: dict[str, str] | None = None
        self._lifecycle_state = "InService"
        self._events: list[dict[str, str]] = []
        self._raw: dict[str, str] = {}  # path -> body served as is, over the emulated state

    def raise_notice(  # type: ignore[override] - the AWS parameters, spelled out
        self,
        kind: str = "interruption",
        action: str = "terminate",
        in_s: float = 120.0,
        code: str = "system-reboot",
        state: str = "active",
    ) -> None:
        """Raise a notice now; with no arguments, a spot interruption (terminate) in 120 s.

        `action` applies to "interruption", `code` and `state` to "maintenance"
        (state "completed"/"canceled" makes an entry clients must skip), `in_s`
        is the deadline (interruption) or NotBefore (maintenance) from now.
        """
        super().raise_notice(kind=kind, action=action, in_s=in_s, code=code, state=state)

    def set_metadata(self, path: str, body: str | None) -> None:
        """Serve `body` as is at meta-data `path` (None stops): replays a captured answer, valid or not."""
        self._call(self._set_raw, path.strip("/"), body)

    def expire_tokens(self) -> None:
        """Invalidate every token issued so far (what the token-expiry fault does)."""
        self._tokens.clear()

    # ---- MetadataEmulator hooks -------------------------------------------------
    def add_routes(self, app: web.Application) -> None:
        app.router.add_put("/latest/api/token", self._put_token)
        app.router.add_get("/latest/meta-data", self._get_metadata)
        app.router.add_get("/latest/meta-data/{path:.*}", self._get_metadata)
        app.on_response_prepare.append(self._stamp_date)

    def apply_notice(self, params: dict[str, Any]) -> None:
        unknown = set(params) - {"kind", "action", "in_s", "code", "state"}
        if unknown:
            raise ValueError(f"unknown AWS notice parameter(s) {sorted(unknown)}")
        kind = params.get("kind", "interruption")
        when = deadline_after(float(params.get("in_s", 120.0)), self._now())
        if kind == "interruption":
            action = params.get("action", "terminate")
            if action not in SPOT_ACTIONS:
                raise ValueError(f"spot action must be one of {SPOT_ACTIONS}, not {action!r}")
            self._instance_action = {"action": action, "time": _iso(when)}
            self._action_in_s = float(params.get("in_s", 120.0))
        elif kind == "rebalance":
            self._rebalance = {"noticeTime": _iso(self._now())}
        elif kind == "asg-terminate":
            self.in_asg = True
            self._lifecycle_state = "Terminated"
        elif kind == "maintenance":
            self._events.append(
                self._maintenance_event(params.get("code", "system-reboot"), when, params.get("state", "active"))
            )
        else:
            raise ValueError(f"AWS notice kind must be one of {NOTICE_KINDS}, not {kind!r}")

    def clear_state(self) -> None:
        self._instance_action = self._rebalance = None
        self._lifecycle_state = "InService"
        self._events = []
        self._raw = {}

    def malformed_response(self, request: web.Request) -> web.StreamResponse:
        """A body that does not parse in place of an answer; a path with nothing to serve stays 404."""
        path = request.path.removeprefix("/latest/meta-data").strip("/")
        served = any(leaf == path or leaf.startswith(path + "/") for leaf in self._tree())
        if request.method == "GET" and path and not served:
            return _error(404)
        return web.Response(status=200, text='{"action": "terminate", "time": ', content_type="text/plain")

    async def custom_fault(self, request: web.Request, fault: dict[str, Any]) -> web.StreamResponse | None:
        if fault["mode"] == FAULT_TOKEN_EXPIRY:
            self.expire_tokens()
        return None

    # ---- the service --------------------------------------------------------------
    def _now(self) -> datetime:
        return utc_now() + timedelta(seconds=self.clock_offset_s)

    async def _stamp_date(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers["Date"] = email.utils.format_datetime(self._now(), usegmt=True)

    def _set_raw(self, path: str, body: str | None) -> None:
        if body is None:
            self._raw.pop(path, None)
        else:
            self._raw[path] = body

    def _maintenance_event(self, code: str, not_before: datetime, state: str) -> dict[str, str]:
        if code not in MAINTENANCE_CODES:
            raise ValueError(f"maintenance code must be one of {sorted(MAINTENANCE_CODES)}, not {code!r}")
        not_after = deadline_after(MAINTENANCE_WINDOW_S, not_before)
        description = (
            MAINTENANCE_CODES[code] if state == "active" else f"[{state.capitalize()}] {MAINTENANCE_CODES[code]}"
        )
        return {
            "NotBefore": _event_time(not_before),
            "Code": code,
            "Description": description,
            "EventId": "instance-event-" + secrets.token_hex(9)[:17],
            "NotAfter": _event_time(not_after),
            "State": state,
        }

    def _tree(self) -> dict[str, str]:
        """Every leaf under /latest/meta-data/ and its body, as of now."""
        leaves = {
            "ami-id": "ami-0abcdef1234567890",
            "hostname": "ip-10-0-0-12.ec2.internal",
            "instance-id": self.instance_id,
            "instance-life-cycle": "spot",
            "instance-type": "g5.12xlarge",
            "local-ipv4": "10.0.0.12",
            "placement/availability-zone": "us-east-1a",
            "placement/region": "us-east-1",
            "events/maintenance/history": "[]",
            "events/maintenance/scheduled": json.dumps(self._events, indent=2),
        }
        if self._instance_action and self.moving_times:
            self._instance_action["time"] = _iso(deadline_after(self._action_in_s, self._now()))
        if self._rebalance and self.moving_times:
            self._rebalance["noticeTime"] = _iso(self._now())
        if self._instance_action:
            leaves["spot/instance-action"] = json.dumps(self._instance_action)
            if self._instance_action["action"] == "terminate":
                leaves["spot/termination-time"] = self._instance_action["time"]
        if self._rebalance:
            leaves["events/recommendations/rebalance"] = json.dumps(self._rebalance)
        if self.in_asg:
            leaves["autoscaling/target-lifecycle-state"] = self._lifecycle_state
        return leaves | self._raw

    async def _put_token(self, request: web.Request) -> web.Response:
        if "X-Forwarded-For" in request.headers:
            return _error(403)  # IMDS refuses token requests that went through a proxy
        ttl_text = request.headers.get(TOKEN_TTL_HEADER, "")
        if not ttl_text.isdigit() or not 1 <= int(ttl_text) <= MAX_TOKEN_TTL_S:
            return _error(400)
        token = secrets.token_urlsafe(42)
        self._tokens[token] = time.monotonic() + int(ttl_text)
        self.tokens_issued += 1
        return web.Response(text=token, content_type="text/plain", headers={TOKEN_TTL_HEADER: ttl_text})

    async def _get_metadata(self, request: web.Request) -> web.Response:
        expires = self._tokens.get(request.headers.get(TOKEN_HEADER, ""))
        if expires is None or time.monotonic() >= expires:
            return _error(401)
        path = request.match_info.get("path", "").strip("/")
        leaves = self._tree()
        if path in leaves:
            return web.Response(text=leaves[path], content_type="text/plain")
        prefix = path + "/" if path else ""
        entries = sorted({_child(leaf[len(prefix) :]) for leaf in leaves if leaf.startswith(prefix)})
        if not entries:
            return _error(404)
        return web.Response(text="\n".join(entries), content_type="text/plain")


def _child(rest: str) -> str:
    """The first segment of `rest`, with a trailing slash when it is a directory."""
    head, sep, _ = rest.partition("/")
    return head + ("/" if sep else "")
