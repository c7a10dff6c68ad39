"""Resume from the nodes' memory: the newest snapshot whose every shard some surviving node holds,
at whatever world size it was taken.

Each rank lists its share of its node's files (their trailers: no data is read) and tells rank 0;
rank 0 picks the newest step that is whole (every shard of one start of the job, `attempt`, at one
world size, held somewhere) and as new as the newest durable checkpoint at least (at one step, a
snapshot at the job's present world size first). Each rank then loads what its state needs of it
(`loading`): its own shard at the same world size, the parts of several at another one. A copy
that fails is struck off (that holder's copy of that shard at that step; a snapshot that cannot
serve the state at all, every copy of it) and rank 0 chooses again: another holder, else an older
snapshot, else none. A rank that read from a snapshot has overwritten its tensors already; if the
snapshot is then given up, another copy, an older snapshot or the durable checkpoint is loaded
over the whole state, or resume raises (`guard.resume`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Iterable

from spotguard.checkpoint.comm import Comm
from spotguard.snapshots import shard_file
from spotguard.snapshots.node_dir import NodeDir
from spotguard.snapshots.shard_file import SnapshotError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, order=True)
class Holding:
    """A complete snapshot file a rank vouches for (by its trailer)."""

    step: int
    attempt: str
    world_size: int  # the snapshot's
    shard: int  # the rank (at that world size) whose shard it is


@dataclasses.dataclass(frozen=True)
class Plan:
    """The snapshot to resume from, and the ranks (of the job now) whose node holds each of its shards."""

    step: int
    attempt: str
    world_size: int
    holders: tuple[tuple[int, ...], ...]  # holders[s]: sorted ranks whose node holds shard s


@dataclasses.dataclass(frozen=True)
class Problem:
    """Why a rank could not load from a plan: a copy (`shard` from `holder`) or, with both None, the
    snapshot itself (it cannot serve this state)."""

    why: str
    shard: int | None = None
    holder: int | None = None


Unusable = tuple[int, str, int, int | None, int | None]  # (step, attempt, world size, shard, holder)


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
        found.append(Holding(held.step, info.attempt, held.world_size, held.rank))
    return found


def choose(
    everyone: Iterable[tuple[int, list[Holding]]],
    world_size: int,
    durable: int | None,
    unusable: Collection[Unusable] = (),
) -> Plan | None:
    """The newest whole snapshot, as new as `durable` at least; None when there is none.

    `everyone`: (holder rank, what its node lets it vouch for); `world_size`: the job's now (at one
    step, a snapshot taken at it goes first); `unusable`: copies found bad.
    """
    found = _usable(everyone, unusable)
    for step, attempt, world in _candidates(found, world_size, durable):
        shards = found[(step, attempt, world)]
        if all(s in shards for s in range(world)):
            return Plan(step, attempt, world, tuple(tuple(sorted(shards[s])) for s in range(world)))
    return None


def why_none(everyone: Iterable[tuple[int, list[Holding]]], world_size: int, durable: int | None) -> str:
    """What the newest snapshots as new as `durable` lack (`choose` found none whole), for the log."""
    found = _usable(everyone, ())
    lacking = []
    for key in list(_candidates(found, world_size, durable))[:3]:
        missing = ", ".join(str(s) for s in range(key[2]) if s not in found[key])
        lacking.append(f"step {key[0]} (world size {key[2]}) lacks shard(s) {missing}")
    return "; ".join(lacking) or "the surviving nodes hold none so new"


_Found = dict[tuple[int, str, int], dict[int, set[int]]]  # (step, attempt, world size) -> shard -> holders


def _usable(everyone: Iterable[tuple[int, list[Holding]]], unusable: Collection[Unusable]) -> _Found:
    found: _Found = {}
    for holder, held in everyone:
        for h in held:
            struck = {(h.step, h.attempt, h.world_size, s, r) for s in (h.shard, None) for r in (holder, None)}
            if not struck & set(unusable):
                found.setdefault((h.step, h.attempt, h.world_size), {}).setdefault(h.shard, set()).add(holder)
    return found


def _candidates(found: _Found, world_size: int, durable: int | None) -> Iterable[tuple[int, str, int]]:
    """The snapshots as new as `durable`, newest first; at one step the present world size, then the
    rest in a fixed order."""
    for key in sorted(found, key=lambda k: (-k[0], k[2] != world_size, k[2], k[1])):
        if durable is not None and key[0] < durable:
            return
        yield key


def agree(
    comm: Comm,
    held: list[Holding],
    durable: int | None,
    load: Callable[[Plan], list[Problem]],
) -> Plan | None:
    """The snapshot every rank loaded what it needs of (a collective), or None.

    `load(plan)` runs on every rank for the plan rank 0 chose and returns what went wrong there.
    """
    everyone = comm.gather((comm.rank, held))
    unusable: set[Unusable] = set()
    while True:
        plan = choose(everyone, comm.world_size, durable, unusable) if everyone else None
        plan = comm.broadcast(plan)
        if plan is None:
            if everyone is not None and not unusable and any(held for _, held in everyone):
                than = "" if durable is None else f" as new as the durable step {durable}"
                log.info("no whole snapshot%s in the nodes' memory: %s", than,
                         why_none(everyone, comm.world_size, durable))  # fmt: skip
            return None
        gathered = comm.gather(load(plan))
        if everyone is not None:
            for rank, problems in enumerate(gathered or []):
                for p in problems:
                    copy = f"shard {p.shard} from rank {p.holder}" if p.shard is not None else "the snapshot"
                    log.warning("snapshot of step %d (world size %d): rank %d cannot use %s (%s)", plan.step,
                                plan.world_size, rank, copy, p.why)  # fmt: skip
                    unusable.add((plan.step, plan.attempt, plan.world_size, p.shard, p.holder))
        if not comm.broadcast(any(gathered or [])):
            return plan
