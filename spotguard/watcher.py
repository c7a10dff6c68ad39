"""The background watcher: one daemon thread per notice source, each polling with
backoff, reporting every distinct notice once and never raising into the caller.

A notice's identity is its `key`, which each source keeps the same for one event whatever
else moves from answer to answer (an AWS instance-action is one per instance, whatever `time`
it serves; an Azure event is its EventId). The first answer is the notice; later answers
with the same key can only bring its deadline forward: that is an update, delivered to
`on_update` and logged, never a second notice. A later deadline is ignored (the first
answer stands), because a deadline must never be later than one the cloud gave.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta

from tenacity import RetryCallState, RetryError, Retrying, retry_if_exception_type, wait_exponential, wait_random

from cloud_adapters import validation as check
from cloud_adapters.detect import detect_cloud
from cloud_adapters.notice import Notice, NoticeSource, isoformat_z, utc_now
from cloud_adapters.signals import SignalSource
from cloud_adapters.sources import cloud_sources
from spotguard.options import NoticeOptions, caller_stacklevel

log = logging.getLogger(__name__)

# An advisory whose deadline passed longer ago than this is a leftover, not news: it is logged
# once and ignored. Never an interruption: while the cloud serves one, the host's clock may be what is off.
STALE_AFTER = timedelta(minutes=10)
# Deadlines read from whole-second clocks jitter by up to a second from poll to poll: not an update.
UPDATE_SLACK_S = 1.0


@dataclasses.dataclass(frozen=True)
class _Delivered:
    source: NoticeSource
    notice: Notice  # as delivered, with the earliest deadline seen since


class Watcher:
    """Polls `sources` on background threads and calls `on_notice` once per distinct notice.

    Non-blocking sources are polled every `interval_s` (times their `poll_every`, if
    they have one); blocking ones (hanging GETs, signals) are called back to back.
    A failing source is retried with exponential backoff and jitter, up to `max_backoff_s`
    for advisory sources (`advisory = True`) and up to `interval_s` for all others, so
    an interruption is seen within one interval of a fault ending. Its error is logged
    once (and again only when it changes), and its recovery is logged too. One failing
    source never stops the others. `on_update` gets a delivered notice again when its
    deadline moved earlier (see the module's docstring).
    """

    def __init__(
        self,
        sources: Sequence[NoticeSource],
        on_notice: Callable[[Notice], None],
        *,
        interval_s: float = 1.0,
        max_backoff_s: float = 30.0,
        on_update: Callable[[Notice], None] | None = None,
    ) -> None:
        self.sources = list(sources)
        self.on_notice = on_notice
        self.on_update = on_update
        self.interval_s = check.seconds("interval_s", interval_s)
        self.max_backoff_s = check.seconds("max_backoff_s", max_backoff_s)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._seen: dict[str, _Delivered] = {}  # delivered (or stale) notices, by key
        self._failed: set[str] = set()  # notices whose callback failed: retried at each poll
        self._lock = threading.Lock()

    def start(self) -> Watcher:
        for source in self.sources:
            thread = threading.Thread(
                target=self._run, args=(source,), name=f"spotguard-watch-{source.name}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        log.info("watching %s", ", ".join(s.name for s in self.sources) or "nothing")
        return self

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stop polling. Waits at most `timeout_s` in all: a thread inside a hanging GET
        is a daemon and ends when its request returns, so it never holds up the exit."""
        self._stop.set()
        for source in self.sources:  # a blocking source that can be woken returns from its poll at once
            wake = getattr(source, "wake", None)
            if wake is not None:
                wake()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self._threads.clear()
        for source in self.sources:
            try:
                source.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                log.debug("closing %s failed", source.name, exc_info=True)

    def __enter__(self) -> Watcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def ack(self, notice: Notice) -> None:
        """Tell the cloud we are ready (Azure StartRequests); a no-op for sources without acks."""
        delivered = self._seen.get(notice.key)
        ack = getattr(delivered.source if delivered else None, "ack", None)
        if ack is None:
            return
        try:
            ack(notice)
            log.info("acknowledged %s to %s", notice.key, notice.cloud)
        except Exception as exc:  # noqa: BLE001 - the platform proceeds at NotBefore anyway
            log.warning("could not acknowledge %s: %s", notice.key, exc)

    # ---- per-source loop ------------------------------------------------------
    def _run(self, source: NoticeSource) -> None:
        failure = _FailureLog(source.name)
        step = min(self.interval_s, 1.0)
        cap = self.max_backoff_s if getattr(source, "advisory", False) else min(self.max_backoff_s, self.interval_s)
        # Jitter keeps the nodes of a big job from hammering a throttled metadata service in step.
        backoff = wait_exponential(multiplier=step, max=cap) + wait_random(0, step)
        retrying = Retrying(
            retry=retry_if_exception_type(Exception),
            wait=lambda state: min(cap, backoff(state)),
            stop=lambda _: self._stop.is_set(),
            sleep=self._stop.wait,
            before_sleep=failure.record,
        )
        try:
            prime = getattr(source, "prime", None)
            if prime is not None:  # Azure: the first call after boot can take minutes, and may hold a notice
                self._report(source, retrying(prime))
            pause = self.interval_s * max(1, getattr(source, "poll_every", 1))  # never a busy loop
            while not self._stop.is_set():
                self._report(source, retrying(source.poll))
                failure.recovered()
                if not source.blocking:
                    self._stop.wait(pause)
        except RetryError:
            pass  # stopped while the source was failing

    def _report(self, source: NoticeSource, notice: Notice | None) -> None:
        """Deliver a notice once. A notice is marked seen only once the callback took it, so a
        callback that failed (a store hiccup while publishing) gets the notice again on the
        next poll instead of losing the interruption."""
        if notice is None:
            return
        with self._lock:
            known = self._seen.get(notice.key)
        if known is not None:
            self._update(known, notice)
            return
        if not notice.is_interruption and notice.deadline is not None and utc_now() - notice.deadline > STALE_AFTER:
            self._mark_seen(source, notice)
            log.warning(
                "ignoring a stale %s notice from %s: its deadline %s passed more than %s ago",
                notice.kind,
                notice.source,
                notice.deadline.isoformat(),
                STALE_AFTER,
            )
            return
        retry = notice.key in self._failed
        if not retry:
            log.warning(
                "%s notice from %s: action=%s, deadline %s",
                notice.kind,
                notice.source,
                notice.action,
                notice.describe_deadline(),
            )
        try:
            self.on_notice(notice)
        except Exception:  # noqa: BLE001 - a broken callback must not kill the watcher
            if not retry:
                log.exception("notice callback failed for %s; trying again at the next poll", notice.key)
            self._failed.add(notice.key)
            return
        self._mark_seen(source, notice)

    def _mark_seen(self, source: NoticeSource, notice: Notice) -> None:
        with self._lock:
            self._seen[notice.key] = _Delivered(source, notice)
        self._failed.discard(notice.key)

    def _update(self, known: _Delivered, notice: Notice) -> None:
        """The same notice seen again: only a deadline brought forward counts."""
        if not notice.earlier_than(known.notice, UPDATE_SLACK_S):
            return
        updated = dataclasses.replace(known.notice, deadline=notice.deadline, detail=notice.detail)
        with self._lock:
            self._seen[notice.key] = _Delivered(known.source, updated)
        log.warning(
            "%s notice from %s updated: deadline moved earlier, %s -> %s (%s)",
            notice.kind,
            notice.source,
            isoformat_z(known.notice.deadline) if known.notice.deadline else "none",
            isoformat_z(notice.deadline),  # type: ignore[arg-type]  # earlier_than: it has one
            updated.describe_deadline(),
        )
        if self.on_update is not None:
            try:
                self.on_update(updated)
            except Exception:  # noqa: BLE001 - a broken callback must not kill the watcher
                log.exception("notice update callback failed for %s", notice.key)


class _FailureLog:
    """Logs a source's error once (and again when it changes), then its recovery."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.count = 0
        self.last = ""

    def record(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        message = f"{type(exc).__name__}: {exc}"
        self.count += 1
        wait = state.next_action.sleep if state.next_action else 0.0
        if message != self.last:
            log.warning("%s poll failed (%s); retrying with backoff, next in %.1f s", self.name, message, wait)
            self.last = message
        else:
            log.debug("%s poll failed again (%d times): %s", self.name, self.count, message)

    def recovered(self) -> None:
        if self.count:
            log.warning("%s recovered after %d failed polls", self.name, self.count)
            self.count = 0
            self.last = ""


def add_sources(sources: list[NoticeSource], notices: NoticeOptions, *, node_leader: bool) -> None:
    """A guard's notice sources: signals on every rank (from the main thread, where handlers can be
    installed), the cloud's metadata on each node's leader. `sources` is filled as each is made, so a
    failure half-way still lets teardown close them all."""
    if threading.current_thread() is threading.main_thread():
        signals = SignalSource(notices.signals, grace_s=notices.grace_s)
        sources.append(signals)
        signals.install()
    else:
        warnings.warn("Guard started outside the main thread: signals are not watched", stacklevel=caller_stacklevel())
    if node_leader:
        cloud = detect_cloud(notices.metadata_url) if notices.cloud == "auto" else notices.cloud
        sources += cloud_sources(cloud, notices.metadata_url)
