"""The emergency coordination of one rank: events through the store, agreement on a step, and
where leaving ranks and survivors meet.

An interruption notice (or a save request) is published through the store (`broadcast`); every
rank's listener thread runs the agreement round on it (`agreement`) and hands the decision back
to the guard, whose training loop acts when it reaches the agreed step. When only some nodes are
reclaimed, an `EmergencyPlan` says who leaves and how the survivors meet the leaving ranks.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from cloud_adapters.notice import Notice
from spotguard.job.agreement import Decision, StepAgreement
from spotguard.job.broadcast import EMERGENCY, SILENT, Broadcast
from spotguard.job.departure import Departure
from spotguard.job.kvstore import Connection
from spotguard.job.topology import Topology

log = logging.getLogger(__name__)

MIN_AGREEMENT_S = 2.0  # the shortest agreement round a notice's deadline may leave


@dataclasses.dataclass(frozen=True)
class EmergencyPlan:
    """What every rank does at an agreed emergency step (the same on every rank)."""

    notice: Notice  # the earliest deadline among the interruptions due at the step
    notices: tuple[Notice, ...]
    leaving: frozenset[int]  # the ranks of the reclaimed nodes
    departure: Departure | None  # None: the whole job stops (no survivors to commit without them)


class Coordination:
    """`on_agreed(event, decision, notice)` runs on the listener thread after every round
    (`decision` None: aborted; `notice`: the interruption, for an emergency); `on_silent(event)` on a
    silent failure's event, which no round is run for (the job ends)."""

    def __init__(
        self,
        store: dist.Store,
        prefix: str,
        topology: Topology,
        *,
        timeout_s: float,
        on_agreed: Callable[[dict[str, Any], Decision | None, Notice | None], None],
        on_silent: Callable[[dict[str, Any]], None] = lambda event: None,
    ) -> None:
        self.store = store
        self.prefix = prefix
        self.topology = topology
        self.timeout_s = timeout_s
        self.on_agreed = on_agreed
        self.on_silent = on_silent
        self.notice: Notice | None = None  # the last interruption announced to this rank
        # The nodes whose interruption is being handled: their silence is no loss (until a round without them aborts).
        self.departing: set[str] = set()
        # The listener blocks on it; the agreement and a hang's report run on the listener thread too.
        self.listener = listen = Connection.of(store)
        self.broadcast = Broadcast(store, prefix, self._on_event, rank=topology.rank, connection=listen)
        self.agreement = StepAgreement(listen, prefix, topology.rank, topology.world_size, node=topology.node)
        # Where leaving ranks and survivors meet at an emergency (the training thread waits on it): made now,
        # as the publishing one is, since a connection made inside the deadline could take seconds.
        self._meeting = Connection.of(store)
        # The training thread's hot path, bound once: a lock and a comparison per step, no extra call.
        self.reached: Callable[[int], list[Decision]] = self.agreement.reached

    def start(self) -> None:
        self.broadcast.start()

    def stop(self) -> None:
        self.broadcast.stop()

    # -- the training thread --------------------------------------------------------------------
    def reset(self, last_step: int) -> None:
        self.agreement.reset(last_step)

    def plan(self, emergencies: list[Decision]) -> EmergencyPlan:
        """Several nodes' interruptions due at one step: all of them leave, and the save keeps to the
        earliest deadline."""
        notices = tuple(Notice.from_json(d.event["notice"]) for d in emergencies)
        notice = min(notices, key=lambda n: (n.deadline is None, n.deadline or n.detected_at))
        leaving = frozenset(r for d in emergencies for r in d.leaving)
        departure = None
        world = self.topology.world_size
        if leaving and len(leaving) < world:
            departure = Departure(leaving, self._meeting, f"{self.prefix}emergency/{emergencies[0].round}/", world)
        return EmergencyPlan(notice, notices, leaving, departure)

    # -- any thread -----------------------------------------------------------------------------
    def publish_interruption(self, notice: Notice) -> bool:
        return self.broadcast.publish_interruption(notice)

    def request_checkpoint(self, reason: str) -> None:
        self.broadcast.request_checkpoint(reason)

    def request_join(self, nodes: list[int]) -> None:
        self.broadcast.request_join(nodes)

    def publish_silent_failure(self, event: dict[str, Any]) -> bool:
        """Announce a silent failure (False: another rank did first). The rounds before it, from the one this
        rank's listener is in (no rank is past it), may wait for the lost rank until their timeout: they
        are decided "abort" now, so that every listener reads the failure at once."""
        index = self.broadcast.publish_silent_failure(event)
        if index is None:
            return False
        store = self.broadcast.publishing.store  # not the job's client: the hung training may be waiting on it
        for earlier in range(min(self.broadcast.reading, index), index):  # every round any rank may still be in
            self.agreement.abort(store, earlier)
        return True

    @property
    def publishing(self) -> Connection:
        """This rank's own store client for short requests from any thread (made when the guard starts)."""
        return self.broadcast.publishing

    @property
    def listening(self) -> bool:
        return self.broadcast.listening

    # -- the listener thread --------------------------------------------------------------------
    def _on_event(self, index: int, event: dict[str, Any]) -> None:
        """Agree with every rank on the step to act at."""
        if event["type"] == SILENT:
            self.on_silent(event)
            return
        timeout = self.timeout_s
        leaving = None
        notice = None
        if event["type"] == EMERGENCY:
            self.notice = notice = Notice.from_json(event["notice"])
            self.departing.add(str(notice.node))
            left = notice.seconds_left()
            if left is not None:  # leave most of the window for the save itself
                timeout = min(timeout, max(MIN_AGREEMENT_S, left / 4))
            leaving = self.broadcast.claimed_nodes
            log.warning("node %s is being reclaimed (%s)", notice.node, notice.source)
        # The event's slot stays (a few hundred bytes a round): removed, it could be taken again by a publish
        # that read this rank's next slot before this round, and that event would sit behind every reader.
        decision = self.agreement.agree(index, event, timeout, leaving)
        if notice is not None and decision is None:  # no save, the job trains on: its silence is a loss again
            self.departing.discard(str(notice.node))
        self.on_agreed(event, decision, notice)
