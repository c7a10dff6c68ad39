"""What every metadata emulator shares: a localhost aiohttp server on its own thread,
notices raised now or after a delay, and fault injection.

Each cloud's `emulator.py` subclasses `MetadataEmulator` with the real service's
routes and formats. Tests and `spotguard simulate` drive an emulator either
through its Python methods or through the control endpoints under `/_spotguard/`:

    POST /_spotguard/notice   JSON body: the cloud's notice parameters (see `raise_notice`)
    POST /_spotguard/fault    {"mode": ..., "count": N or null, "delay_s": S, "status": code}
    POST /_spotguard/clear    remove notices and faults
    GET  /_spotguard/stats    {"requests": N, "notices": N}
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)

CONTROL_PREFIX = "/_spotguard/"
SHUTDOWN_GRACE_S = 0.5  # how long stop() lets in-flight requests finish

# Fault modes every emulator understands; a cloud may add its own (AWS: "token-expiry").
FAULT_ERROR = "error"  # answer `status` (500 by default) instead of the real answer
FAULT_SLOW = "slow"  # answer after `delay_s`
FAULT_MALFORMED = "malformed"  # a 200 whose body does not parse
FAULT_RESET = "reset"  # close the connection without answering
COMMON_FAULTS = (FAULT_ERROR, FAULT_SLOW, FAULT_MALFORMED, FAULT_RESET)


class MetadataEmulator:
    """Base of the cloud emulators. Subclasses set `cloud` and implement the hooks."""

    cloud = ""
    extra_faults: tuple[str, ...] = ()

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self.requests_seen = 0
        self.notices_raised = 0
        self._fault: dict[str, Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._change: asyncio.Future[None] | None = None  # resolved at the next state change
        self._version = 0  # bumped on every state change, for hanging GETs

    # ---- hooks for subclasses -------------------------------------------------
    def add_routes(self, app: web.Application) -> None:
        raise NotImplementedError

    def apply_notice(self, params: dict[str, Any]) -> None:
        """Put a notice into the emulated state (runs on the server's loop)."""
        raise NotImplementedError

    def clear_state(self) -> None:
        """Remove every notice (runs on the server's loop)."""
        raise NotImplementedError

    def malformed_response(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200, text="{not json", content_type="text/plain")

    async def custom_fault(self, request: web.Request, fault: dict[str, Any]) -> web.StreamResponse | None:
        """Handle a mode from `extra_faults`; None lets the request through."""
        return None

    # ---- state changes (thread-safe) -----------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def raise_notice(self, **params: Any) -> None:
        """Raise a notice now. The parameters are the cloud's (see the subclass)."""
        self._call(self._do_notice, params)

    def schedule_notice(self, after_s: float, **params: Any) -> None:
        """Raise a notice `after_s` seconds from now."""
        loop = self._require_loop()
        loop.call_soon_threadsafe(loop.call_later, after_s, self._do_notice, params)

    def set_fault(self, mode: str | None, count: int | None = None, delay_s: float = 2.0, status: int = 500) -> None:
        """Inject a fault into the next `count` metadata requests (all of them when None)."""
        if mode is not None and mode not in COMMON_FAULTS + self.extra_faults:
            raise ValueError(f"unknown fault mode {mode!r}; known: {COMMON_FAULTS + self.extra_faults}")
        self._fault = None if mode is None else {"mode": mode, "count": count, "delay_s": delay_s, "status": status}

    def clear(self) -> None:
        self._fault = None
        self._call(self._do_clear)

    # ---- lifecycle -------------------------------------------------------------
    def start(self) -> str:
        """Serve on a background thread; returns the base URL once it is listening."""
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._start_site())
            except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
                errors.append(exc)
                if self._runner is not None:  # a port in use: nothing may be left open
                    loop.run_until_complete(self._runner.cleanup())
                loop.close()
                self._loop = None
                ready.set()
                return
            # Signal from inside the running loop: before that, `_call` would run on the caller's thread.
            loop.call_soon(ready.set)
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            # Hanging GETs whose client left are not cancelled by the cleanup (aiohttp lets a handler run on
            # after its client is gone): cancel whatever is left, and let it unwind before the loop closes.
            if pending := asyncio.all_tasks(loop):
                for task in pending:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

        self._thread = threading.Thread(target=run, name=f"{self.cloud}-emulator", daemon=True)
        self._thread.start()
        ready.wait()
        if errors:
            raise errors[0]
        return self.url

    def stop(self) -> None:
        if self._loop and self._thread:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._loop = self._thread = None

    def __enter__(self) -> MetadataEmulator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- helpers for subclasses ---------------------------------------------
    async def wait_for_change(self, since_version: int, timeout_s: float) -> None:
        """Block a hanging GET until the state changes after `since_version`, or timeout.

        Every waiter waits on one future, resolved at the next change and never cancelled by them: no
        lock to re-acquire (on Python 3.11, handlers cancelled as their `asyncio.wait_for` on a Condition
        timed out left its lock taken, and no change woke a waiter again).
        """
        assert self._change is not None
        if self._version == since_version:
            await asyncio.wait([self._change], timeout=timeout_s)

    @property
    def version(self) -> int:
        return self._version

    # ---- internals -------------------------------------------------------------
    async def _start_site(self) -> None:
        self._change = asyncio.get_running_loop().create_future()
        app = web.Application(middlewares=[self._fault_middleware])
        app.router.add_post(CONTROL_PREFIX + "notice", self._control_notice)
        app.router.add_post(CONTROL_PREFIX + "fault", self._control_fault)
        app.router.add_post(CONTROL_PREFIX + "clear", self._control_clear)
        app.router.add_get(CONTROL_PREFIX + "stats", self._control_stats)
        self.add_routes(app)
        # Stopping must not wait out hanging GETs (aiohttp's default grace is 60 s): cancel them quickly.
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        log.info("%s metadata emulator listening on %s", self.cloud, self.url)

    def _require_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("the emulator is not running; call start() first")
        return self._loop

    def _call(self, fn: Any, *args: Any) -> None:
        """Run `fn` on the server loop and wait for it, so state is never touched from two threads."""
        loop = self._require_loop()
        if threading.current_thread() is self._thread or not loop.is_running():
            fn(*args)
            return
        done = threading.Event()
        errors: list[BaseException] = []

        def call() -> None:
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
                errors.append(exc)
            finally:
                done.set()

        loop.call_soon_threadsafe(call)
        done.wait(timeout=10)
        if errors:
            raise errors[0]

    def _do_notice(self, params: dict[str, Any]) -> None:
        self.apply_notice(params)
        self.notices_raised += 1
        self._bump()
        log.info("%s emulator raised a notice %s", self.cloud, params or "")

    def _do_clear(self) -> None:
        self.clear_state()
        self._bump()

    def _bump(self) -> None:
        """A state change (on the server's loop, or before it runs): every hanging GET looks again."""
        self._version += 1
        if self._change is not None:  # replaced first: a failure to wake the waiters leaves no resolved one behind
            woken, self._change = self._change, self._change.get_loop().create_future()
            woken.set_result(None)

    @web.middleware
    async def _fault_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith(CONTROL_PREFIX):
            return await handler(request)
        self.requests_seen += 1
        fault = self._fault
        if fault is None:
            return await handler(request)
        if fault["count"] is not None:
            fault["count"] -= 1
            if fault["count"] <= 0:
                self._fault = None
        mode = fault["mode"]
        if mode == FAULT_ERROR:
            return web.Response(status=fault["status"], text="injected fault\n")
        if mode == FAULT_SLOW:
            await asyncio.sleep(fault["delay_s"])
            return await handler(request)
        if mode == FAULT_MALFORMED:
            return self.malformed_response(request)
        if mode == FAULT_RESET:
            if request.transport is not None:
                request.transport.close()
            return web.Response()  # never sent: the connection is gone (raising would log a traceback)
        return await self.custom_fault(request, fault) or await handler(request)

    async def _control_notice(self, request: web.Request) -> web.Response:
        try:
            params = await _json_body(request)
            after = float(params.pop("after_s", 0) or 0)
            if after <= 0:
                self._do_notice(params)
        except _BAD_INPUT as exc:
            return _bad_request(exc)
        if after > 0:
            self._loop.call_later(after, self._do_notice, params)
        return web.json_response({"ok": True, "after_s": after})

    async def _control_fault(self, request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
            count = body.get("count")
            self.set_fault(
                body.get("mode"),
                None if count is None else int(count),
                float(body.get("delay_s", 2.0)),
                int(body.get("status", 500)),
            )
        except _BAD_INPUT as exc:
            return _bad_request(exc)
        return web.json_response({"ok": True})

    async def _control_clear(self, request: web.Request) -> web.Response:
        self._fault = None
        self._do_clear()
        return web.json_response({"ok": True})

    async def _control_stats(self, request: web.Request) -> web.Response:
        return web.json_response({"requests": self.requests_seen, "notices": self.notices_raised})


# Bad JSON or parameters in a control request: the caller's mistake, answered 400.
_BAD_INPUT = (ValueError, TypeError, AttributeError)


async def _json_body(request: web.Request) -> dict[str, Any]:
    """The control request's JSON object ({} without a body); ValueError for anything else."""
    body = await request.json() if request.can_read_body else {}
    if not isinstance(body, dict):
        raise ValueError(f"expected a JSON object, got {type(body).__name__}")
    return body


def _bad_request(exc: Exception) -> web.Response:
    return web.json_response({"ok": False, "error": str(exc)}, status=400)
