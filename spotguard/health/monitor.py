"""One guard's watch for silent failures, and the job-wide decision to end.

A node leader that declares its watched node lost (`liveness`), or a rank whose loop stopped stepping
(`hangs`), announces a silent failure through the job's event log, once per job (a claim in the store).
Every rank's listener reads it: for a hang every rank first writes its threads' stacks to its log and its
line to the report, rank 0 names the ranks that hold the others up, and the node leaders read that
verdict for their exit file; then every rank ends (`end`, given by the guard: the exit file, the ledger,
the restart code). When the store does not take the announcement, the rank that saw the failure ends
alone: its neighbours see its connections close and fail their collectives, or time out in turn.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from spotguard.checkpoint.comm import layout_said, node_count, ranks_per_node
from spotguard.health import stacks
from spotguard.health.hangs import HangSeen, HangWatch
from spotguard.health.liveness import Liveness, PeerLoss
from spotguard.job.kvstore import Connection
from spotguard.job.topology import Topology

log = logging.getLogger(__name__)

PEER_LOST = "peer-lost"
HANG = "hang"
GATHER_S = 5.0  # how long rank 0 waits for every rank's line in a hang's report


@dataclasses.dataclass(frozen=True)
class SilentFailure:
    """Why a job ends without a notice (the event every rank reads, the exit file's and the ledger's cause)."""

    cause: str  # PEER_LOST or HANG
    culprit: str  # the lost node, or the ranks that held the others up ("" when none could be named)
    noticed_after_s: float  # the silence, or the stall, when it was declared
    seen_by: str  # the node (a loss) or the rank (a hang) that saw it first

    def describe(self) -> str:
        if self.cause == PEER_LOST:
            return f"node {self.culprit} lost (silent for {self.noticed_after_s:.1f} s, seen by {self.seen_by})"
        held = f"held up by {self.culprit}" if self.culprit else "no rank could be named"
        return f"training hung ({self.noticed_after_s:.1f} s without a step; {held})"


class Health:
    """`end(failure)` ends this process (it does not return). `beats()` and `last_step()` read the loop's
    heartbeat (guard.step()). `peer_timeout_s` / `hang_timeout_s`: 0 switches that watch off."""

    def __init__(
        self,
        topology: Topology,
        *,
        peer_timeout_s: float,
        hang_timeout_s: float | str,
        beats: Callable[[], int],
        last_step: Callable[[], int | None],
        end: Callable[[SilentFailure], None],
    ) -> None:
        self.topology = topology
        self.peer_timeout_s = peer_timeout_s
        self.end = end
        self.last_step = last_step
        self.hangs = (
            None
            if not hang_timeout_s
            else HangWatch(hang_timeout_s, beats=beats, last_step=last_step, on_hang=self._hang)
        )
        self.liveness: Liveness | None = None
        self._publish: Callable[[dict[str, Any]], bool] | None = None
        self._listening: Callable[[], bool] = lambda: False
        self._store: dist.Store | None = None
        self._prefix = ""
        self._ending = threading.Lock()

    def start(
        self,
        store: dist.Store,
        prefix: str,
        *,
        publish: Callable[[dict[str, Any]], bool],
        listening: Callable[[], bool],
        excused: Callable[[str], bool],
    ) -> None:
        """`publish` announces a failure to every rank's listener; `listening()`: whether this rank's still
        reads (after a rank left its guard none does, and this rank ends alone)."""
        self._store, self._prefix, self._publish, self._listening = store, f"{prefix}health/", publish, listening
        per_node, nodes = ranks_per_node(), node_count(self.topology.world_size)
        if nodes is None:
            log.warning("%s does not fit the world size %d: no liveness ring", layout_said(), self.topology.world_size)
        elif self.peer_timeout_s and nodes > 1 and self.topology.rank % per_node == 0:
            self._join_ring(store, prefix, excused, per_node, nodes)
        if self.hangs is not None:
            self.hangs.start()

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

    # ---- the training thread ---------------------------------------------------------------------
    def busy(self) -> contextlib.AbstractContextManager[None]:
        return self.hangs.busy() if self.hangs is not None else contextlib.nullcontext()

    def allow(self, seconds: float) -> None:
        if self.hangs is not None:
            self.hangs.allow(seconds)

    def alive(self) -> None:
        if self.hangs is not None:
            self.hangs.alive()

    def phase(self) -> contextlib.AbstractContextManager[None]:
        return self.hangs.phase() if self.hangs is not None else contextlib.nullcontext()

    # ---- the watches' threads --------------------------------------------------------------------
    def _peer_lost(self, loss: PeerLoss) -> None:
        self._announce(SilentFailure(PEER_LOST, loss.node, loss.silent_s, loss.watcher))

    def _hang(self, seen: HangSeen) -> None:
        self._announce(SilentFailure(HANG, "", seen.stalled_s, f"rank {self.topology.rank}"))

    def _announce(self, failure: SilentFailure) -> None:
        try:
            assert self._publish is not None
            self._publish(dataclasses.asdict(failure))  # False: another rank announced one first, as good
        except Exception as exc:  # noqa: BLE001 - the store does not answer: end this rank at least
            log.error("could not tell the other ranks (%s: %s); ending this rank alone", type(exc).__name__, exc)
            self._conclude(failure, alone=True)
            return
        if not self._listening():  # a rank left its guard: no listener reads the log any more
            log.error("no rank reads the job's events any more (a rank left its guard); ending this rank alone")
            self._conclude(failure, alone=True)

    # ---- the listener thread ---------------------------------------------------------------------
    def on_event(self, event: dict[str, Any]) -> None:
        """The job's silent failure, announced by whichever rank saw it first: every rank ends."""
        known = {f.name for f in dataclasses.fields(SilentFailure)}
        failure = SilentFailure(**{k: v for k, v in event.items() if k in known})
        self._conclude(failure, alone=False)

    def _conclude(self, failure: SilentFailure, *, alone: bool) -> None:
        if not self._ending.acquire(blocking=False):
            return  # ending already
        if failure.cause == HANG:
            failure = self._report_hang(failure, alone=alone)
        self.end(failure)

    def _report_hang(self, failure: SilentFailure, *, alone: bool) -> SilentFailure:
        """Every rank's stacks in its log, and (through the store) the ranks that held the others up."""
        stacks.log_all_stacks(f"rank {self.topology.rank}, the job hung: no step for {failure.noticed_after_s:.1f} s")
        mine = stacks.report(self.topology.rank, self.last_step())
        if alone or self._store is None:
            return failure
        try:
            return dataclasses.replace(failure, culprit=self._gather(mine))
        except Exception as exc:  # noqa: BLE001 - the stacks are in the log: end without the verdict
            log.warning("could not gather the hang's report: %s: %s", type(exc).__name__, exc)
            return failure

    def _gather(self, mine: stacks.RankReport) -> str:
        assert self._store is not None
        conn = Connection.of(self._store)  # not the job's client: the hung training thread may be waiting on it
        store, key, world = conn.store, self._prefix + "hang/", self.topology.world_size
        store.append(key + "reports", mine.to_json() + "\n")
        if store.add(key + "arrived", 1) == world:
            store.set(key + "all", "1")
        if self.topology.rank != 0:
            if not self.topology.is_node_leader:
                return ""
            verdict = conn.get(key + "verdict", 2 * GATHER_S)  # for the exit file
            return verdict.decode() if verdict is not None else ""
        conn.get(key + "all", GATHER_S)
        raw = conn.get_now(key + "reports") or b""
        reports = [stacks.RankReport.from_json(line) for line in raw.decode().splitlines() if line]
        ranks, why = stacks.culprits(reports, world)
        lines = [f"  rank {r.rank:>5}  last step {r.last_step}  {'waits in torch' if r.in_torch else 'in'} {r.where}"
                 for r in sorted(reports, key=lambda r: r.rank)]  # fmt: skip
        named = ", ".join(f"rank {r}" for r in ranks)
        log.error("hang report of %d rank(s); %s: %s\n%s", len(reports), named or "no culprit", why, "\n".join(lines))
        store.set(key + "verdict", named)
        return named
