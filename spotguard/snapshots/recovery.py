"""Resume from the nodes' memory: the newest snapshot whose every shard some surviving node holds.

Each rank verifies its share of its node's files (the CRC32C of each: a corrupted or truncated
replica is skipped) and tells rank 0 what it holds; rank 0 picks the newest step that is whole
(every rank's shard held somewhere, at the job's present world size) and newer than or as new as
the newest durable checkpoint, and where each rank finds its shard, preferring its own node. A rank
whose shard is on another node copies it from there, checked again as it arrives, and only once
every rank has its shard does any of them load it: a snapshot loads whole or not at all.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable

from spotguard.checkpoint.comm import Comm
from spotguard.snapshots import shard_file
from spotguard.snapshots.node_dir import NodeDir, name_of
from spotguard.snapshots.peers import fetch
from spotguard.snapshots.shard_file import SnapshotError

log = logging.getLogger(__name__)

Holding = tuple[int, int, int]  # (step, rank whose shard it is, world size)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The snapshot to resume from, and the rank that serves each rank's shard."""

    step: int
    sources: tuple[int, ...]  # sources[r]: a rank whose node holds rank r's shard


def verified_holdings(node_dir: NodeDir, run: str, local_rank: int, local_world_size: int) -> list[Holding]:
    """The complete, checksum-verified files of this node that fall to this local rank to check."""
    found = []
    for held in node_dir.held():
        if held.rank % local_world_size != local_rank:
            continue
        try:
            info = shard_file.verify(held.path)
            if (info.run, info.step, info.rank, info.world_size) != (run, held.step, held.rank, held.world_size):
                raise SnapshotError("its trailer names another file")
        except (OSError, SnapshotError) as exc:
            log.warning("skipping snapshot file %s: %s", held.path, exc)
            continue
        found.append((held.step, held.rank, held.world_size))
    return found


def choose(
    holdings: Iterable[tuple[int, list[Holding]]], world_size: int, ranks_per_node: int, durable: int | None
) -> Plan | None:
    """The newest whole snapshot at `world_size`, as new as `durable` at least; None when there is none.

    `holdings`: (holder rank, what its node lets it vouch for). A rank's own node serves it when it
    can; otherwise the holders take turns, so that one node does not serve every lost shard.
    """
    by_step: dict[int, dict[int, list[int]]] = {}
    for holder, held in holdings:
        for step, rank, world in held:
            if world == world_size:
                by_step.setdefault(step, {}).setdefault(rank, []).append(holder)
    for step in sorted(by_step, reverse=True):
        if durable is not None and step < durable:
            return None
        shards = by_step[step]
        if len(shards) < world_size or any(r not in shards for r in range(world_size)):
            continue
        sources = []
        for rank in range(world_size):
            holders = sorted(shards[rank])
            same_node = [h for h in holders if h // ranks_per_node == rank // ranks_per_node]
            sources.append(same_node[0] if same_node else holders[rank % len(holders)])
        return Plan(step, tuple(sources))
    return None


def restore(
    plan: Plan,
    *,
    comm: Comm,
    node_dir: NodeDir,
    ranks_per_node: int,
    address_of: Callable[[int], str],
) -> shard_file.ShardInfo | None:
    """Bring this rank's shard of `plan` onto its node (a collective); its info once every rank has
    its own, None (everywhere) when any rank could not get it."""
    rank, world = comm.rank, comm.world_size
    name = name_of(plan.step, rank, world)
    source = plan.sources[rank]
    problem = None
    try:
        if source // ranks_per_node == rank // ranks_per_node:
            info = shard_file.read_info(node_dir.file(name))
        else:
            info = fetch(address_of(source), name, node_dir.prepare(name))
            log.info("snapshot of step %d: fetched %d bytes of rank %d's shard from rank %d", plan.step,
                     info.body_bytes, rank, source)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - any failure: this snapshot cannot be loaded whole
        problem = f"rank {rank}: {type(exc).__name__}: {exc}"
        info = None
    problems = comm.gather(problem)
    verdict = comm.broadcast([p for p in problems if p] if problems is not None else None)
    if verdict:
        if comm.is_coordinator:
            log.warning("the snapshot of step %d cannot be loaded whole (%s)", plan.step, "; ".join(verdict))
        return None
    return info
