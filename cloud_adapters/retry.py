"""Bounded store calls: retries of throttling, 5xx and dropped connections, and a deadline that
also covers an attempt hanging inside the SDK (a blackholed network, a frozen server).

`RetryingStore` is the base of the S3, GCS and Azure stores. Each public method runs its SDK
call through `_call`: every attempt runs on a daemon thread and is waited for no later than the
call's deadline, which is `retry_deadline_s` after the call started or after its transfer last got
PROGRESS_BYTES further than ever before (a transfer moving bytes is not failing; one that restarts
from zero after every reset is), and never later than an enclosing `calls_until`. Transient failures are
retried with jittered exponential backoff within it; then the call raises Unreachable. Permanent
answers (missing key, precondition failed, access denied, bad request) fail at once. An attempt
that moves nothing for STALL_WARN_S (or half its deadline, when shorter) is logged once.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

from cloud_adapters.deadline import Deadline
from cloud_adapters.storage import (
    Abandoned,
    AlreadyExists,
    NotFound,
    Progress,
    StoreError,
    Unreachable,
    fill_then_rename,
    split_bucket_url,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# A spot notice leaves 30 s (GCP, Azure) to 2 min (AWS); callers near a deadline lower it.
DEFAULT_RETRY_DEADLINE_S = 60.0
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# Socket timeouts of the stores' SDK clients: a connection silent this long is dead, so a hung
# attempt also fails on its own and the next one gets a new connection (botocore applies the
# connect timeout to sending a body as well).
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 20.0
# An attempt that moves nothing for this long (or half its deadline, when shorter) is logged, once per call.
STALL_WARN_S = 10.0
# How often a waiting caller looks at its deadline, which may be brought forward meanwhile.
_CHECK_EVERY_S = 0.2
# Progress, for a call's deadline: this many bytes further than the transfer ever got. Less would
# not do: an upload over a connection that goes nowhere still hands a few MiB to socket buffers
# on every attempt, a little more or less each time.
PROGRESS_BYTES = 8 << 20

_calls_until: ContextVar[tuple[Deadline, ...]] = ContextVar("spotguard_store_calls_until", default=())


@contextlib.contextmanager
def calls_until(deadline: Deadline) -> Iterator[None]:
    """Store calls made inside end by `deadline`, whatever their retry_deadline_s; brought forward
    later, it reaches the calls already running.

    It holds in this thread and in threads run in a copy of its context (contextvars.copy_context());
    nested scopes keep the earlier moment.
    """
    token = _calls_until.set((*_calls_until.get(), deadline))
    try:
        yield
    finally:
        _calls_until.reset(token)


class RetryingStore:
    """What the bucket stores share: URL parsing, key prefixing and bounded calls.

    Subclasses implement `_is_transient(exc)` and `_translate(exc, what)`, and may implement
    `_abandon(worker)`.
    """

    scheme = ""

    def __init__(self, url: str, *, retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S) -> None:
        self.bucket, self.prefix = split_bucket_url(url)
        self.url = f"{self.scheme}://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")
        # Seconds one method may spend failing; settable at any time (e.g. to a notice's deadline),
        # and honoured by the calls already in flight too.
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
        """Run `fn` within the call's deadline, retrying transient errors; raise StoreError subclasses."""
        what = f"{what} {self.url}"
        ledger = progress or ProgressLedger(None)
        deadline = _Deadline(self, ledger)
        attempt = 0
        while True:
            attempt += 1
            try:
                return self._attempt(what, fn, deadline)
            except StoreError:
                raise
            except Exception as exc:  # noqa: BLE001 - every SDK error leaves as a StoreError
                if not self._is_transient(exc):
                    raise self._failed(self._translate(exc, what)) from exc
                pause = min(5.0, 0.2 * 2 ** (attempt - 1)) + random.uniform(0, 0.3)
                if deadline.left() > pause:
                    log.warning("%s: attempt %d failed (%s); retrying in %.1f s", what, attempt, one_line(exc), pause)
                    ledger.take_back()
                    if deadline.sleep(pause):
                        continue
                gave_up = f"gave up after {attempt} attempts in {deadline.age():.1f} s"
                raise self._failed(Unreachable(f"{what}: {one_line(exc)} ({gave_up})")) from exc

    def _attempt(self, what: str, fn: Callable[[], T], deadline: _Deadline) -> T:
        """Run `fn` once on a daemon thread and wait for it no later than the deadline.

        An SDK call can hang inside an attempt for as long as its socket timeouts and its own
        retries allow; the caller never waits for it past the deadline.
        """
        outcome: list[tuple[bool, Any]] = []
        done = threading.Event()

        def run() -> None:
            try:
                outcome.append((True, fn()))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                outcome.append((False, exc))
            finally:
                done.set()

        worker = threading.Thread(target=run, name="spotguard-store-call", daemon=True)
        started = time.monotonic()
        worker.start()
        while not done.wait(deadline.check_within(_CHECK_EVERY_S)):
            if deadline.left() <= 0:
                self._abandon(worker)
                still = time.monotonic() - deadline.moved_at()
                raise self._failed(Unreachable(f"{what}: no progress for {still:.1f} s, gave up at the deadline"))
            idle = time.monotonic() - max(started, deadline.moved_at())  # this attempt's silence
            if not deadline.stall_logged and idle >= min(STALL_WARN_S, deadline.window() / 2):
                deadline.stall_logged = True
                log.warning("%s: no progress for %.0f s (giving up in %.0f s)", what, idle, deadline.left())
        ok, value = outcome[0]
        if ok:
            return value
        raise value

    def _failed(self, error: StoreError) -> StoreError:
        if not isinstance(error, (NotFound, AlreadyExists, Abandoned)):  # the caller logs those, if anyone
            log.error("%s", error)
        return error

    def _abandon(self, worker: threading.Thread) -> None:
        """Stop what an attempt given up at the deadline still runs on `worker`, where the SDK can."""

    def _is_transient(self, exc: BaseException) -> bool:
        raise NotImplementedError

    def _translate(self, exc: BaseException, what: str) -> StoreError:
        raise NotImplementedError


class _Deadline:
    """When a call gives up: `retry_deadline_s` (read afresh, so lowering it reaches calls in flight)
    after it started or its transfer last made progress (see ProgressLedger), never after an enclosing
    `calls_until`."""

    def __init__(self, store: RetryingStore, ledger: ProgressLedger) -> None:
        self._store = store
        self._ledger = ledger
        self._started = time.monotonic()
        self._until = _calls_until.get()  # each read afresh in at(): one brought forward reaches this call
        self.stall_logged = False

    def moved_at(self) -> float:
        return max(self._started, self._ledger.moved_at)

    def window(self) -> float:
        return self.at() - self.moved_at()

    def at(self) -> float:
        at = self.moved_at() + max(self._store.retry_deadline_s, 0.0)
        return min([at, *(d.at for d in self._until if d.at is not None)])

    def left(self) -> float:
        return self.at() - time.monotonic()

    def age(self) -> float:
        return time.monotonic() - self._started

    def check_within(self, most_s: float) -> float:
        return max(0.0, min(most_s, self.left()))

    def sleep(self, seconds: float) -> bool:
        """Sleep `seconds`; False (at once) when the deadline passes first."""
        end = time.monotonic() + seconds
        while (now := time.monotonic()) < end:
            if self.left() <= 0:
                return False
            time.sleep(min(end - now, self.check_within(_CHECK_EVERY_S)) or 0.001)
        return True


class ProgressLedger:
    """Forwards byte counts to a Progress callback and can take them back when a transfer restarts.

    A restarted transfer reports a negative delta (as boto3's own transfers do), so the
    running total always equals the bytes of the attempt in flight. `moved_at` is when the
    total last went PROGRESS_BYTES past the mark it set then: progress, for a call's deadline.
    """

    def __init__(self, progress: Progress | None) -> None:
        self._progress = progress
        self._lock = threading.Lock()
        self._total = 0
        self._mark = 0
        self.moved_at = 0.0  # time.monotonic(); 0.0: never

    def __call__(self, delta: int) -> None:
        if not delta:
            return
        with self._lock:
            self._total += delta
            if self._total >= self._mark + PROGRESS_BYTES:
                self._mark, self.moved_at = self._total, time.monotonic()
        if self._progress:
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
