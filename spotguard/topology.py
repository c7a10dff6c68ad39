"""Where this process sits in the job: rank, world size, local rank, and the run's store."""

from __future__ import annotations

import dataclasses
import os
import socket

import torch.distributed as dist

from spotguard.checkpoint.comm import local_rank


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
    """The topology a caller states, as `init_process_group(store=, rank=, world_size=)` takes it:
    several Guards can then live in one process. Where a default process group exists, it must agree."""
    for name, value in (("rank", rank), ("world_size", world_size), ("local_rank", local)):
        if value is not None and (type(value) is not int or value < 0):
            raise ValueError(f"{name} must be an int >= 0, not {value!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, world_size={world_size}), not {rank}")
    if (
        dist.is_available()
        and dist.is_initialized()
        and (dist.get_rank(), dist.get_world_size())
        != (
            rank,
            world_size,
        )
    ):
        raise ValueError(
            f"rank={rank}, world_size={world_size} differ from the default process group's "
            f"({dist.get_rank()}, {dist.get_world_size()})"
        )
    local = local_rank(rank) if local is None else local
    if local > rank:
        raise ValueError(f"local_rank ({local}) cannot exceed rank ({rank})")
    return Topology(rank, world_size, local, world_size > 1, node or node_name(rank))


def run_prefix(store: dist.Store, group: dist.ProcessGroup | None, topology: Topology) -> str:
    """A store prefix unique to this Guard in this job, the same on every rank.

    torchrun's agents keep their store across worker restarts, and an elastic job's agents count
    restarts differently (a node that joined later has fewer), so with a process group rank 0 draws
    a number from the store and tells the others through the group. Without one (a topology the
    caller stated, before any process group), each rank counts the Guards it has entered on this
    store: the k-th Guard of every rank is one Guard, so each job attempt needs a store of its own.
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    if group is None and topology.distributed:
        entered = store.add(f"spotguard/{run_id}/entered/{topology.rank}", 1)
        return f"spotguard/{run_id}/e{entered}/"
    drawn = [store.add(f"spotguard/{run_id}/guards", 1) if group is None or dist.get_rank() == 0 else None]
    if group is not None:
        dist.broadcast_object_list(drawn, src=0, group=group)
    return f"spotguard/{run_id}/{drawn[0]}/"
