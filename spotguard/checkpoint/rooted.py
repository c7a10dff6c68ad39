"""Objects gathered to rank 0 and scattered from it, one message between rank 0 and each other rank.

torch's `gather_object` all-gathers the sizes first (gloo's ring: N - 1 steps in a row, each through
every rank) and pads every rank's bytes to the largest; its `scatter_object_list` broadcasts the
largest size and scatters every object padded to it. Here each rank's size goes to or from rank 0 in
one gather or scatter of a single number, then its bytes alone, received into a buffer of that size:
rank 0 handles N messages of their own sizes, and no other rank waits on another.

The protocols run over a `Wire`, the few tensor operations they need: a group registered with
torch (`GroupWire`), or a bare process group (the save path's simulation in `bench/save_scale.py`).
"""

from __future__ import annotations

import pickle
from typing import Any, Protocol

import torch
import torch.distributed as dist

BYTES_TAG = 0x5347  # the messages to and from rank 0: never matched by the group's other users' sends or recvs


class Wire(Protocol):
    """Tensor operations on one group, ranks in the group's numbering (rank 0 the root)."""

    def gather(self, size: torch.Tensor, sizes: list[torch.Tensor] | None) -> None: ...
    def scatter(self, size: torch.Tensor, sizes: list[torch.Tensor] | None) -> None: ...
    def isend(self, data: torch.Tensor, peer: int) -> Any: ...  # a Work
    def irecv(self, data: torch.Tensor, peer: int) -> Any: ...


class GroupWire:
    """A `Wire` on a process group that torch.distributed knows (src and dst as global ranks)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)  # looked up once: get_global_rank scans them each call
        self.root = self.ranks[0]

    def gather(self, size: torch.Tensor, sizes: list[torch.Tensor] | None) -> None:
        dist.gather(size, gather_list=sizes, dst=self.root, group=self.group)

    def scatter(self, size: torch.Tensor, sizes: list[torch.Tensor] | None) -> None:
        dist.scatter(size, scatter_list=sizes, src=self.root, group=self.group)

    def isend(self, data: torch.Tensor, peer: int) -> Any:
        return dist.isend(data, dst=self.ranks[peer], group=self.group, tag=BYTES_TAG)

    def irecv(self, data: torch.Tensor, peer: int) -> Any:
        return dist.irecv(data, src=self.ranks[peer], group=self.group, tag=BYTES_TAG)


def gather_bytes(wire: Wire, rank: int, world: int, data: bytes) -> list[memoryview] | None:
    """Every rank's `data` on rank 0, in rank order (rank 0's own as given); None on the other ranks."""
    size = torch.tensor([len(data)], dtype=torch.long)
    if rank != 0:
        wire.gather(size, None)
        wire.isend(_tensor(data), 0).wait()
        return None
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    wire.gather(size, sizes)
    buffers = [torch.empty(int(n), dtype=torch.uint8) for n in sizes[1:]]
    _wait([wire.irecv(b, r) for r, b in enumerate(buffers, 1)])
    return [memoryview(data), *(memoryview(b.numpy()) for b in buffers)]


def scatter_bytes(wire: Wire, rank: int, world: int, datas: list[bytes] | None) -> memoryview:
    """Rank i's `datas[i]`, from rank 0's `datas` (the other ranks pass None)."""
    out = torch.zeros(1, dtype=torch.long)
    if rank != 0:
        wire.scatter(out, None)
        buffer = torch.empty(int(out), dtype=torch.uint8)
        wire.irecv(buffer, 0).wait()
        return memoryview(buffer.numpy())
    if datas is None or len(datas) != world:
        raise ValueError(f"rank 0 scatters one object per rank: {world} expected, got {datas and len(datas)}")
    wire.scatter(out, [torch.tensor([len(d)], dtype=torch.long) for d in datas])
    _wait([wire.isend(_tensor(d), r) for r, d in enumerate(datas[1:], 1)])
    return memoryview(datas[0])


def gather_objects(wire: Wire, rank: int, world: int, obj: Any) -> list[Any] | None:
    """`gather_bytes` of pickled objects: rank 0 gets each rank's a copy (its own too, as torch's gives it)."""
    gathered = gather_bytes(wire, rank, world, pickle.dumps(obj))
    return None if gathered is None else [pickle.loads(b) for b in gathered]


def scatter_objects(wire: Wire, rank: int, world: int, objs: list[Any] | None) -> Any:
    """`scatter_bytes` of pickled objects: rank i's a copy of `objs[i]`."""
    datas = None if objs is None else [pickle.dumps(o) for o in objs]
    return pickle.loads(scatter_bytes(wire, rank, world, datas))


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()
