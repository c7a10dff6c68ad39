"""The guard's side of silent failures: the health watches fed by the loop, and the process's end on one.

`spotguard.health.Health` watches the nodes' liveness and the loop's progress; this wires it to
one started guard: the loop's heartbeat is the count of `guard.step()` calls, spotguard's own work
on the training thread (a save, a snapshot) is kept out of the hang timeout, and a silent failure
ends the process with `lost_exit_code` after the exit file, the ledger and the timeline say why; a hang
at the step the previous start hung at ends it with NO_RESTART_EXIT_CODE and takes the node's agent out
of the job: the job would only reach the same end again.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable

import torch.distributed as dist

from cloud_adapters.storage import ObjectStore
from spotguard.ending import elastic, going_on
from spotguard.ending.exit_policy import NO_RESTART_EXIT_CODE, ExitPolicy
from spotguard.goodput.recorder import GoodputRecorder
from spotguard.goodput.timeline import Timeline
from spotguard.health.monitor import PEER_LOST, Ending, Health, SilentFailure
from spotguard.job.coordination import Coordination
from spotguard.job.sockets import GROUP_SOCKETS
from spotguard.job.topology import Topology, ranks_per_node
from spotguard.options import HealthOptions
from spotguard.wiring.rounds import EmergencyOutcome

log = logging.getLogger("spotguard.guard")


class GuardHealth:
    """The health watches of one start of a guard (a new one at every start: its heartbeat counts from 0)."""

    def __init__(
        self,
        topology: Topology,
        options: HealthOptions,
        *,
        timeline: Timeline,
        goodput: GoodputRecorder,
        exit_policy: ExitPolicy,
        min_nodes: int | None,
        last_step: Callable[[], int | None],
        ledger_store: Callable[[], ObjectStore | None],
        outcome: EmergencyOutcome,
        in_process: bool = False,
    ) -> None:
        """`ledger_store()`: where the ledger is, for a rank that records a hang's end in rank 0's place;
        `outcome`: the guard's, told when a lost node's survivors go on in their processes (`in_process`)."""
        self.beats = 0  # guard.step() calls: the loop's heartbeat, read by the hang watch
        self._topology = topology
        self._timeline = timeline
        self._goodput = goodput
        self._exit = exit_policy
        self._min_nodes = min_nodes
        self._last_step = last_step
        self._ledger_store = ledger_store
        self._outcome = outcome
        self._in_process = in_process
        self.monitor = Health(
            topology,
            peer_timeout_s=options.peer_timeout_s,
            hang_timeout_s=options.hang_timeout_s,
            beats=lambda: self.beats,
            last_step=last_step,
            record=self._record,
            end=self._end,
            end_now=self._end_now,
            previous_end=goodput.previous_end,
            segment=goodput.segment,
            goes_on=self._goes_on,
        )

    def start(self, store: dist.Store, coordination: Coordination) -> None:
        """Once the coordination listens (`Coordination(on_silent=health.monitor.on_event)`)."""
        self._goodput.on_open = self.monitor.publish_segment  # a ledger opened later (a stated topology)
        self.monitor.start(
            store,
            coordination.prefix,
            connections=(coordination.publishing, coordination.listener),
            publish=coordination.publish_silent_failure,
            listening=lambda: coordination.listening,
            excused=coordination.departing.__contains__,
        )

    def stop(self) -> None:
        self.monitor.stop()

    def busy(self) -> contextlib.AbstractContextManager[None]:
        """spotguard's own work on the training thread: the hang timeout does not count it."""
        return self.monitor.busy()

    def _code(self, failure: SilentFailure) -> int:
        return NO_RESTART_EXIT_CODE if failure.repeated else self._exit.lost_exit_code

    def _goes_on(self, failure: SilentFailure) -> tuple[int, ...]:
        """The ranks the job goes on with in their processes after the loss of a node (every rank reads the same
        event), or () to end as always: not in-process, no node named, or `going_on.survivors` says so."""
        if not self._in_process or failure.node_index is None:
            return ()
        per_node = ranks_per_node()
        lost = range(failure.node_index * per_node, (failure.node_index + 1) * per_node)
        return going_on.survivors(lost, self._topology.world_size, self._min_nodes or 1)

    def _record(self, ending: Ending) -> None:
        """What a silent end leaves behind, before any log line (a log write may block on a full pipe): the
        exit file, the ledger's records, the agent's withdrawal. A rank that judged a hang in rank 0's place
        writes its node's exit file and the end into rank 0's ledger segment. A loss the job goes on from in
        this process leaves the loss in the ledger, and nothing else: the guard's close says the rest."""
        if ending.goes_on:
            self._outcome.goes_on, self._outcome.cause = ending.goes_on, ending.failure.cause
            if ending.ledger:
                self._goodput.silent_failure(ending.failure, None, last_step=self._last_step())
            return
        self._write_exit_file(ending)
        if ending.speaks_for is not None:
            self._goodput.open_for_the_end(self._ledger_store(), ending.speaks_for)
        if ending.ledger:
            self._goodput.silent_failure(ending.failure, self._code(ending.failure), last_step=self._last_step())
        self._goodput.close(timeout_s=2.0)
        self._leave_agent(ending)

    def _write_exit_file(self, ending: Ending, *, quiet: bool = False) -> None:
        failure = ending.failure
        self._exit.record(self._code(failure), committed=False, step=None, leaving=False, cause=failure.cause,
                          culprit=failure.culprit, for_node=ending.speaks_for is not None, quiet=quiet)  # fmt: skip

    def _leave_agent(self, ending: Ending) -> None:
        """Survivors fewer than min_nodes, or a repeated hang: this node's agent must not restart it (no log
        line: the caller's output may be blocked; `_end` says it)."""
        self._exit.withdrawal = self._withdrawal(ending.failure)
        self._exit.leave_agent(quiet=True)

    def _end(self, ending: Ending) -> None:
        """A silent failure's end, once recorded, on the thread that concluded it (the training thread is
        stuck): the process ends with `lost_exit_code`, whatever `exit_code` says, or NO_RESTART_EXIT_CODE
        for a repeated hang."""
        failure, code = ending.failure, self._code(ending.failure)
        self._timeline.add(
            "silent-failure",
            cause=failure.cause,
            culprit=failure.culprit or "-",
            noticed_after_s=failure.noticed_after_s,
        )
        if ending.goes_on:  # the training thread leaves the collective it waits in, and the guard
            shut = GROUP_SOCKETS.shut_down()
            log.error("%s: the survivors go on in their processes (in-process recovery); %d socket(s) of the "
                      "process group shut down to leave the step", failure.describe(), shut)  # fmt: skip
            return
        if self._exit.withdrawal and self._topology.is_node_leader:  # the rank that stopped the agent
            log.warning("leaving the elastic job: %s; stopped this node's torchrun agent", self._exit.withdrawal)
        if failure.repeated:
            step = failure.step
            log.error(
                "%s: the job ended the same way at step %s before; ending with code %d, not asking to be restarted. "
                "If step %s is followed by a long phase, declare it (guard.long_phase(seconds), or guard.heartbeat() "
                "per batch) or raise hang_timeout_s",
                failure.describe(), step, code, step,
            )  # fmt: skip
        else:
            log.error(
                "%s: ending this process with code %d, so that the job restarts from the newest state the nodes hold",
                failure.describe(),
                code,
            )
        self._exit.exit_now(code)

    def _withdrawal(self, failure: SilentFailure) -> str | None:
        if failure.repeated:
            return "the job would reach the same hang again" if elastic.agent_restarts() else None
        lost = ranks_per_node() if failure.cause == PEER_LOST else 0
        return elastic.withdrawal(
            reclaimed=False, leaving=False, ranks_left=self._topology.world_size - lost, at_least=self._min_nodes
        )

    def _end_now(self, ending: Ending) -> None:
        """The backstop's end, when the end above is held up (a log write on a full pipe, a store that does
        not answer): the exit file and the exit, nothing that can block for long."""
        try:
            self._write_exit_file(ending, quiet=True)
            self._leave_agent(ending)
        finally:
            os._exit(self._code(ending.failure))
