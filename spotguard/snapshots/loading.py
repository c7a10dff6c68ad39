"""One rank's load of the snapshot rank 0 chose (`recovery.Plan`), at the job's world size now.

The index of each shard (its trailer) says which chunks it holds. At the world size the snapshot
was taken at, a rank reads its own shard's index (from its node's copy or a holder's) and nothing
else: no exchange. At another world size each shard's index is read once, by the first rank whose
node holds it; the chunks it lists, and those of each rank's state, go to rank 0 as arrays, which
tells each rank the shards it needs (`needed`); each rank then reads the indexes of those shards
only, from their holders. DCP's load planner then works out the reads (`items.CoveringPlanner`) and
`reading.SnapshotReader` does them: from this node's files first, else from a holder, spread over the
holders by rank. A rank that holds the plan's step whole in its own memory (`HeldHere`: an in-process
survivor's, as nodes join) reads nothing, and wants nothing in the exchange.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, ContextManager

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from spotguard.checkpoint.comm import Comm
from spotguard.checkpoint.state import load_from_dcp
from spotguard.snapshots import shard_file
from spotguard.snapshots.items import CoveringPlanner, metadata_of, top_level_keys
from spotguard.snapshots.needed import Layout, shard_layout, shards_needed, state_layout
from spotguard.snapshots.node_dir import NodeDir, name_of
from spotguard.snapshots.peers import PeerRuns, fetch_info
from spotguard.snapshots.reading import FileRuns, OpenShard, ShardUnusable, SnapshotReader, Source
from spotguard.snapshots.recovery import Plan, Problem
from spotguard.snapshots.shard_file import ShardInfo, SnapshotError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldHere:
    """A step this rank holds whole in its own memory (an in-process survivor's), and how it loads it into
    the state: of a plan of that step it reads nothing, and takes part in the plan's collectives only."""

    step: int
    load: Callable[[], None]


class PlanLoader:
    """Loads a plan into `live()` (the DCP state dict of the state being resumed) on one rank.

    `optional`: the state's keys that a snapshot may lack (`state.IfSaved`); `address_of(rank)`: the
    peer server of a rank.
    """

    def __init__(
        self,
        comm: Comm,
        node_dir: NodeDir,
        ranks_per_node: int,
        address_of: Callable[[int], str],
        live: Callable[[], dict[str, Any]],
        optional: list[str],
        own: HeldHere | None = None,
    ) -> None:
        self.comm = comm
        self.node_dir = node_dir
        self.ranks_per_node = ranks_per_node
        self.address_of = address_of
        self.live = live
        self.optional = optional
        self.own = own  # a step this rank holds whole in its own memory: of its plan it reads nothing
        self.touched = False  # whether this rank read into the state's tensors
        self.loaded: dict[str, Any] | None = None  # the state dict loaded, for `load_into`

    def __call__(self, plan: Plan) -> list[Problem]:
        """Load `plan` (a collective when the world size changed); what went wrong on this rank."""
        self.loaded = None
        reads = not self.holds(plan)
        indexes, problems = self._indexes(plan, reads)
        if problems or indexes is None or not reads:
            return problems
        try:
            self._load(plan, indexes)
        except ShardUnusable as exc:
            holder = self._source(plan, exc.shard)
            if self._same_node(holder) and isinstance(exc.__cause__, SnapshotError):  # damaged here: never again
                self.node_dir.file(name_of(plan.step, exc.shard, plan.world_size)).unlink(missing_ok=True)
            return [Problem(exc.why, exc.shard, holder)]
        except Exception as exc:  # noqa: BLE001 - the snapshot cannot serve this state: no copy would
            return [Problem(f"{type(exc).__name__}: {exc}")]
        return []

    def holds(self, plan: Plan) -> bool:
        """Whether this rank holds `plan`'s step whole in its own memory (`HeldHere`)."""
        return self.own is not None and self.own.step == plan.step

    def load_into(self, plan: Plan, state: MutableMapping[str, Any]) -> None:
        """Load what this rank has of `plan` (loaded by the call) into `state`: its own memory's, or the
        snapshot's."""
        if self.holds(plan):
            self.own.load()  # type: ignore[union-attr]
        else:
            load_from_dcp(state, self.loaded)

    # ---- which shards hold what ---------------------------------------------------------
    def _indexes(self, plan: Plan, reads: bool = True) -> tuple[dict[int, ShardInfo] | None, list[Problem]]:
        """The indexes of the shards this rank reads (a collective when the world size changed: a rank that
        `reads` nothing takes part, wanting nothing), or None, and what went wrong on this rank."""
        if plan.world_size == self.comm.world_size:  # its own shard, as taken
            if not reads:
                return {}, []
            shard = self.comm.rank
            try:
                return {shard: self._info(plan, shard, self._source(plan, shard))}, []
            except Exception as exc:  # noqa: BLE001 - this copy is unusable
                return None, [Problem(f"{type(exc).__name__}: {exc}", shard, self._source(plan, shard))]
        mine: dict[int, ShardInfo] = {}
        problems = []
        for shard, holders in enumerate(plan.holders):
            if holders[0] == self.comm.rank:
                try:
                    mine[shard] = self._info(plan, shard, self.comm.rank)
                except Exception as exc:  # noqa: BLE001 - this copy is unusable
                    problems.append(Problem(f"{type(exc).__name__}: {exc}", shard, self.comm.rank))
        try:  # what rank 0 matches; a failure here must still reach the gather, not leave the others in it
            wants = state_layout(self.live() if reads else {})
            sent = ({shard: shard_layout(info.items) for shard, info in mine.items()}, wants)
        except Exception as exc:  # noqa: BLE001 - this rank's state cannot be laid out: the snapshot cannot serve it
            problems.append(Problem(f"{type(exc).__name__}: {exc}"))
            sent = None
        gathered = self.comm.gather(None if problems else sent)
        parts = None
        if gathered is not None:  # rank 0: nothing is matched once a rank failed
            parts = [None] * self.comm.world_size
            try:
                if all(part is not None for part in gathered):
                    parts = self._needed(plan, gathered)
            except Exception as exc:  # noqa: BLE001 - every rank hears of it as no plan
                problems.append(Problem(f"{type(exc).__name__}: {exc}"))
        needed = self.comm.scatter(parts)
        if needed is None:
            return None, problems
        indexes = {}
        for shard in needed:  # the indexes of the shards this rank reads, from their holders
            holder = self._source(plan, shard)
            try:
                indexes[shard] = mine[shard] if shard in mine else self._info(plan, shard, holder)
            except Exception as exc:  # noqa: BLE001 - this copy is unusable
                return None, [Problem(f"{type(exc).__name__}: {exc}", shard, holder)]
        return indexes, problems

    def _needed(self, plan: Plan, gathered: list[tuple[dict[int, Layout], Layout]]) -> list[list[int]]:
        """Rank 0: the shards each rank reads (`needed.shards_needed`)."""
        shards = {shard: layout for part, _ in gathered for shard, layout in part.items()}
        on_node: dict[int, list[int]] = {}  # node -> the shards held there, in order
        for shard, holders in enumerate(plan.holders):
            for node in sorted({h // self.ranks_per_node for h in holders}):
                on_node.setdefault(node, []).append(shard)
        local = [on_node.get(rank // self.ranks_per_node, []) for rank in range(self.comm.world_size)]
        return shards_needed(shards, [wants for _, wants in gathered], local)

    def _info(self, plan: Plan, shard: int, holder: int) -> ShardInfo:
        name = name_of(plan.step, shard, plan.world_size)
        if self._same_node(holder):
            info = shard_file.read_info(self.node_dir.file(name))
        else:
            info = fetch_info(self.address_of(holder), name)
        if (info.attempt, info.step, info.rank, info.world_size) != (plan.attempt, plan.step, shard, plan.world_size):
            raise shard_file.SnapshotError(f"{name} now belongs to another start of the job")
        return info

    def _source(self, plan: Plan, shard: int) -> int:
        """The holder this rank reads `shard` from: one on its own node, else one picked by rank."""
        holders = plan.holders[shard]
        local = [h for h in holders if self._same_node(h)]
        return local[0] if local else holders[self.comm.rank % len(holders)]

    def _same_node(self, rank: int) -> bool:
        return rank // self.ranks_per_node == self.comm.rank // self.ranks_per_node

    # ---- the load ------------------------------------------------------------------------------
    def _load(self, plan: Plan, indexes: Mapping[int, ShardInfo]) -> None:
        live = dict(self.live())  # the keys this plan lacks are dropped from this plan's copy only
        saved = set().union(*(top_level_keys(info.paths) for info in indexes.values()))
        for key in self.optional:
            if key not in saved and key in live:
                del live[key]  # left as it is (`IfSaved`)
        local = {s for s, holders in enumerate(plan.holders) if any(map(self._same_node, holders))}

        def prefer(shard: int) -> tuple[bool, bool, int]:  # a copy on this node, then this rank's own
            return shard not in local, shard != self.comm.rank, shard

        def open_shard(shard: int, runs: list[tuple[int, int]]) -> ContextManager[Source]:
            name = name_of(plan.step, shard, plan.world_size)
            holder = self._source(plan, shard)
            if self._same_node(holder):
                source: ContextManager[Source] = FileRuns(self.node_dir.file(name))
            else:
                source = PeerRuns(self.address_of(holder), name, runs)
            self.touched = True  # opened: bytes may go into the state's tensors from now on
            return source

        started = time.monotonic()
        bytes_read = load_shards(live, indexes, prefer, open_shard)
        took = time.monotonic() - started
        self.loaded = live
        for shard, nbytes in sorted(bytes_read.items()):
            holder = self._source(plan, shard)
            where = "this node" if self._same_node(holder) else f"rank {holder}"
            log.info("snapshot of step %d: read %d bytes of rank %d's shard (of %d) from %s", plan.step, nbytes,
                     shard, plan.world_size, where)  # fmt: skip
        total = sum(bytes_read.values())
        log.info("snapshot of step %d: %.1f MB read into the state in %.2f s (%.0f MB/s)", plan.step, total / 1e6,
                 took, total / 1e6 / max(took, 1e-9))  # fmt: skip


def load_shards(
    live: dict[str, Any], indexes: Mapping[int, ShardInfo], prefer: Callable[[int], Any], open_shard: OpenShard
) -> dict[int, int]:
    """Load into `live` (a DCP state dict, in place) what it needs of the shards `indexes`, read
    through `open_shard` (DCP's planner on this rank alone); the bytes read from each shard."""
    whole = all(info.world_size == len(indexes) for info in indexes.values())  # every shard's index
    metadata, copies = metadata_of({shard: info.items for shard, info in indexes.items()}, whole=whole)
    reader = SnapshotReader(metadata, copies, indexes, prefer, open_shard)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(live, storage_reader=reader, planner=CoveringPlanner(), no_dist=True)
    except CheckpointException as exc:  # DCP's wrapping of what the reader or the planner raised
        raise _first_failure(exc) from None
    return reader.bytes_read


def _first_failure(exc: CheckpointException) -> Exception:
    for failure in exc.failures.values():
        error = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(error, Exception):
            return error
    return SnapshotError(str(exc))  # never a BaseException: the caller turns an Exception into a Problem
