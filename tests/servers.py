"""Storage protocol servers for tests, each a real subprocess on a free 127.0.0.1 port,
and a fault-injecting reverse proxy to put in front of one of them.

    moto (S3), gcp-storage-emulator (GCS JSON API), azurite (Azure Blob, from .ci-tools/).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

ROOT = Path(__file__).resolve().parents[1]
AZURITE_BIN = ROOT / ".ci-tools" / "node_modules" / ".bin" / "azurite-blob"
# azurite's well-known development account (public, documented by Microsoft).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listens(pid: int, port: int) -> bool:
    """Whether process `pid` itself holds the socket listening on `port` (Linux /proc): with tests
    running in parallel, another process's server may have been given the same free port."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                inodes.add(fields[9])
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in {f"socket:[{i}]" for i in inodes}:
                return True
        except OSError:
            continue
    return False


class ServerProcess:
    """A server subprocess: started, waited for until its port answers, stopped or killed."""

    def __init__(self, name: str, argv: list[str], port: int, *, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        # A file, not a pipe: a chatty server (moto logs every request) would block on a full pipe.
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            argv,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # a Ctrl-C in pytest does not reach it twice
        )
        try:
            self._wait_ready(timeout=30.0)
        except Exception:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                err = self.log.read().decode(errors="replace").strip()[-2000:]
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {err}")
            if _listens(self.proc.pid, self.port):
                return
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not listen on {self.url} within {timeout:.0f} s")

    def freeze(self) -> None:
        """SIGSTOP: the port still accepts connections (the kernel's backlog), nothing answers."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL, as a crashed or preempted server would go."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.thaw()  # a frozen server would not act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


def start_moto(port: int | None = None) -> ServerProcess:
    port = port or free_port()
    return ServerProcess("moto", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], port)


def start_gcs_emulator(port: int | None = None) -> ServerProcess:
    port = port or free_port()
    argv = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port)]
    return ServerProcess("gcp-storage-emulator", [*argv, "--in-memory"], port)


def azurite_available() -> bool:
    return AZURITE_BIN.exists() and shutil.which("node") is not None


def start_azurite(port: int | None = None) -> ServerProcess:
    port = port or free_port()
    argv = [str(AZURITE_BIN), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence"]
    return ServerProcess("azurite", [*argv, "--silent", "--skipApiVersionCheck"], port)


def azurite_connection_string(url: str) -> str:
    return (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
        f"BlobEndpoint={url}/{AZURITE_ACCOUNT};"
    )


@dataclass
class Fault:
    """What the proxy answers instead of forwarding: `count` times, or always when count is None;
    with `match`, only to requests whose path and query it matches (a regular expression, searched)."""

    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    count: int | None = 1
    match: str | None = None


_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "expect",
               "proxy-authorization", "proxy-authenticate", "content-length"}  # fmt: skip


class FaultProxy:
    """A reverse proxy on 127.0.0.1 that forwards to `upstream` unless a fault is armed.

    The Host header is passed through unchanged, so servers that build URLs from it
    (resumable upload sessions) keep pointing clients at the proxy.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.seen: list[tuple[str, str, dict[str, str]]] = []  # (method, path?query, headers) of every request
        self.faulted = 0
        self.slow_s = 0.0  # delay before forwarding each request: a slow network or server
        self.slow_match: str | None = None  # when set, only requests whose path and query contain it are slow
        # Called (on a worker thread) with (method, path?query) as each request arrives, before it is forwarded.
        self.on_request: Callable[[str, str], None] | None = None
        self.drop_headers: set[str] = set()  # answer headers (lower case) the proxy strips, e.g. {"etag"}
        # Requests never answered nor read (a blackholed network): the client fills its socket buffer and waits.
        self.blackhole = False
        # Answer bodies longer than this are cut after it by a connection reset (a flaky network mid-download).
        self.reset_after: int | None = None
        self._closing: asyncio.Event | None = None
        self._fault: Fault | None = None
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fault-proxy", daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("fault proxy did not start")

    def arm(self, fault: Fault | None) -> None:
        with self._lock:
            self._fault = fault

    def _take_fault(self, path_qs: str) -> Fault | None:
        with self._lock:
            fault = self._fault
            if fault is None or (fault.match is not None and not re.search(fault.match, path_qs)):
                return None
            if fault.count is not None:
                fault.count -= 1
                if fault.count <= 0:
                    self._fault = None
            self.faulted += 1
            return fault

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._started.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        self._closing = asyncio.Event()
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)  # held requests are dropped
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        self._session = ClientSession(
            connector=TCPConnector(limit=64), timeout=ClientTimeout(total=120), auto_decompress=False
        )

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if self.blackhole:
            with self._lock:
                self.seen.append((request.method, request.path_qs, dict(request.headers)))
            await self._closing.wait()
            _reset(request)
        body = await request.read()
        with self._lock:
            self.seen.append((request.method, request.path_qs, dict(request.headers)))
        if self.on_request is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.on_request, request.method, request.path_qs)
        if fault := self._take_fault(request.path_qs):
            return web.Response(status=fault.status, body=fault.body, headers=fault.headers)
        if self.slow_s and (self.slow_match is None or self.slow_match in request.path_qs):
            await asyncio.sleep(self.slow_s)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        async with self._session.request(
            request.method, self.upstream + request.path_qs, headers=headers, data=body,
            allow_redirects=False, skip_auto_headers=("Content-Type",),
        ) as answer:  # fmt: skip
            payload = await answer.read()
            out = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP_BY_HOP | self.drop_headers}
            if request.method == "HEAD":  # no body, but the size the client asked about
                size = answer.headers.get("Content-Length")
                return web.Response(status=answer.status, headers={**out, **({"Content-Length": size} if size else {})})
            cut = self.reset_after
            if cut is not None and len(payload) > cut:
                whole = {**out, "Content-Length": str(len(payload))}  # promised, never delivered
                response = web.StreamResponse(status=answer.status, headers=whole)
                await response.prepare(request)
                await response.write(payload[:cut])
                self.faulted += 1
                _reset(request)
            return web.Response(status=answer.status, body=payload, headers=out)

    def close(self) -> None:
        async def shutdown() -> None:
            self._closing.set()  # held requests end with a reset
            await self._session.close()
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def _reset(request: web.Request) -> NoReturn:
    """Reset the connection (RST, not a clean close) and end the handler."""
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    if request.transport:
        request.transport.close()
    raise asyncio.CancelledError
