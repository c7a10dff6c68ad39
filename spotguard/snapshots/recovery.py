"""Resume from the nodes' memory: the newest snapshot whose every shard some surviving node holds.

Each rank lists its share of its node's files (their trailers: no data is read) and tells rank 0;
rank 0 picks the newest step that is whole (every rank's shard held somewhere, at the job's present
world size) and as new as the newest durable checkpoint at least, and where each rank finds its
shard, preferring its own node. Each rank then reads its shard straight into the state's tensors
(one copy), from its node or from a buddy, its CRC32C checked as it is read. A shard that fails
is struck off (that holder's copy of that rank's shard at that step) and rank 0 chooses again:
another holder, else an older snapshot, else none. Only once every rank has a checked shard is the
state loaded (`load_from_dcp`): a snapshot loads whole or not at all. A rank that read a shard has
overwritten its tensors already; if the snapshot is then given up, another copy, an older snapshot
or the durable checkpoint is loaded over the whole state, or resume raises (`guard.resume`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from spotguard.checkpoint.comm import Comm
from spotguard.snapshots import shard_file
from spotguard.snapshots.node_dir import NodeDir, name_of
from spotguard.snapshots.peers import fetch_into
from spotguard.snapshots.shard_file import SnapshotError

log = logging.getLogger(__name__)

Holding = tuple[int, int, int]  # (step, rank whose shard it is, world size)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The snapshot to resume from, and the rank that serves each rank's shard."""

    step: int
    sources: tuple[int, ...]  # sources[r]: a rank whose node holds rank r's shard


def holdings(node_dir: NodeDir, owner: tuple[str, str], local_rank: int, local_world_size: int) -> list[Holding]:
    """The complete files of this node that fall to this local rank to vouch for (by their trailers).

    `owner`: (run, job), the checkpoint location's key and the job identity it holds. A file of
    another job in the same place (a job started over after its checkpoint_dir was deleted) is
    never offered: it is deleted.
    """
    found = []
    for held in node_dir.held():
        if held.rank % local_world_size != local_rank:
            continue
        try:
            info = shard_file.read_info(held.path)
            if (info.run, info.step, info.rank, info.world_size) != (owner[0], held.step, held.rank, held.world_size):
                raise SnapshotError("its trailer names another file")
            if info.job != owner[1]:
                log.info("deleting snapshot file %s: it belongs to job %s, not to this one (%s)", held.path,
                         info.job, owner[1])  # fmt: skip
                held.path.unlink(missing_ok=True)
                continue
        except (OSError, SnapshotError) as exc:
            log.warning("skipping snapshot file %s: %s", held.path, exc)
            continue
        found.append((held.step, held.rank, held.world_size))
    return found


def choose(
    everyone: Iterable[tuple[int, list[Holding]]],
    world_size: int,
    ranks_per_node: int,
    durable: int | None,
    unusable: Collection[tuple[int, int, int]] = (),
) -> Plan | None:
    """The newest whole snapshot at `world_size`, as new as `durable` at least; None when there is none.

    `everyone`: (holder rank, what its node lets it vouch for); `unusable`: (step, rank, holder) of
    copies found bad. A rank's own node serves it when it can; otherwise the holders take turns, so
    that one node does not serve every lost shard.
    """
    by_step: dict[int, dict[int, list[int]]] = {}
    for holder, held in everyone:
        for step, rank, world in held:
            if world == world_size and (step, rank, holder) not in unusable:
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


def get_shard(
    plan: Plan,
    rank: int,
    world_size: int,
    node_dir: NodeDir,
    ranks_per_node: int,
    address_of: Callable[[int], str],
    live: Callable[[], Mapping[str, Any]],
) -> tuple[str | None, dict[str, Any] | None]:
    """This rank's shard of `plan`, read from its node's memory or from a buddy straight into the tensors
    of `live()` (the DCP state dict to load into) and checked as it is read: (None, the state dict
    for `load_from_dcp`), or (why it could not, None)."""
    name = name_of(plan.step, rank, world_size)
    source = plan.sources[rank]
    try:
        if source // ranks_per_node == rank // ranks_per_node:
            path = node_dir.file(name)
            try:
                return None, shard_file.load(path, live())[1]
            except SnapshotError:
                path.unlink(missing_ok=True)  # never offered again
                raise
        info, loaded = fetch_into(address_of(source), name, live())
        log.info("snapshot of step %d: read %d bytes of rank %d's shard from rank %d", plan.step,
                 info.body_bytes, rank, source)  # fmt: skip
        return None, loaded
    except Exception as exc:  # noqa: BLE001 - any failure: this copy is unusable
        return f"{type(exc).__name__}: {exc}", None


def agree_on_plan(
    comm: Comm,
    held: list[Holding],
    ranks_per_node: int,
    durable: int | None,
    get_shard: Callable[[Plan], str | None],
) -> Plan | None:
    """The snapshot every rank has its checked shard of (a collective), or None."""
    everyone = comm.gather((comm.rank, held))
    unusable: set[tuple[int, int, int]] = set()
    while True:
        plan = choose(everyone, comm.world_size, ranks_per_node, durable, unusable) if everyone else None
        plan = comm.broadcast(plan)
        if plan is None:
            return None
        problem = get_shard(plan)
        problems = comm.gather(problem)
        if everyone is not None:
            for rank, why in enumerate(problems or []):
                if why is not None:
                    source = plan.sources[rank]
                    log.warning("snapshot of step %d: rank %d's shard from rank %d is unusable (%s)", plan.step,
                                rank, source, why)  # fmt: skip
                    unusable.add((plan.step, rank, source))
        if not comm.broadcast(any(p is not None for p in problems or [])):
            return plan
