"""The guard's side of silent failures: the health watches fed by the loop, and the process's end on one.

`spotguard.health.Health` watches the nodes' liveness and the loop's progress; this wires it to
one started guard: the loop's heartbeat is the count of `guard.step()` calls, spotguard's own work
on the training thread (a save, a snapshot) is kept out of the hang timeout, and a silent failure
ends the process with `lost_exit_code` after the timeline, the exit file and the ledger say why.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch.distributed as dist

from spotguard.checkpoint.comm import ranks_per_node
from spotguard.ending import elastic
from spotguard.ending.exit_policy import ExitPolicy
from spotguard.goodput import GoodputRecorder
from spotguard.health.monitor import PEER_LOST, Health, SilentFailure
from spotguard.job.coordination import Coordination
from spotguard.job.topology import Topology
from spotguard.options import HealthOptions
from spotguard.timeline import Timeline

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
    ) -> None:
        self.beats = 0  # guard.step() calls: the loop's heartbeat, read by the hang watch
        self._topology = topology
        self._timeline = timeline
        self._goodput = goodput
        self._exit = exit_policy
        self._min_nodes = min_nodes
        self._last_step = last_step
        self.monitor = Health(
            topology,
            peer_timeout_s=options.peer_timeout_s,
            hang_timeout_s=options.hang_timeout_s,
            beats=lambda: self.beats,
            last_step=last_step,
            end=self._end,
        )

    def start(self, store: dist.Store, coordination: Coordination) -> None:
        """Once the coordination listens (`Coordination(on_silent=health.monitor.on_event)`)."""
        self.monitor.start(
            store,
            coordination.prefix,
            publish=coordination.publish_silent_failure,
            listening=lambda: coordination.listening,
            excused=coordination.departing.__contains__,
        )

    def stop(self) -> None:
        self.monitor.stop()

    def busy(self) -> contextlib.AbstractContextManager[None]:
        """spotguard's own work on the training thread: the hang timeout does not count it."""
        return self.monitor.busy()

    def _end(self, failure: SilentFailure) -> None:
        """A silent failure's end, on the thread that concluded it (the training thread is stuck): the exit
        file, the ledger, then the process ends with `lost_exit_code`, whatever `exit_code` says."""
        code = self._exit.lost_exit_code
        self._timeline.add(
            "silent-failure",
            cause=failure.cause,
            culprit=failure.culprit or "-",
            noticed_after_s=failure.noticed_after_s,
        )
        log.error(
            "%s: ending this process with code %d, so that the job restarts from the newest state the nodes hold",
            failure.describe(),
            code,
        )
        self._exit.record(code, committed=False, step=None, leaving=False, cause=failure.cause, culprit=failure.culprit)
        self._goodput.silent_failure(failure, code, last_step=self._last_step())
        self._goodput.close(timeout_s=2.0)
        lost = ranks_per_node() if failure.cause == PEER_LOST else 0
        self._exit.withdrawal = elastic.withdrawal(
            reclaimed=False, leaving=False, ranks_left=self._topology.world_size - lost, at_least=self._min_nodes
        )
        self._exit.leave_agent()  # survivors fewer than min_nodes: their round could not close
        self._exit.exit_now(code)
