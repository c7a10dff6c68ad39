"""The guard's rounds: what asks the job for a step (a notice, the interval and snapshot timers, a
request) and what every rank does at the step the job agreed on (a save, a snapshot, the emergency).

The agreement itself is `spotguard.job`'s; this is the guard's side of it: the watcher's notices turned
into the job's events, the listener's word that a round ended, the saves that never reach the training
loop when they fail, and the emergency's outcome (`EmergencyOutcome`), which the guard's end reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from cloud_adapters.notice import INTERRUPTION, REBALANCE, Notice
from spotguard.checkpoint import Checkpointer, CheckpointError, SaveReport
from spotguard.checkpoint.io.progress import seconds
from spotguard.ending import elastic, going_on
from spotguard.ending.exit_policy import ExitPolicy
from spotguard.goodput.cadence import IntervalTimer
from spotguard.goodput.recorder import GoodputRecorder
from spotguard.goodput.timeline import Timeline
from spotguard.job.agreement import Decision
from spotguard.job.broadcast import EMERGENCY, JOIN
from spotguard.job.coordination import Coordination, EmergencyPlan
from spotguard.job.departure import Departure
from spotguard.job.topology import Topology
from spotguard.options import GuardOptions
from spotguard.watcher import Watcher
from spotguard.wiring.kept import keep
from spotguard.wiring.snapshots import SNAPSHOT, GuardSnapshots

log = logging.getLogger("spotguard.guard")  # what the guard does at a round: its users filter by this name
ROUTINE_SAVES = ("periodic", "interval")  # a save that is also another round's takes that round's reason


@dataclasses.dataclass
class EmergencyOutcome:
    """What the emergency left for the guard's end (written by the training thread at the agreed step), or a
    node lost without a notice that the job goes on from in-process (written by the thread that concluded it,
    before the training thread leaves its step)."""

    interrupted: bool = False  # step() returned True for an emergency
    saved: bool = False  # ... and its checkpoint was committed where a new VM finds it
    upload_abandoned: bool = False  # ... and its upload did not finish (the stores are not closed)
    leaving: bool = False  # ... and this node was the one reclaimed
    # ... and the job goes on in the survivors' processes (in-process recovery): their global ranks, in order.
    # Empty: every process ends, as always (the guard is not in-process, or the job cannot go on this way).
    goes_on: tuple[int, ...] = ()
    cause: str = "interruption"  # what the job goes on from: a notice, or a node lost without one ("peer-lost")
    # Under `spotguard.run`: the nodes (their join numbers) the job takes in after this step, every rank staying.
    joining: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class GuardParts:
    """What the rounds use of one started guard."""

    topology: Topology
    options: GuardOptions
    timeline: Timeline
    goodput: GoodputRecorder
    snapshots: GuardSnapshots
    exit_policy: ExitPolicy
    min_nodes: int | None
    # The Checkpointer is made at its first need (a collective): by the training thread alone. The
    # listener's thread only looks whether it is made yet.
    make_checkpointer: Callable[[], Checkpointer]
    checkpointer_if_made: Callable[[], Checkpointer | None]
    coordination: Callable[[], Coordination]
    watcher: Callable[[], Watcher]
    busy: Callable[[], contextlib.AbstractContextManager[None]]  # spotguard's own work on the training thread
    in_process: bool = False  # the survivors of a departure go on in their processes (spotguard.inprocess)


class Rounds:
    """One started guard's rounds; `outcome` is the guard's, kept across its starts."""

    def __init__(self, parts: GuardParts, outcome: EmergencyOutcome, *, started_at: float) -> None:
        self._parts = parts
        self.outcome = outcome
        self._started_at = started_at  # the guard's start (monotonic): what the cadences' run hours count from
        self.last_state: Mapping[str, Any] | None = None  # the state the loop last passed to step()
        self.interval_timer: IntervalTimer | None = None
        self.snapshot_timer: IntervalTimer | None = None
        self._join_failed: Callable[[list[int], str], None] = lambda nodes, why: None  # rank 0's, per request

    # ---- what asks for a step ---------------------------------------------------------------
    def start_timers(self) -> None:
        """Rank 0 asks for the interval saves and timed snapshots (the others follow its request)."""
        p = self._parts
        if not p.topology.is_coordinator:
            return
        if p.options.saving.save_interval_s:
            self.interval_timer = IntervalTimer(self.interval, lambda: self.request("interval"))
        if p.snapshots.timed:
            self.snapshot_timer = IntervalTimer(
                lambda: p.snapshots.interval(p.goodput, self.run_hours()), lambda: self.request(SNAPSHOT)
            )

    def stop(self) -> None:
        for timer in (self.interval_timer, self.snapshot_timer):
            if timer is not None:
                timer.stop()
        self.last_state = None  # the training's state is not the guard's to keep

    def request(self, reason: str) -> None:
        """Any thread: ask every rank to act at the next step they all agree on."""
        self._parts.timeline.add("save-requested", reason=reason)
        self._parts.coordination().request_checkpoint(reason)

    def request_join(self, nodes: list[int], on_failed: Callable[[list[int], str], None]) -> None:
        """Rank 0 under `spotguard.run`: ask every rank to stop at the next step they agree on, so that the
        joining `nodes` enter the job after it; `on_failed(nodes, why)` if that step's snapshot fails."""
        self._join_failed = on_failed
        self._parts.timeline.add("join-requested", nodes=",".join(map(str, nodes)))
        self._parts.coordination().request_join(nodes)

    def interval(self) -> float:
        """The interval timer's interval: fixed, or the cadence's choice now."""
        p = self._parts
        if p.goodput.cadence is None:
            return p.options.saving.save_interval_s  # type: ignore[return-value]
        return p.goodput.next_interval(self.run_hours())

    def run_hours(self) -> float:
        return (time.monotonic() - self._started_at) / 3600

    def on_notice(self, notice: Notice) -> None:
        """Watcher thread: turn a notice into an event every rank sees."""
        p = self._parts
        notice = dataclasses.replace(notice, node=p.topology.node)
        p.timeline.add(
            "notice",
            source=notice.source,
            action=notice.action,
            node=notice.node,
            deadline_in_s=seconds(notice.seconds_left()),
        )
        if notice.kind == INTERRUPTION:
            p.coordination().publish_interruption(notice)
        elif notice.kind == REBALANCE and p.options.notices.save_on_rebalance:
            self.request("rebalance")

    def on_notice_update(self, notice: Notice) -> None:
        """Watcher thread: a notice already handled came again with an earlier deadline (logged by
        the watcher). Recorded; a save already agreed keeps the deadline it was agreed with."""
        self._parts.timeline.add("notice-update", source=notice.source, deadline_in_s=seconds(notice.seconds_left()))

    def on_agreed(self, event: dict[str, Any], decision: Decision | None, notice: Notice | None) -> None:
        """Listener thread, after a round: prepare for the save and record the outcome."""
        p = self._parts
        ckpt, last_state = p.checkpointer_if_made(), self.last_state
        if decision is not None and notice is not None and ckpt is not None:
            ckpt.abandon_background_uploads()  # the training thread may be waiting on one
            if last_state is not None:
                ckpt.expect_handoff(last_state, decision.leaving)
        if notice is not None and decision is None:
            p.goodput.notice(notice, agreed_step=None)
        if event.get("reason") == "rebalance":
            p.goodput.rebalance(decision.step if decision else None)
        if decision is not None:
            p.timeline.add(
                "agreed",
                step=decision.step,
                on=event["type"],
                ranks=p.topology.world_size,
                **({"leaving": ",".join(map(str, decision.leaving))} if decision.leaving else {}),
            )

    # ---- at the agreed step (the training thread) ----------------------------------------------
    def run(self, step: int, state: Mapping[str, Any], due: list[Decision], again: bool = False) -> bool:
        """Act on the rounds due at `step`, and on what the step counts owe at it (unless the step was
        reported `again`): an agreed round takes neither's place. True when one was an emergency (its
        save is done), or under `spotguard.run` a join (its snapshot taken)."""
        emergencies = [d for d in due if d.event["type"] == EMERGENCY]
        joins = [d for d in due if d.event["type"] == JOIN]  # put off by an emergency: asked for again after it
        reasons = [d.event.get("reason", "periodic") for d in due if d.event["type"] not in (EMERGENCY, JOIN)]
        every, snapshot_every = self._parts.options.saving.save_every, self._parts.snapshots.every
        if every and step % every == 0 and not again:
            reasons.insert(0, "periodic")  # first: a save that is also another round's takes that round's name
        if snapshot_every and step % snapshot_every == 0 and not again and SNAPSHOT not in reasons:
            reasons.append(SNAPSHOT)
        if not emergencies:
            # A join takes the step's snapshot itself, first: its collectives after every background save.
            joined = bool(joins) and self._join(step, state, sorted({n for d in joins for n in d.event["nodes"]}))
            if SNAPSHOT in reasons and not joins:
                self.snapshot(step, state)
            saves = [r for r in reasons if r != SNAPSHOT]
            if saves:  # rounds agreed on one step make one save: named for the one that is not routine
                reason = next((r for r in saves if r not in ROUTINE_SAVES), saves[-1])
                self.save(step, state, reason=reason, wait=False)
            return joined
        self._emergency(step, state, self._parts.coordination().plan(emergencies), snapshot_due=SNAPSHOT in reasons)
        return True

    def _emergency(self, step: int, state: Mapping[str, Any], plan: EmergencyPlan, *, snapshot_due: bool) -> None:
        p = self._parts
        leaving = self.outcome.leaving = p.topology.rank in plan.leaving or plan.departure is None
        # this node's own cloud notice, whatever other notices (a joining node's SIGTERM) came with it
        reclaimed = any(n.node == p.topology.node and n.cloud != "signal" for n in plan.notices)
        p.exit_policy.withdrawal = elastic.withdrawal(
            reclaimed=reclaimed,
            leaving=leaving,
            ranks_left=p.topology.world_size - len(plan.leaving),
            at_least=p.min_nodes,
        )
        p.timeline.add(
            "save-start",
            step=step,
            reason="emergency",
            **({"as": "leaving" if leaving else "survivor"} if plan.departure else {}),
        )
        report = self.save(step, state, reason="emergency", wait=True, notice=plan.notice, departure=plan.departure)
        safe = is_safe(plan, step, report)
        # A survivor goes on only from a committed step; a leaving rank by the plan alone, whatever it learnt of
        # the commit in time (it exits 0 either way: nothing of it is to be restarted when the survivors go on).
        goes_on = self._goes_on(plan) if safe or leaving else ()
        if p.topology.is_node_leader and safe:
            p.watcher().ack(plan.notice)  # Azure may proceed early only once the checkpoint is safe
        self.outcome.interrupted = True
        self.outcome.saved = safe
        self.outcome.upload_abandoned = report is not None and not report.durable
        self.outcome.goes_on = goes_on
        if goes_on and leaving and p.exit_policy.withdrawal is None and elastic.agent_restarts():
            # Its agent must neither start it again nor close the rendezvous behind it (an agent whose workers
            # all end well does, after its exit barrier): the survivors' fallback may need the rendezvous.
            p.exit_policy.withdrawal = "the job goes on in the survivors' processes"
        p.goodput.emergency(plan.notice, step, report, plan.leaving)
        # The next start, at any world size, reads the step from the nodes' memory; not when a cloud takes a
        # node and the job restarts (the plan is every rank's): its shards would be missing, and it must leave at
        # once. A job that goes on in its processes reads it now, while the leaving node waits for its replicas.
        signals = all(n.cloud == "signal" for n in plan.notices)
        if report is not None and p.snapshots.options.enabled and (signals or goes_on):
            # A survivor that keeps the step whole in its process loads it from there (`wiring/kept.py`). Each rank
            # decides alone (a leaving rank may be gone already) on what every rank sees alike: its state's kind,
            # the same on every rank of a job, and the ranks that go on (not whether the step is durable yet: a
            # leaving rank learns that late). Should the kinds differ, the next generation's resume finds out.
            if goes_on and keep(step, state, goes_on).step is not None:
                why = "every survivor keeps the whole step in its process (the next generation loads it from there)"
                log.info("no snapshot of the emergency's step %d: %s", step, why)
                if snapshot_due:  # the tier's record of the snapshot due at this step, said once above
                    p.snapshots.skip(step, why, quiet=True)
                return
            with p.busy():
                left = plan.leaving if goes_on else ()
                p.snapshots.keep_emergency(step, state, plan.notice.seconds_left(), left)  # says why it takes none
        elif snapshot_due:
            why = "a cloud is taking a node (its shards would be missing): the job leaves at once"
            failed = "the emergency's durable save of it failed (a snapshot follows a committed one only)"
            p.snapshots.skip(step, failed if report is None else why)

    def _join(self, step: int, state: Mapping[str, Any], nodes: list[int]) -> bool:
        """At the step agreed for joining `nodes`: a snapshot of it, which the joining ranks load from the
        nodes' memory. True (every rank's snapshot was taken: the training function returns, and the job
        goes on with them) or False on every rank (the join is put off: said in the log)."""
        p = self._parts
        if not p.in_process:  # only spotguard.run's rank 0 asks for one
            return False
        with p.busy():
            why = p.snapshots.keep_for_join(step, state)
        if why is not None:
            log.warning("node(s) %s cannot join at step %d: %s", ", ".join(map(str, nodes)), step, why)
            p.timeline.add("join-failed", step=step, why=why)
            self._join_failed(nodes, why)
            return False
        self.outcome.joining = tuple(nodes)
        p.timeline.add("joining", step=step, nodes=",".join(map(str, nodes)))
        return True

    def _goes_on(self, plan: EmergencyPlan) -> tuple[int, ...]:
        """The ranks the job goes on with in their processes after `plan`'s departure, or () when it ends or
        restarts as always (not in-process, the whole job stops, or `going_on.survivors` says so)."""
        p = self._parts
        if not p.in_process or plan.departure is None:
            return ()
        return going_on.survivors(plan.leaving, p.topology.world_size, p.min_nodes or 1)

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        reason: str,
        wait: bool,
        notice: Notice | None = None,
        departure: Departure | None = None,
    ) -> SaveReport | None:
        """A save that never raises into the training loop (invariant 3): None when it failed, said in the log."""
        try:
            with self._parts.busy():
                return self._parts.make_checkpointer().save(
                    step,
                    state,
                    reason=reason,
                    notice=notice,
                    deadline=notice.deadline if notice else None,
                    wait=wait,
                    departure=departure,
                )
        except CheckpointError as exc:  # says what failed, where and why: one line is enough
            log.error("%s checkpoint of step %d failed: %s", reason, step, exc)
        except Exception:  # noqa: BLE001 - invariant 3: a failed save never crashes the training loop
            log.exception("%s checkpoint of step %d failed", reason, step)
        self._parts.timeline.add("save-failed", step=step, reason=reason)
        return None

    def snapshot(self, step: int, state: Mapping[str, Any]) -> None:
        with self._parts.busy():
            self._parts.snapshots.take(step, state)


def is_safe(plan: EmergencyPlan, step: int, report: SaveReport | None) -> bool:
    """Whether the emergency checkpoint of `step` is safe, said in the log when it is not: durable in
    checkpoint_dir, or (leaving a job that goes on) committed by the survivors, who hold everything
    of this node's. A copy only in local_dir goes away with the VM."""
    if report is None:
        log.error(
            "the emergency checkpoint of step %d was NOT committed (see the error above); stopping anyway: "
            "the work since the last committed checkpoint is lost, and resume will start from that one",
            step,
        )
        return False
    if report.durable or plan.departure is not None:
        return True
    log.error(
        "the emergency checkpoint of step %d is committed only in %s, which goes away with this VM (%s): "
        "reporting it as not saved",
        step,
        report.local_location,
        report.error,
    )
    return False
