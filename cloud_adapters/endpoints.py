"""Where a metadata service lives (flag, then SPOTGUARD_METADATA_URL, then the cloud's own
variable) and the HTTP session every metadata client uses to reach it."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

import requests

METADATA_URL_ENV = "SPOTGUARD_METADATA_URL"


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
