"""Bounded retries for object stores: throttling, 5xx and dropped connections, never forever.

`RetryingStore` is the base of the S3, GCS and Azure stores. Each public method runs
its SDK call through `_call`: transient failures are retried with jittered
exponential backoff, but no new attempt starts once `retry_deadline_s` seconds have
passed since the first one; then the last error becomes a StoreError. Permanent
answers (missing key, precondition failed, access denied, bad request) fail at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

import tenacity

from cloud_adapters.storage import (
    Abandoned,
    AlreadyExists,
    NotFound,
    Progress,
    StoreError,
    fill_then_rename,
    split_bucket_url,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# A spot notice leaves 30 s (GCP, Azure) to 2 min (AWS); callers near a deadline lower it.
DEFAULT_RETRY_DEADLINE_S = 60.0
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class RetryingStore:
    """What the bucket stores share: URL parsing, key prefixing and bounded retries.

    Subclasses implement `_is_transient(exc)` and `_translate(exc, what)`.
    """

    scheme = ""

    def __init__(self, url: str, *, retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S) -> None:
        self.bucket, self.prefix = split_bucket_url(url)
        self.url = f"{self.scheme}://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")
        # Seconds one method may spend retrying; settable at any time (e.g. to a notice's deadline),
        # and honoured by the calls already retrying too.
        self.retry_deadline_s = retry_deadline_s

    def _name(self, key: str) -> str:
        """The full object name of a key relative to the store's prefix."""
        key = key.lstrip("/")
        if not key:
            raise ValueError("an object key must not be empty")
        return f"{self.prefix}/{key}" if self.prefix else key

    def _list_prefix(self, prefix: str) -> str:
        root = f"{self.prefix}/" if self.prefix else ""
        return root + prefix.lstrip("/")

    def _key(self, name: str) -> str:
        """The key relative to the store's prefix of a full object name."""
        return name[len(self.prefix) + 1 :] if self.prefix else name

    # Downloads fill a temporary sibling, renamed into place only on success.
    _download_into = staticmethod(fill_then_rename)

    def _call(self, what: str, fn: Callable[[], T], *, progress: ProgressLedger | None = None) -> T:
        """Run `fn`, retrying transient errors within `retry_deadline_s`; raise StoreError subclasses."""
        what = f"{what} {self.url}"

        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning(
                "%s: attempt %d failed (%s); retrying in %.1f s",
                what,
                state.attempt_number,
                one_line(exc),
                state.next_action.sleep if state.next_action else 0.0,
            )
            if progress:
                progress.take_back()

        def out_of_time(state: tenacity.RetryCallState) -> bool:
            # Read at every failure, so lowering retry_deadline_s also stops the calls already retrying.
            return (state.seconds_since_start or 0.0) + state.upcoming_sleep >= max(self.retry_deadline_s, 0.0)

        retrying = tenacity.Retrying(
            stop=out_of_time,
            wait=tenacity.wait_exponential(multiplier=0.2, max=5.0) + tenacity.wait_random(0, 0.3),
            retry=tenacity.retry_if_exception(lambda e: not isinstance(e, StoreError) and self._is_transient(e)),
            before_sleep=before_sleep,
            reraise=True,
        )
        try:
            return retrying(fn)
        except StoreError:
            raise
        except Exception as exc:  # noqa: BLE001 - every SDK error leaves as a StoreError
            error = self._translate(exc, what)
            if not isinstance(error, (NotFound, AlreadyExists, Abandoned)):  # the caller logs those, if anyone
                log.error("%s", error)
            raise error from exc

    def _is_transient(self, exc: BaseException) -> bool:
        raise NotImplementedError

    def _translate(self, exc: BaseException, what: str) -> StoreError:
        raise NotImplementedError


class ProgressLedger:
    """Forwards byte counts to a Progress callback and can take them back when a transfer restarts.

    A restarted transfer reports a negative delta (as boto3's own transfers do), so the
    running total always equals the bytes of the attempt in flight.
    """

    def __init__(self, progress: Progress | None) -> None:
        self._progress = progress
        self._lock = threading.Lock()
        self._total = 0

    def __call__(self, delta: int) -> None:
        if self._progress and delta:
            with self._lock:
                self._total += delta
            self._progress(delta)

    def take_back(self) -> None:
        with self._lock:
            total, self._total = self._total, 0
        if self._progress and total:
            self._progress(-total)


def one_line(exc: BaseException | None) -> str:
    """An exception as one short line for logs and StoreError messages."""
    if exc is None:
        return "unknown error"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}".rstrip(": ")
