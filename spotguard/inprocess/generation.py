"""A generation of an in-process job: who is in it, and the process group it trains with.

Generation 0 is the job as the launcher started it. After a departure or a loss the survivors form generation
g + 1 among themselves, in their old rank order, without restarting: the group of generation g is
dropped and a new one is made on the job's store under `spotguard/generation/<g>/`. A rank of an
older generation can never write into a newer one: every key of a group, and of the guard that runs
on it, lives under its generation's prefix, and the store's `spotguard/generation` only moves forward
(a rank that finds it past its own generation is not a member of the newer one and must leave).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from spotguard.checkpoint.comm import gloo_connects
from spotguard.job.kvstore import Connection
from spotguard.job.sockets import GROUP_SOCKETS
from spotguard.job.topology import ranks_per_node

log = logging.getLogger(__name__)

CURRENT_KEY = "spotguard/generation"  # the newest generation formed, in the job's store (only grows)
FORM_TIMEOUT_S = 60.0  # the longest a member waits for the others to reach a new generation's group


class Fenced(RuntimeError):
    """This rank belongs to an older generation than the job's: it is not a member any more."""


class FormError(RuntimeError):
    """A generation's group could not be formed (a member never came)."""


@dataclasses.dataclass(frozen=True)
class Generation:
    """One membership of the job. `members`: the generation-0 ranks of its processes, in rank order (a
    process keeps its generation-0 rank as its name); `me`: this process's generation-0 rank."""

    number: int
    members: tuple[int, ...]
    me: int

    @property
    def rank(self) -> int:
        return self.members.index(self.me)

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def prefix(self) -> str:
        return f"spotguard/generation/{self.number}/"

    def without(self, staying: tuple[int, ...]) -> Generation:
        """The next generation: the ranks of this one in `staying` (this generation's ranks, in order)."""
        if self.rank not in staying:
            raise Fenced(f"rank {self.rank} of generation {self.number} does not stay in the next one")
        return Generation(self.number + 1, tuple(self.members[r] for r in staying), self.me)


def form(generation: Generation, base: dist.Store, backend: str, timeout: timedelta | None) -> None:
    """Make `generation`'s default process group on the job's store `base`, once every member has come
    (within FORM_TIMEOUT_S: else FormError, and nothing is made), and tell the processes' environment
    its rank and size (RANK, WORLD_SIZE, GROUP_WORLD_SIZE), as a launcher would. The group's operations
    time out after `timeout` (default: torch's for gloo, 30 minutes); its connecting, after
    FORM_TIMEOUT_S, should a member die once it has come."""
    store = dist.PrefixStore(generation.prefix, base)
    if generation.number > 0:
        _fence(generation, base)
        _meet(generation, store)
    _tell_environment(generation)
    # Connected at once, so that its sockets are known: a collective waiting on a silent peer is left by
    # shutting them down (job/sockets.py).
    GROUP_SOCKETS.forget()
    connecting = timedelta(seconds=FORM_TIMEOUT_S)
    with gloo_connects(lazily=False), GROUP_SOCKETS.recording():
        dist.init_process_group(backend, store=store, rank=generation.rank, world_size=generation.world_size,
                                timeout=connecting)  # fmt: skip
    dist.distributed_c10d._set_pg_timeout(timeout or default_pg_timeout)  # private, in torch since 2.2


def drop() -> None:
    """Drop the default process group of the generation that ends (nothing of it is in flight)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _fence(generation: Generation, base: dist.Store) -> None:
    """Move the job's generation forward to `generation`: a Fenced error when the job is past it already."""
    number = generation.number
    base.compare_set(CURRENT_KEY, "", "0")  # the first recovery starts the count: generation 0 writes nothing
    seen = int(base.compare_set(CURRENT_KEY, str(number - 1), str(number)).decode())
    if seen > number:
        raise Fenced(f"the job is at generation {seen} already; this process, of generation {number - 1}, is not "
                     "a member")  # fmt: skip
    if seen < number:
        raise FormError(f"the job's generation is {seen}: generation {number} cannot follow it")


def _meet(generation: Generation, store: dist.Store) -> None:
    """Block (on the store server) until every member has arrived: O(1) requests a member."""
    if store.add("arrived", 1) == generation.world_size:
        store.set("all", "1")
    started = time.monotonic()
    if Connection(store, own=False).get("all", FORM_TIMEOUT_S) is None:
        raise FormError(
            f"generation {generation.number}: not every one of its {generation.world_size} members came within "
            f"{FORM_TIMEOUT_S:.0f} s"
        )
    log.debug("generation %d: every member came in %.3f s", generation.number, time.monotonic() - started)


def _tell_environment(generation: Generation) -> None:
    os.environ["RANK"] = str(generation.rank)
    os.environ["WORLD_SIZE"] = str(generation.world_size)
    os.environ["ROLE_RANK"] = str(generation.rank)
    os.environ["ROLE_WORLD_SIZE"] = str(generation.world_size)
    if "GROUP_WORLD_SIZE" in os.environ:  # GROUP_RANK stays: it names the node (its snapshots, its exit file)
        os.environ["GROUP_WORLD_SIZE"] = str(generation.world_size // ranks_per_node())
