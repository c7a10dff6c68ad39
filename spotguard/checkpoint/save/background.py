"""Background saves: one at a time on one worker thread, each racing its own deadline.

A save with a deadline (an emergency) takes over from the background save in flight: that one's
deadline is brought forward to now, so its uploads and store calls stop at once (its committed
local copy is kept), and it is waited for only until the new save's deadline.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from cloud_adapters.deadline import Deadline
from spotguard.checkpoint.errors import CheckpointError
from spotguard.checkpoint.outcome import SaveReport

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class InFlight:
    """The background save running now."""

    step: int
    future: Future
    deadline: Deadline


class BackgroundSaves:
    def __init__(self) -> None:
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spotguard-ckpt")
        self._pending: InFlight | None = None
        self.uploads_abandoned = False  # an emergency is coming: background saves commit locally only

    def submit(
        self,
        step: int,
        save: Callable[[Deadline], SaveReport],
        deadline: Deadline,
        on_done: Callable[[Future], None],
    ) -> None:
        if self.uploads_abandoned:
            deadline.bring_forward(time.monotonic())
        future = self._worker.submit(save, deadline)
        future.add_done_callback(on_done)
        self._pending = InFlight(step, future, deadline)

    def abandon_uploads(self) -> None:
        """An emergency has been agreed (any thread, every rank alike): the save in flight, and any
        started before the emergency step, stop uploading at once and keep their local commit."""
        self.uploads_abandoned = True
        pending = self._pending
        if pending is not None and not pending.future.done():
            log.warning("an emergency is coming: the background save of step %d stops uploading", pending.step)
            pending.deadline.bring_forward(time.monotonic())

    def wait(self, timeout: float | None = None) -> SaveReport | None:
        """Finish the save in flight; its report, or None when none was in flight."""
        pending = self._pending
        if pending is None:
            return None
        report = pending.future.result(timeout)
        self._pending = None
        return report

    def finish(self, deadline: Deadline | None = None) -> None:
        """Let the save in flight finish first (its collectives must not interleave with the next save's).

        When the next save has a deadline, the one in flight stops uploading now, on every rank alike,
        so that it only runs its remaining collectives, and it is waited for until that deadline at
        most: CheckpointError then.
        """
        pending = self._pending
        if pending is None:
            return
        timeout = None
        if deadline is not None and deadline.at is not None and not pending.future.done():
            log.warning(
                "a save with a deadline takes over from the background save of step %d: its upload stops now "
                "(its committed local copy is kept)",
                pending.step,
            )
            pending.deadline.bring_forward(time.monotonic())
            timeout = max(0.0, deadline.left())
        try:
            self.wait(timeout)
        except TimeoutError as exc:  # still in its collectives: ours must not start
            raise CheckpointError(
                f"the background save of step {pending.step} was still finishing at the deadline; not saving again"
            ) from exc
        except Exception as exc:  # the next save goes ahead regardless
            log.error("the previous background save failed: %s", exc)
        self._pending = None

    def shutdown(self) -> None:
        self._worker.shutdown(wait=True)
