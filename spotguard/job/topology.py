"""Where this process sits in the job: rank, world size, local rank and ranks per node, the key of its
checkpoint location, and the run's store."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket

import torch.distributed as dist

from cloud_adapters.stores import canonical_location
from spotguard.job.kvstore import Connection

# How long a starting guard waits for the rank before it to enter the same guard, when that rank has
# not yet: a TCPStore's own default timeout for a key nobody sets. The wait ends as soon as that rank
# arrives, so this only bounds how late a rank that is gone, or a split (see _meet), is reported.
MEET_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    local_rank: int
    distributed: bool
    node: str = "local"  # which node (VM) this process runs on; see node_name()

    @property
    def is_node_leader(self) -> bool:
        """Local rank 0 polls the cloud for its node (metadata services throttle)."""
        return self.local_rank == 0

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0


def node_name(rank: int) -> str:
    """A name for this process's node: its host, plus torchrun's GROUP_RANK (the node rank) so
    that several "nodes" on one host are told apart; without LOCAL_RANK each rank is a node."""
    host = socket.gethostname()
    if "GROUP_RANK" in os.environ:
        return f"{host}/node-{os.environ['GROUP_RANK']}"
    return host if "LOCAL_RANK" in os.environ else f"{host}/rank-{rank}"


def current() -> Topology:
    """Read the process group, or the torchrun environment when there is none."""
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
        return Topology(rank, dist.get_world_size(), local_rank(rank), True, node_name(rank))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise RuntimeError(
            f"WORLD_SIZE={world} but no torch.distributed process group is initialised: call "
            "torch.distributed.init_process_group() before entering the Guard, or give the Guard "
            "store=, rank= and world_size="
        )
    return Topology(0, 1, 0, False, node_name(0))


def explicit(rank: int, world_size: int, local: int | None = None, node: str | None = None) -> Topology:
    """The topology a caller states, as `init_process_group(store=, rank=, world_size=)` takes it (its
    values checked at `Guard()`, by CoordinationOptions): several Guards can then live in one process.
    Where a default process group exists, it must agree: checked here, when the guard starts or first
    saves, since the group may be made after `Guard()`."""
    if dist.is_available() and dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise ValueError(
                f"rank={rank}, world_size={world_size} differ from the default process group's "
                f"({dist.get_rank()}, {dist.get_world_size()})"
            )
    if local is None:
        local = local_rank(rank)
        if local > rank:
            raise ValueError(f"LOCAL_RANK={local} exceeds the stated rank {rank}: state local_rank= too")
    return Topology(rank, world_size, local, world_size > 1, node or node_name(rank))


def run_prefix(store: dist.Store, group: dist.ProcessGroup | None, topology: Topology, checkpoint_dir: str) -> str:
    """A store prefix unique to this Guard in this job, the same on every rank.

    Under the job's key (torchrun's run id and a key of the normalised `checkpoint_dir`, so that two
    jobs sharing a store never meet): torchrun's agents keep their store across worker restarts, and
    count restarts differently (an agent whose own workers failed counts one, the others restart theirs
    without counting; a node that joined later has fewer), so with a process group rank 0 draws a
    number from the store and tells the others through the group. Without one (a topology the caller
    stated, before any process group), each rank counts the Guards it has entered under the attempt's
    key: the world size, and torchrun's restart count where one agent runs every rank (on several
    nodes it would split the ranks of one attempt). The k-th Guard of every rank is one Guard; a rank
    that never entered in an earlier attempt under the same key leaves the counts apart for good,
    which `_meet` reports as the Guard starts.
    """
    job = f"spotguard/{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}/{location_key(checkpoint_dir)}/"
    if group is None and topology.distributed:
        attempt = f"{job}w{topology.world_size}/"
        if "TORCHELASTIC_RESTART_COUNT" in os.environ and os.environ.get("GROUP_WORLD_SIZE", "1") == "1":
            attempt += f"r{os.environ['TORCHELASTIC_RESTART_COUNT']}/"
        return _meet(store, attempt, topology.rank, topology.world_size)
    # Rank 0's whole prefix: a location may resolve differently on another node (its mounts, $HOME).
    drawn = [f"{job}{store.add(f'{job}guards', 1)}/" if group is None or dist.get_rank() == 0 else None]
    if group is not None:
        dist.broadcast_object_list(drawn, src=0, group=group)
    return drawn[0]


def _meet(store: dist.Store, base: str, rank: int, world: int) -> str:
    """This rank's k-th Guard under `base`, once its neighbours' counts allow them to be in their k-th
    too: a one-line RuntimeError where they cannot. O(1) requests (an `add`, a `set`, a count of each
    neighbour, at most one wait), never a read of every rank's key.

    Counts only grow, so a neighbour past k, or short of k - 1, can never be in this Guard. One at k - 1
    has not entered yet, or (the split) it is in its previous Guard for good: a rank waits for the rank
    before it to arrive, never for a later one, so ranks started one by one in rank order (threads of
    one process) never wait for one not started yet. Rank 0 waits for none: the counts it reads catch
    most splits there, not all (docs/limits.md).
    """
    count = store.add(f"{base}entered/{rank}", 1)
    prefix = f"{base}e{count}/"
    store.set(f"{prefix}arrived/{rank}", "1")
    before = (rank - 1) % world
    counts = {other: store.add(f"{base}entered/{other}", 0) for other in dict.fromkeys((before, (rank + 1) % world))}
    for other, theirs in counts.items():
        if not count - 1 <= theirs <= count:
            raise _split(rank, count, other, f"has entered {theirs}")
    if rank > 0 and counts[before] < count:
        if Connection(store, own=False).get(f"{prefix}arrived/{before}", MEET_TIMEOUT_S) is None:
            raise _split(rank, count, before, f"has entered {counts[before]} and no other in {MEET_TIMEOUT_S:g} s")
    return prefix


def _split(rank: int, count: int, other: int, what: str) -> RuntimeError:
    return RuntimeError(
        f"rank {rank} enters its guard no. {count} on this store but rank {other} {what}, so they would never "
        f"meet to save: is rank {other} running? Else a rank missed its guard in an earlier attempt on this "
        "store; give each attempt a store of its own, or start the guards after init_process_group()"
    )


def local_rank(rank: int) -> int:
    """This process's rank on its node: torchrun's LOCAL_RANK, else `rank` (one process per node)."""
    return int(os.environ.get("LOCAL_RANK", rank))


def ranks_per_node() -> int:
    """How many ranks each node runs (torchrun's LOCAL_WORLD_SIZE, else 1); a node's ranks are consecutive."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def node_count(world_size: int) -> int | None:
    """How many nodes of `ranks_per_node()` ranks the job has, or None for an uneven layout: that count
    does not divide the world size or, where torchrun says how many nodes there are (GROUP_WORLD_SIZE),
    times that many it is not the world size. A node whose own count happens to fit an uneven job
    (nodes of 1, 2 and 3 ranks: the node of 2) cannot tell."""
    per_node = ranks_per_node()
    nodes = os.environ.get("GROUP_WORLD_SIZE", "")
    if world_size % per_node or (nodes.isdigit() and per_node * int(nodes) != world_size):
        return None
    return world_size // per_node


def layout_said() -> str:
    """The counts a layout is judged by, for a log line."""
    said = f"LOCAL_WORLD_SIZE={ranks_per_node()}"
    return said + (f", GROUP_WORLD_SIZE={os.environ['GROUP_WORLD_SIZE']}" if "GROUP_WORLD_SIZE" in os.environ else "")


def location_key(checkpoint_dir: str) -> str:
    """A short key of the location as its store names it: the same for every spelling of one place."""
    return hashlib.sha256(canonical_location(checkpoint_dir).encode()).hexdigest()[:16]
