"""What a guard records for the goodput report, and the adaptive save cadence fed by it.

Global rank 0 writes the ledger (`spotguard.goodput.ledger`) and runs the interval timer, so its cadence
(`save_interval_s="auto"`) is the one that learns from the saves measured; every other rank records
nothing. The records are the typed ones of `spotguard.goodput.records`, which `spotguard report` reads.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from cloud_adapters.notice import REBALANCE, Notice, isoformat_z
from cloud_adapters.storage import ObjectStore
from spotguard import __version__
from spotguard.checkpoint import SaveReport
from spotguard.ending.exit_policy import UNAVAILABLE_EXIT_CODE
from spotguard.goodput import records
from spotguard.goodput.cadence import Cadence, Choice
from spotguard.goodput.ledger import Ledger, LedgerContents
from spotguard.goodput.report import INTERRUPTED, summarize
from spotguard.health.monitor import PreviousEnd, SilentFailure
from spotguard.job.topology import Topology
from spotguard.options import SaveOptions

log = logging.getLogger(__name__)

# The reasons of background saves whose stall the cadence weighs (an emergency's is not a choice).
CADENCE_SAVES = ("periodic", "interval", "rebalance")


class GoodputRecorder:
    """One guard's ledger records (once `open` has made the ledger: rank 0) and its cadence."""

    def __init__(self, cadence: Cadence | None) -> None:
        self.cadence = cadence
        self._ledger: Ledger | None = None
        self._history_read = False
        self._history: tuple[int, float] | None = None  # (interruptions, hours) the ledger's history holds
        self._followers: list[Cadence] = []  # the cadences fed with it (the saves' and the snapshots')
        self.on_open: Callable[[str], None] = lambda segment: None  # told rank 0's ledger segment once open
        if cadence is not None:
            cadence.on_change = self._on_cadence

    def open(
        self, store: ObjectStore, progress: Callable[[], int | None], where: Topology, saving: SaveOptions
    ) -> None:
        """Rank 0's ledger, and this segment's first record."""
        self._ledger = Ledger(store, progress=progress)
        self.on_open(self._ledger.segment)
        self._ledger.record(
            records.Start(
                world_size=where.world_size,
                node=where.node,
                save_interval_s=saving.save_interval_s,
                save_every=saving.save_every,
                version=__version__,
            )
        )

    def open_for_the_end(self, store: ObjectStore | None, segment: str) -> None:
        """A ledger for the end of rank 0's `segment` (a new segment when "": unknown), on a rank that records
        that end in rank 0's place (rank 0 is stuck)."""
        if self._ledger is None and store is not None:
            self._ledger = Ledger(store, tail_of=segment or None)

    def segment(self) -> str:
        """This rank's ledger segment: rank 0's, once its ledger is open; else ""."""
        return self._ledger.segment if self._ledger is not None else ""

    def previous_end(self) -> PreviousEnd | None:
        """How the job's previous start ended, if a silent failure ended it (rank 0, once the ledger's
        history is read; None elsewhere)."""
        history = self._ledger.history(timeout=2.0) if self._ledger is not None else None
        if not history:
            return None
        previous = [r for r in history if r.segment == history[-1].segment]
        end = next((r for r in reversed(previous) if isinstance(r, records.SilentEnd)), None)
        return PreviousEnd(end.cause, end.last_step) if end is not None else None

    def reset(self) -> None:
        """A guard started again: a new segment, whose ledger `open` makes; its history is read afresh."""
        self._ledger = None
        self._history_read = False

    def resumed(
        self,
        step: int | None,
        next_step: int,
        resume_s: float,
        run: str | None,
        tier: str | None = None,
        resharded: tuple[int, int] | None = None,
    ) -> None:
        self._record(
            records.Resume(
                step=step,
                next_step=next_step,
                resume_s=resume_s,
                run=run,
                tier=tier,
                resharded=list(resharded) if resharded else None,
            )
        )

    def saved(self, step: int, reason: str, report: SaveReport | None, error: str | None) -> None:
        """After every save (any thread): its measurements into the ledger and the cadence."""
        if self._ledger is None:
            return
        measured: dict[str, Any] = {}
        if report is not None:
            measured = {
                "bytes": report.bytes,
                "stall_s": report.stall_s,
                "write_s": report.write_s,
                "commit_s": report.commit_s,
                "upload_s": report.upload_s,
                "streamed_bytes": report.streamed_bytes,
                "durable": report.durable,
            }
        self._ledger.record(records.Save(step=step, reason=reason, ok=report is not None, error=error, **measured))
        if self.cadence is not None and report is not None and reason in CADENCE_SAVES:
            self.cadence.observe_save(report.stall_s)

    def notice(self, notice: Notice, **outcome: Any) -> None:
        """An interruption and what became of it (`agreed_step=None`: no agreement)."""
        self._record(
            records.NoticeSeen(
                kind=notice.kind,
                cloud=notice.cloud,
                action=notice.action,
                source=notice.source,
                node=notice.node,
                deadline=isoformat_z(notice.deadline) if notice.deadline else None,
                detected_at=isoformat_z(notice.detected_at),
                **outcome,
            )
        )

    def emergency(self, notice: Notice, step: int, report: SaveReport | None, leaving: frozenset[int]) -> None:
        """An interruption acted on at `step`, and its save's outcome (`report` None: nothing committed)."""
        margin_s = None  # seconds left before the deadline when it was safe (None: lost, or no deadline)
        if report is not None and notice.deadline is not None:
            margin_s = report.margin_s if report.margin_s is not None else notice.seconds_left()
        self.notice(
            notice,
            agreed_step=step,
            committed=report is not None,
            durable=report is not None and report.durable,
            margin_s=margin_s,
            leaving=tuple(sorted(leaving)),
        )

    def rebalance(self, agreed_step: int | None) -> None:
        self._record(records.NoticeSeen(kind=REBALANCE, agreed_step=agreed_step))
        for cadence in {self.cadence, *self._followers} - {None}:
            cadence.observe_interruption()

    def ended(
        self,
        code: int | None,
        error: BaseException | None,
        *,
        interrupted: bool,
        committed: bool,
        last_step: int | None,
        why: str | None = None,
    ) -> None:
        """The segment's last record: why it ends (`why`, else from the other arguments), and the exit code
        spotguard ends it with (None: it returns to the caller)."""
        why = why or (INTERRUPTED if interrupted else "finished" if error is None else f"error: {type(error).__name__}")
        if isinstance(error, SystemExit):
            code = error.code if isinstance(error.code, int) else 1
            why = "storage unavailable" if code == UNAVAILABLE_EXIT_CODE else "exit"
        self._record(records.Exit(code=code, why=why, committed=committed, last_step=last_step))

    def recovered(self, **fields: Any) -> None:
        """An in-process recovery began this segment (`records.Recovered`'s fields)."""
        known = {f.name for f in dataclasses.fields(records.Recovered)} - {"segment", "seq", "at"}
        self._record(records.Recovered(**{k: v for k, v in fields.items() if k in known}))

    def silent_failure(self, failure: SilentFailure, code: int | None, *, last_step: int | None) -> None:
        """A failure without a notice ends the segment: what it was, then the exit record (`code` None: the job
        goes on in this process, and the guard's close writes it)."""
        if failure.step is not None:  # a hang's step as judged (the furthest any rank reported)
            last_step = failure.step
        known = {f.name for f in dataclasses.fields(records.SilentEnd)}
        said = {k: v for k, v in dataclasses.asdict(failure).items() if k in known and k != "last_step"}
        self._record(records.SilentEnd(**said, last_step=last_step))
        if code is not None:
            self._record(records.Exit(code=code, why=failure.cause, committed=False, last_step=last_step))

    def next_interval(self, run_hours: float, cadence: Cadence | None = None) -> float:
        """The interval of an adaptive cadence (the saves', or `cadence`: the snapshots') now, having
        weighed the ledger's history once it is read."""
        cadence = cadence or self.cadence
        assert cadence is not None
        if cadence not in self._followers:
            self._followers.append(cadence)
            if self._history is not None:
                cadence.observe_history(*self._history)
        history = self._ledger.history() if self._ledger is not None and not self._history_read else None
        if history is not None:
            self._history_read = True
            try:
                done = summarize(LedgerContents(history, 0))
                hours = sum(s["wall_s"] for s in done.get("segment_details", [])) / 3600
                self._history = (done["interruptions"], hours)
                for follower in self._followers:
                    follower.observe_history(*self._history)
            except Exception as exc:  # noqa: BLE001 - a ledger this version cannot read: the prior alone decides
                log.warning("the adaptive interval ignores the ledger's history: %s: %s", type(exc).__name__, exc)
        return cadence.interval(run_hours)

    def close(self, timeout_s: float = 10.0) -> None:
        if self._ledger is not None:
            self._ledger.close(timeout_s=timeout_s)

    def _on_cadence(self, choice: Choice) -> None:
        self._record(records.CadenceChange(**choice.to_json()))

    def _record(self, record: records.Record) -> None:
        if self._ledger is not None:
            self._ledger.record(record)
