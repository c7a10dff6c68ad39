"""Where a metadata service lives (flag, then SPOTGUARD_METADATA_URL, then the cloud's own
variable), the HTTP session every metadata client uses to reach it, and the one-line error
they raise when it does not answer."""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit

import requests

from cloud_adapters.notice import NoticeSourceError

METADATA_URL_ENV = "SPOTGUARD_METADATA_URL"
# The useful part of a requests/urllib3 connection error, e.g. "[Errno 111] Connection refused".
_TRANSPORT_CAUSE = re.compile(
    r"\[Errno -?\d+\] [^'\")]+|Remote end closed connection without response|Connection reset by peer"
)


def normalise_base_url(url: str, *, what: str = "metadata URL") -> str:
    """Accept `http://host[:port]` (or a bare `host[:port]`) and return it without a trailing slash.

    Raises ValueError with a one-line reason for anything else, so a user's typo
    is reported at start-up rather than as a connection error on every poll.
    """
    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
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


def metadata_session(headers: dict[str, str] | None = None) -> requests.Session:
    """A session that goes to the metadata service directly.

    Metadata services are link-local and refuse proxied requests (X-Forwarded-For), so
    proxy variables and .netrc from the environment are never used.
    """
    session = requests.Session()
    session.trust_env = False
    session.headers.update(headers or {})
    return session


def transport_error(what: str, exc: requests.RequestException, timeout_s: float) -> NoticeSourceError:
    """A one-line error for a metadata request that got no HTTP answer (not urllib3's whole chain)."""
    if isinstance(exc, requests.Timeout):
        reason = f"no answer within {timeout_s:g} s"
    else:
        cause = _TRANSPORT_CAUSE.search(str(exc))
        reason = cause.group(0).strip() if cause else type(exc).__name__
    return NoticeSourceError(f"{what} failed: {reason}")
