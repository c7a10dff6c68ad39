"""Where this process sits in the job: rank, world size, local rank, and the run's store."""

from __future__ import annotations

import dataclasses
import os
import socket

import torch.distributed as dist


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


def local_rank(rank: int) -> int:
    """This process's rank on its node: torchrun's LOCAL_RANK, else `rank` (one process per node)."""
    return int(os.environ.get("LOCAL_RANK", rank))


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
            "torch.distributed.init_process_group() before entering the Guard"
        )
    return Topology(0, 1, 0, False, node_name(0))


def run_prefix(store: dist.Store, group: dist.ProcessGroup | None) -> str:
    """A store prefix unique to this Guard in this job, the same on every rank of `group`.

    torchrun's agents keep their store across worker restarts, and an elastic job's agents count
    restarts differently (a node that joined later has fewer), so rank 0 draws a number from the
    store and tells the others.
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    drawn = [store.add(f"spotguard/{run_id}/guards", 1) if group is None or dist.get_rank() == 0 else None]
    if group is not None:
        dist.broadcast_object_list(drawn, src=0, group=group)
    return f"spotguard/{run_id}/{drawn[0]}/"
