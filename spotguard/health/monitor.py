"""One guard's watch for silent failures, and the job-wide decision to end.

A node leader that declares its watched node lost (`liveness`), or a rank whose loop stopped stepping
(`hangs`), announces a silent failure through the job's event log, once per job (a claim in the store).
Every rank's listener reads it: for a hang every rank first writes its threads' stacks to its log and its
line to the report; rank 0 judges (the ranks that hold the others up, and whether the previous start of
the job hung at the same step) or, when rank 0 does not answer, whichever other rank claims the judging;
the other ranks read that verdict for their exit file; then every rank ends (`end`, given by the guard:
the exit file, the ledger, the restart code). A judge other than rank 0 also records the end in rank 0's
place; the ranks of rank 0's node claim the judging first, so that a judge writes that node's exit file.
When the store does not take the announcement, the rank that saw the failure ends alone: its neighbours
see its connections close and fail their collectives, or time out in turn.

The end never waits on anything the training process may be stuck on: the report goes over the
listener's store connection (made at the start; the report runs on the listener thread), every store
write of the report comes before its log lines, and from the moment a failure is concluded a backstop
ends the process within END_WITHIN_S (the exit file, then the exit, no log write) should a log write on
a full output pipe, the report or the ledger hold the end up.

A phase declared long on one rank, and an evaluation's heartbeats, are the job's (`job_phase`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from spotguard.health import stacks
from spotguard.health.hangs import HangSeen, HangWatch
from spotguard.health.job_phase import JobPhase
from spotguard.health.liveness import Liveness, PeerLoss
from spotguard.job.kvstore import Connection
from spotguard.job.topology import Topology, layout_said, node_count, ranks_per_node

log = logging.getLogger(__name__)

PEER_LOST = "peer-lost"
HANG = "hang"
GATHER_S = 5.0  # how long the judge waits for every rank's line in a hang's report
# When a rank that is not rank 0 claims the judging, if no verdict came: rank 0's node first (its exit file).
CLAIM_S = (2 * GATHER_S, 3 * GATHER_S)
END_WITHIN_S = 6 * GATHER_S  # from a failure concluded to the exit, whatever blocks (the report: 4 x GATHER_S)


@dataclasses.dataclass(frozen=True)
class SilentFailure:
    """Why a job ends without a notice (the event every rank reads, the exit file's and the ledger's cause)."""

    cause: str  # PEER_LOST or HANG
    culprit: str  # the lost node, or the ranks that held the others up ("" when none could be named)
    noticed_after_s: float  # the silence, or the stall, when it was declared
    seen_by: str  # the node (a loss) or the rank (a hang) that saw it first
    repeated: bool = False  # a hang at the step the previous start of the job hung at: restarting is no cure
    step: int | None = None  # a hang's step as judged: the furthest any rank reported
    node_index: int | None = None  # a lost node's place in the ring (its ranks: that block of the job's)

    def describe(self) -> str:
        if self.cause == PEER_LOST:
            return f"node {self.culprit} lost (silent for {self.noticed_after_s:.1f} s, seen by {self.seen_by})"
        held = f"held up by {self.culprit}" if self.culprit else "no rank could be named"
        again = "; the previous start hung at the same step" if self.repeated else ""
        return f"training hung ({self.noticed_after_s:.1f} s without a step; {held}{again})"


@dataclasses.dataclass(frozen=True)
class Ending:
    """How this rank ends a failure (crosses from the thread that concluded it to the guard's end)."""

    failure: SilentFailure  # as judged, for a hang
    speaks_for: str | None = None  # rank 0's ledger segment, when this rank judged in its place ("": unknown)
    ledger: bool = True  # False: rank 0 lost the judging to a rank that records the end in its place
    goes_on: tuple[int, ...] = ()  # the ranks the job goes on with in their processes (in-process recovery)


@dataclasses.dataclass(frozen=True)
class PreviousEnd:
    """How the job's previous start ended, when a silent failure ended it (the ledger's record)."""

    cause: str
    last_step: int | None


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The judge's word on a hang (crosses ranks through the store, as JSON)."""

    culprit: str
    repeated: bool
    step: int | None  # the furthest step any rank reported
    segment: str  # rank 0's ledger segment, where a judge in its place records the end ("" when unknown)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, raw: bytes) -> Verdict:
        return cls(**json.loads(raw))


class Health:
    """`record(ending)` writes what a silent end leaves behind (the exit file, the ledger, the agent's
    withdrawal) and writes nothing to the log; `end(ending)` then says why in the log and ends this
    process (it does not return); `end_now(ending)` is the backstop's: `record` and the exit, nothing more.
    `beats()` and `last_step()` read the loop's heartbeat (guard.step()); `previous_end()` says how the
    job's previous start ended, where this rank knows (the ledger's reader, rank 0); `segment()` is this
    rank's ledger segment (rank 0's, else ""). `peer_timeout_s` / `hang_timeout_s`: 0 switches that
    watch off."""

    def __init__(
        self,
        topology: Topology,
        *,
        peer_timeout_s: float,
        hang_timeout_s: float | str,
        beats: Callable[[], int],
        last_step: Callable[[], int | None],
        record: Callable[[Ending], None],
        end: Callable[[Ending], None],
        end_now: Callable[[Ending], None],
        previous_end: Callable[[], PreviousEnd | None] = lambda: None,
        segment: Callable[[], str] = lambda: "",
        goes_on: Callable[[SilentFailure], tuple[int, ...]] = lambda failure: (),
    ) -> None:
        self.topology = topology
        self.peer_timeout_s = peer_timeout_s
        self.record = record
        self.end = end
        self.end_now = end_now
        self.last_step = last_step
        self.previous_end = previous_end
        self.segment = segment
        self.goes_on = goes_on
        self.hangs = (
            None
            if not hang_timeout_s
            else HangWatch(
                hang_timeout_s,
                beats=beats,
                last_step=last_step,
                on_hang=self._hang,
                job_progress=self._job_progress,
                on_phase_over=self._phase_over,
            )
        )
        self.liveness: Liveness | None = None
        self.job: JobPhase | None = None
        self._publish: Callable[[dict[str, Any]], bool] | None = None
        self._listening: Callable[[], bool] = lambda: False
        self._conn: Connection | None = None  # the listener's, made at the start: the report runs on its thread
        self._short: Connection | None = None  # for short requests from any thread
        self._prefix = ""
        self._ending = threading.Lock()
        self._ending_now: Ending | None = None  # the end under way, as judged so far (the backstop's)
        self._recovered = threading.Event()  # an end that goes on in-process got the training thread back
        self._alive_said = 0.0  # when this rank last told the job that its loop works without stepping

    def start(
        self,
        store: dist.Store,
        prefix: str,
        *,
        connections: tuple[Connection, Connection],
        publish: Callable[[dict[str, Any]], bool],
        listening: Callable[[], bool],
        excused: Callable[[str], bool],
    ) -> None:
        """`connections`: this rank's own store clients, made at the start (never the job's, which a hung loop
        may be waiting on): one for short requests from any thread, and the listener's, for the hang's report
        (on_event runs on the listener thread). `publish` announces a failure to every rank's listener;
        `listening()`: whether this rank's still reads (after a rank left its guard none does, and this rank
        ends alone)."""
        self._short, self._conn = connections
        self._prefix, self._publish, self._listening = f"{prefix}health/", publish, listening
        per_node, nodes = ranks_per_node(), node_count(self.topology.world_size)
        if nodes is None:
            log.warning("%s does not fit the world size %d: no liveness ring", layout_said(), self.topology.world_size)
        elif self.peer_timeout_s and nodes > 1 and self.topology.rank % per_node == 0:
            self._join_ring(store, prefix, excused, per_node, nodes)
        if self.hangs is not None:
            self.job = JobPhase(self._short, self._prefix, self.last_step)
            self.hangs.start()
        self.publish_segment(self.segment())

    def publish_segment(self, segment: str) -> None:
        """Rank 0's ledger segment, once open: where a judge in rank 0's place records the end."""
        if self.topology.rank == 0 and segment and self._short is not None:
            self._short.store.set(self._prefix + "segment", segment)

    def _join_ring(
        self, store: dist.Store, prefix: str, excused: Callable[[str], bool], per_node: int, nodes: int
    ) -> None:
        try:
            self.liveness = Liveness(
                store,
                prefix,
                index=self.topology.rank // per_node,
                count=nodes,
                node=self.topology.node,
                timeout_s=self.peer_timeout_s,
                on_lost=self._peer_lost,
                excused=excused,
            )
            self.liveness.start()
        except OSError as exc:  # never keep the training from starting: this node is then not in the ring
            log.warning("node %s cannot join the liveness ring (%s): its losses go unnoticed", self.topology.node, exc)
            self.liveness = None

    def stop(self) -> None:
        if self.liveness is not None:
            self.liveness.stop()
        if self.hangs is not None:
            self.hangs.stop()
        if self.job is not None:
            self.job.stop()

    # ---- the training thread ---------------------------------------------------------------------
    def recovered(self) -> None:
        """The training thread left the step a lost node held up, and its guard closed: the job goes on in
        this process, and the backstop stands down."""
        self._recovered.set()

    def hold_if_ending(self) -> None:
        """A silent end under way owns the process's exit (its code, its records): a training thread that
        fails meanwhile (a collective whose peer just ended) waits here for it instead of exiting with 1. Not
        when the job goes on in this process: its training thread left the step for that."""
        if self._ending_now is not None and not self._ending_now.goes_on:
            threading.Event().wait()  # the end, or its backstop, ends the process within END_WITHIN_S

    def busy(self) -> contextlib.AbstractContextManager[None]:
        return self.hangs.busy() if self.hangs is not None else contextlib.nullcontext()

    def allow(self, seconds: float) -> None:
        """A long phase, for every rank's watch: the others may wait for this one in their next collective."""
        if self.hangs is not None and self.job is not None:
            self.hangs.allow(seconds)
            self.job.declare(seconds)

    def alive(self) -> None:
        """The loop works without stepping; the job is told at most every quarter of the timeout."""
        if self.hangs is None or self.job is None:
            return
        self.hangs.alive()
        now = time.monotonic()
        if now - self._alive_said >= self.hangs.timeout_s / 4:
            self._alive_said = now
            self.job.alive()

    @contextlib.contextmanager
    def phase(self) -> Iterator[None]:
        """Around a phase declared with `allow`: its end counts as a step, on this rank and for the job."""
        if self.hangs is None or self.job is None:
            yield
            return
        try:
            with self.hangs.phase():
                yield
        finally:
            self.job.ended()

    def _phase_over(self) -> None:
        """The hang watch saw this rank step past the phase it declared: it is over for the job too."""
        if self.job is not None:
            self.job.ended()

    # ---- the watches' threads --------------------------------------------------------------------
    def _job_progress(self) -> float | None:
        """`job_phase`'s latest word, on the hang watch's clock."""
        wall = self.job.latest() if self.job is not None and self.hangs is not None else None
        return None if wall is None else self.hangs.clock() - (time.time() - wall)  # type: ignore[union-attr]

    def _peer_lost(self, loss: PeerLoss) -> None:
        self._announce(SilentFailure(PEER_LOST, loss.node, loss.silent_s, loss.watcher, node_index=loss.index))

    def _hang(self, seen: HangSeen) -> None:
        self._announce(SilentFailure(HANG, "", seen.stalled_s, f"rank {self.topology.rank}", step=seen.last_step))

    def _announce(self, failure: SilentFailure) -> None:
        try:
            assert self._publish is not None
            self._publish(dataclasses.asdict(failure))  # False: another rank announced one first, as good
        except Exception as exc:  # noqa: BLE001 - the store does not answer: end this rank at least
            self._arm_backstop(failure)
            log.error("could not tell the other ranks (%s: %s); ending this rank alone", type(exc).__name__, exc)
            self._conclude(failure, alone=True)
            return
        if not self._listening():  # a rank left its guard: no listener reads the log any more
            self._arm_backstop(failure)
            log.error("no rank reads the job's events any more (a rank left its guard); ending this rank alone")
            self._conclude(failure, alone=True)

    # ---- the listener thread ---------------------------------------------------------------------
    def on_event(self, event: dict[str, Any]) -> None:
        """The job's silent failure, announced by whichever rank saw it first: every rank ends."""
        known = {f.name for f in dataclasses.fields(SilentFailure)}
        failure = SilentFailure(**{k: v for k, v in event.items() if k in known})
        self._conclude(failure, alone=False)

    def _conclude(self, failure: SilentFailure, *, alone: bool) -> None:
        """The records first, as judged (nothing on the way writes to the log), then the words, then the end."""
        if not self._ending.acquire(blocking=False):
            return  # ending already
        self._arm_backstop(failure)
        words: list[str] = []
        if failure.cause == HANG:
            mine = stacks.report(self.topology.rank, self.last_step())
            ending, words = self._judged(failure, mine, alone=alone)
            self._ending_now = ending
        assert self._ending_now is not None
        if failure.cause == PEER_LOST and not alone:  # the job goes on only where every rank knows
            self._ending_now = dataclasses.replace(self._ending_now, goes_on=self.goes_on(failure))
        self.record(self._ending_now)
        for line in words:
            log.error("%s", line)
        if failure.cause == HANG:
            why = f"rank {self.topology.rank}, the job hung: no step for {failure.noticed_after_s:.1f} s"
            stacks.log_all_stacks(why)
        self.end(self._ending_now)

    def _arm_backstop(self, failure: SilentFailure) -> None:
        """From now on the process ends within END_WITHIN_S, whatever the end path blocks on."""
        if self._ending_now is None:
            self._ending_now = Ending(failure)
            threading.Thread(target=self._last_resort, name="spotguard-end-backstop", daemon=True).start()

    def _last_resort(self) -> None:
        if self._recovered.wait(END_WITHIN_S):  # an end that goes on in-process: the training thread is back
            return
        assert self._ending_now is not None
        self.end_now(self._ending_now)  # as judged by then: a repeated hang's backstop keeps its code

    def _judged(self, failure: SilentFailure, mine: stacks.RankReport, *, alone: bool) -> tuple[Ending, list[str]]:
        """The job's verdict on a hang (through the store), and the lines to log once it is recorded."""
        if alone or self._conn is None:
            return Ending(failure), []
        try:
            verdict, judge, words = self._gather(mine)
        except Exception as exc:  # noqa: BLE001 - the stacks go to the log: end without the verdict
            return Ending(failure), [f"could not gather the hang's report: {type(exc).__name__}: {exc}"]
        if verdict is None:
            return Ending(failure), words
        judged = dataclasses.replace(failure, culprit=verdict.culprit, repeated=verdict.repeated, step=verdict.step)
        rank = self.topology.rank
        speaks_for = verdict.segment if judge == rank != 0 else None
        return Ending(judged, speaks_for=speaks_for, ledger=not (rank == 0 and judge != 0)), words

    def _gather(self, mine: stacks.RankReport) -> tuple[Verdict | None, int | None, list[str]]:
        """The verdict, the rank that judged (None: unknown), and the report's lines to log. Rank 0 judges
        once every line is in (or GATHER_S passed); any other rank, once no verdict came by its CLAIM_S,
        claims the judging (a frozen rank 0 must not leave the job unjudged)."""
        assert self._conn is not None
        conn = self._conn
        store, key, world, rank = conn.store, self._prefix + "hang/", self.topology.world_size, self.topology.rank
        store.append(key + "reports", mine.to_json() + "\n")
        if store.add(key + "arrived", 1) == world:
            store.set(key + "all", "1")
        if rank == 0:
            conn.get(key + "all", GATHER_S)
        else:
            raw = conn.get(key + "verdict", CLAIM_S[rank >= ranks_per_node()])
            if raw is not None:
                return Verdict.from_json(raw), None, []
        judge = int(store.compare_set(key + "judge", "", str(rank)))
        if judge != rank:  # another rank judges
            raw = conn.get(key + "verdict", 2 * GATHER_S)
            return (Verdict.from_json(raw) if raw is not None else None), judge, []
        raw_reports = (conn.get_now(key + "reports") or b"").decode()
        reports = [stacks.RankReport.from_json(line) for line in raw_reports.splitlines() if line]
        ranks, why = stacks.culprits(reports, world)
        step = max((r.last_step for r in reports if r.last_step is not None), default=None)
        before = self.previous_end() if rank == 0 else None
        repeated = step is not None and before is not None and before.cause == HANG and before.last_step == step
        segment = "" if rank == 0 else (conn.get_now(self._prefix + "segment") or b"").decode()
        verdict = Verdict(", ".join(f"rank {r}" for r in ranks), repeated, step, segment)
        store.set(key + "verdict", verdict.to_json())
        lines = [f"  rank {r.rank:>5}  last step {r.last_step}  {'waits in torch' if r.in_torch else 'in'} {r.where}"
                 for r in sorted(reports, key=lambda r: r.rank)]  # fmt: skip
        words = [] if rank == 0 else [f"rank 0 gave no verdict on the hang: rank {rank} judged in its place"]
        named = verdict.culprit or "no culprit"
        words.append(f"hang report of {len(reports)} rank(s); {named}: {why}\n" + "\n".join(lines))
        return verdict, rank, words
