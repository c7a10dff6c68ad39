"""Where a metadata service lives (flag, then SPOTGUARD_METADATA_URL, then the cloud's own
variable), and the HTTP session every metadata client uses to reach it."""

from __future__ import annotations

import json
import os
import re
import time
from datetime import datetime
from typing import Any
from urllib.parse import urlencode, urlsplit

import urllib3

from cloud_adapters.notice import NoticeSourceError, parse_rfc1123

METADATA_URL_ENV = "SPOTGUARD_METADATA_URL"
# The useful part of a urllib3 connection error, e.g. "[Errno 111] Connection refused".
_TRANSPORT_CAUSE = re.compile(
    r"\[Errno -?\d+\] [^'\")]+|Remote end closed connection without response|Connection reset by peer"
)
_PIECE = 64 * 1024  # a body is read in pieces of at most this, each against the whole-answer deadline

# A DNS name or an IPv4/IPv6 address: no spaces, nothing a URL parser would take as a host by accident.
_HOST = re.compile(r"[A-Za-z0-9._-]+|[0-9A-Fa-f:.]+(%[A-Za-z0-9_.-]+)?")


def normalise_base_url(url: str, *, what: str = "metadata URL") -> str:
    """Accept `http://host[:port]` (or a bare `host[:port]`) and return it without a trailing slash.

    Raises ValueError with a one-line reason for anything else, so a user's typo
    is reported at start-up rather than as a connection error on every poll.
    """
    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname or not _HOST.fullmatch(parts.hostname):
        raise ValueError(f"{what} must look like http://HOST[:PORT], got {url!r}")
    try:
        parts.port  # noqa: B018 - validates the port
    except ValueError as exc:
        raise ValueError(f"{what} has an invalid port: {url!r}") from exc
    return text.rstrip("/")


def resolve_metadata_url(explicit: str | None, ecosystem_var: str | None, default: str) -> str:
    """The metadata base URL in the documented order of precedence."""
    for candidate in (explicit, os.environ.get(METADATA_URL_ENV), os.environ.get(ecosystem_var or "")):
        if candidate:
            return normalise_base_url(candidate)
    return default


class MetadataResponse:
    """What the metadata clients read of an answer: status, headers (case-insensitive), body."""

    def __init__(self, status_code: int, headers: urllib3.HTTPHeaderDict, body: bytes) -> None:
        self.status_code = status_code
        self.headers = headers
        self.text = body.decode("utf-8", errors="replace")

    @property
    def ok(self) -> bool:
        return self.status_code < 400

    @property
    def date(self) -> datetime | None:
        """The server's clock when it answered (the `Date` header), or None without a usable one."""
        try:
            return parse_rfc1123(self.headers.get("Date", ""))
        except NoticeSourceError:
            return None

    def json(self) -> Any:
        return json.loads(self.text)


class MetadataTimeout(NoticeSourceError):
    """A metadata request got no answer in time; `connected` tells whether the connection was made."""

    def __init__(self, message: str, *, connected: bool) -> None:
        super().__init__(message)
        self.connected = connected


class MetadataSession:
    """Plain HTTP to a metadata service over kept-alive connections.

    Metadata services are link-local and refuse proxied requests, so proxy variables and
    .netrc never apply; there are no redirects and no retries here (the watcher owns
    backoff). The whole answer must arrive within the connect + read timeouts together:
    urllib3's read timeout is per read, which a body dripping in byte by byte never trips.
    Built on urllib3 rather than requests because node leaders poll every second per
    kind of notice: a GET costs about 0.5 ms of CPU instead of 1.2 ms.
    A request that gets no HTTP answer raises a one-line NoticeSourceError.
    """

    def __init__(self, headers: dict[str, str] | None = None) -> None:
        self._headers = dict(headers or {})
        self._pools = urllib3.PoolManager(num_pools=4, maxsize=4, retries=False)

    def request(
        self,
        method: str,
        url: str,
        *,
        timeout: float | tuple[float, float],
        headers: dict[str, str] | None = None,
        params: dict[str, Any] | None = None,
        json_body: Any = None,
    ) -> MetadataResponse:
        connect_s, read_s = timeout if isinstance(timeout, tuple) else (timeout, timeout)
        started = time.monotonic()
        query = urlencode({k: v for k, v in (params or {}).items() if v is not None}, doseq=True)
        full_url = f"{url}{'&' if '?' in url else '?'}{query}" if query else url
        try:
            answer = self._pools.request(
                method,
                full_url,
                headers={**self._headers, **(headers or {})},
                json=json_body,
                timeout=urllib3.Timeout(connect=connect_s, read=read_s),
                redirect=False,
                preload_content=False,
            )
        except urllib3.exceptions.NewConnectionError as exc:  # (a ConnectTimeoutError subclass: check it first)
            raise NoticeSourceError(f"{method} {url} failed: {_cause(exc)}") from exc
        except urllib3.exceptions.ConnectTimeoutError as exc:
            raise MetadataTimeout(f"{method} {url} failed: no answer within {connect_s:g} s", connected=False) from exc
        except urllib3.exceptions.ReadTimeoutError as exc:
            raise MetadataTimeout(f"{method} {url} failed: no answer within {read_s:g} s", connected=True) from exc
        except urllib3.exceptions.HTTPError as exc:
            raise NoticeSourceError(f"{method} {url} failed: {_cause(exc)}") from exc
        try:
            body = _read_body(answer, started + connect_s + read_s, read_s)
        except (urllib3.exceptions.ReadTimeoutError, TimeoutError) as exc:
            elapsed = time.monotonic() - started
            raise MetadataTimeout(
                f"{method} {url} failed: answer incomplete after {elapsed:.1f} s", connected=True
            ) from exc
        except urllib3.exceptions.HTTPError as exc:
            raise NoticeSourceError(f"{method} {url} failed: {_cause(exc)}") from exc
        finally:
            answer.release_conn()
        return MetadataResponse(answer.status, answer.headers, body)

    def get(self, url: str, **kwargs: Any) -> MetadataResponse:
        return self.request("GET", url, **kwargs)

    def put(self, url: str, **kwargs: Any) -> MetadataResponse:
        return self.request("PUT", url, **kwargs)

    def close(self) -> None:
        """Drop pooled connections (a later request reconnects)."""
        self._pools.clear()

    def __enter__(self) -> MetadataSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_body(answer: urllib3.BaseHTTPResponse, deadline: float, read_s: float) -> bytes:
    """The whole body, which must be in by `deadline` (time.monotonic()); TimeoutError otherwise."""
    body = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            answer.close()  # the rest is unread: the connection cannot be reused
            raise TimeoutError
        connection = answer.connection  # None once the body is complete (urllib3 released it)
        if connection is not None and connection.sock is not None:
            connection.sock.settimeout(min(read_s, left))  # the next read ends by the deadline too
        piece = answer.read1(_PIECE)
        if not piece:
            return bytes(body)
        body += piece


def _cause(exc: Exception) -> str:
    """The useful part of urllib3's message, e.g. "[Errno 111] Connection refused"."""
    found = _TRANSPORT_CAUSE.search(str(exc))
    return found.group(0).strip() if found else type(exc).__name__
