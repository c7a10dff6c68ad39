"""The few collectives the checkpoint layer needs, on its own process group (or none at all)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from spotguard.checkpoint import rooted
from spotguard.job.sockets import GROUP_SOCKETS
from spotguard.job.topology import local_rank

# DCP reports failures as CheckpointException, a BaseException: catch both.
FAILURES = (Exception, CheckpointException)
LAZY_GLOO_ENV = "TORCH_GLOO_LAZY_INIT"
_env_lock = threading.Lock()


def new_gloo_group(ranks: Sequence[int] | None = None, *, at_once: bool = False, **kwargs: Any) -> dist.ProcessGroup:
    """A gloo group whose ranks connect pair by pair, when a collective first needs the pair.

    Made the default way, a gloo group connects every pair of its N ranks at once, through the
    job's store: N writes and N^2 reads (a million at 1,024 ranks, on the one store server, and
    an emergency's survivor group is made inside the deadline). torch reads TORCH_GLOO_LAZY_INIT
    when it makes a gloo group: with it, the group costs the N writes, and each collective only
    the pairs it uses (to and from rank 0 for the checkpoint's gathers and broadcasts).

    `at_once`: connected the default way, its sockets recorded (`GROUP_SOCKETS`), so that a collective
    waiting on a node gone silent can be left (in-process recovery: the default group is made so too).
    """
    with gloo_connects(lazily=not at_once), GROUP_SOCKETS.recording() if at_once else contextlib.nullcontext():
        return dist.new_group(ranks, backend="gloo", **kwargs)


@contextlib.contextmanager
def gloo_connects(*, lazily: bool) -> Iterator[None]:
    """Gloo groups made meanwhile connect their pairs lazily (at first use) or at once, whatever the
    environment says (torch reads TORCH_GLOO_LAZY_INIT as it makes a group)."""
    with _env_lock:
        before = os.environ.get(LAZY_GLOO_ENV)
        if lazily:
            os.environ[LAZY_GLOO_ENV] = "1"
        else:
            os.environ.pop(LAZY_GLOO_ENV, None)
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(LAZY_GLOO_ENV, None)
            else:
                os.environ[LAZY_GLOO_ENV] = before


class Comm:
    """Rank, world size and object collectives on `group`.

    With no initialized process group everything degrades to a single process; with one
    but no `group`, a dedicated gloo group is created.
    Every collective here runs on `group` only, so checkpoint traffic never interleaves
    with training collectives on the default group.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed and group is None:
            # A group of our own (collective: every rank constructs its Checkpointer in the same order).
            group = new_gloo_group()
        self.group = group if self.distributed else None
        self.rank = dist.get_rank(self.group) if self.distributed else 0
        self.world_size = dist.get_world_size(self.group) if self.distributed else 1
        # One rank per node does the node-local disk work (download, local retention); without
        # LOCAL_RANK each rank is its own node, as the Guard's Topology sees it.
        self.local_rank = local_rank(dist.get_rank()) if self.distributed else 0
        self.host = socket.gethostname()

    def _global(self, group_rank: int) -> int:
        """The global rank of `group_rank` (the src/dst arguments older torch versions understand)."""
        return dist.get_global_rank(self.group, group_rank)

    @property
    def members(self) -> list[int]:
        """The global ranks of the group, in group-rank order."""
        return [self._global(r) for r in range(self.world_size)] if self.distributed else [0]

    @contextlib.contextmanager
    def dcp_args(self) -> Iterator[dict[str, Any]]:
        """Keyword arguments for dcp.save/dcp.load on this group.

        In a single process DCP warns that it assumes no process group, which is the intent.
        """
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield {"process_group": self.group, "no_dist": not self.distributed}

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    @property
    def is_node_leader(self) -> bool:
        return self.local_rank == 0

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(0), group=self.group)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def scatter(self, objs: list[Any] | None) -> Any:
        """Rank i's `objs[i]`, from rank 0's `objs` (the others pass None): on gloo one message from
        rank 0 to each rank (`rooted`), with no broadcast and no padding to the largest."""
        if not self.distributed:
            return objs[0] if objs else None
        if not self._on_gloo:  # NCCL alone: torch's, on the device
            out: list[Any] = [None]
            dist.scatter_object_list(out, objs if self.is_coordinator else None, src=self._global(0), group=self.group)
            return out[0]
        return rooted.scatter_objects(rooted.GroupWire(self.group), self.rank, self.world_size, objs)

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` on rank 0 (None elsewhere): on gloo one message from each rank to rank 0
        (`rooted`), with no ring of sizes through every rank and no padding to the largest."""
        if not self.distributed:
            return [obj]
        if not self._on_gloo:
            out: list[Any] | None = [None] * self.world_size if self.is_coordinator else None
            dist.gather_object(obj, out, dst=self._global(0), group=self.group)
            return out
        return rooted.gather_objects(rooted.GroupWire(self.group), self.rank, self.world_size, obj)

    @property
    def _on_gloo(self) -> bool:
        """The group runs CPU tensors on gloo: "gloo", or a mixed group such as "cpu:gloo,cuda:nccl"."""
        backend = dist.get_backend(self.group)
        return backend == "gloo" or "cpu:gloo" in backend.split(",")


def describe(exc: BaseException, rank: int | None = None) -> str:
    """One line per failing rank, without DCP's tracebacks; `rank` names the rank of an error that
    does not say which one it is (DCP's do: they are not named twice)."""
    if isinstance(exc, CheckpointException):
        return "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in sorted(exc.failures.items()))
    return f"{'' if rank is None else f'rank {rank}: '}{type(exc).__name__}: {exc}"
