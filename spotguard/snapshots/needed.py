"""Which shards of a snapshot each rank needs to load its state at another world size.

A rank needs only the shards holding a chunk that overlaps one of its own: one or two after a
shrink or a growth of a row-sharded state, one for a replicated one. Sending every shard's index to
every rank instead costs N times the whole index (at 1,024 ranks of an FSDP2 model, tens of MB to
each rank, unpickled by each). So each rank sends rank 0 the layout of the shards it read and of
its own state as arrays (`Layout`), rank 0 matches them with a few sorted searches over all the
chunks at once (`shards_needed`), and each rank then reads the indexes of its shards only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType

from spotguard.snapshots.items import BYTES, StoredItem


@dataclasses.dataclass(frozen=True)
class Layout:
    """Chunks of a state: chunk i is part of `fqns[i]`, at `offsets[i]` of `sizes[i]` (int64, n x d; a
    dimension a chunk lacks, as a non-tensor value lacks all, counts as one of size 1 at 0)."""

    fqns: tuple[str, ...]
    offsets: torch.Tensor
    sizes: torch.Tensor

    @classmethod
    def of(cls, chunks: Sequence[tuple[str, tuple[int, ...], tuple[int, ...]]]) -> Layout:
        dims = max([1, *(len(o) for _, o, _ in chunks)])  # a value: a chunk [0] of [1]
        offsets = [list(o) + [0] * (dims - len(o)) for _, o, _ in chunks]
        sizes = [list(s) + [1] * (dims - len(s)) for _, _, s in chunks]
        return cls(
            tuple(f for f, _, _ in chunks),
            torch.tensor(offsets, dtype=torch.int64).reshape(len(chunks), dims),
            torch.tensor(sizes, dtype=torch.int64).reshape(len(chunks), dims),
        )

    def widened(self, dims: int) -> tuple[torch.Tensor, torch.Tensor]:
        """offsets and sizes with `dims` dimensions."""
        more = dims - self.offsets.shape[1]
        n = len(self.fqns)
        return (
            torch.cat([self.offsets, torch.zeros(n, more, dtype=torch.int64)], 1),
            torch.cat([self.sizes, torch.ones(n, more, dtype=torch.int64)], 1),
        )


def shard_layout(items: Iterable[StoredItem]) -> Layout:
    """The chunks a snapshot file holds, from its index."""
    return Layout.of([(i.fqn, (), ()) if i.dtype == BYTES else (i.fqn, i.chunk_offsets, i.chunk_sizes) for i in items])


def state_layout(state_dict: Mapping[str, Any]) -> Layout:
    """The chunks of this rank's (DCP) state dict, as DCP's planner names them; no value is read."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(dict(state_dict), is_coordinator=True)
    chunks: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    for item in planner.create_local_plan().items:
        if item.type == WriteItemType.BYTE_IO:
            chunks.append((item.index.fqn, (), ()))
        else:
            chunk = item.tensor_data.chunk
            chunks.append((item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes)))
    return Layout.of(chunks)


_FQN_SHIFT = 40  # sort keys: a chunk's name's number above its start (starts below 2**40)
_EMPTY = torch.zeros(0, dtype=torch.int64)


def shards_needed(
    shards: Mapping[int, Layout], wants: Sequence[Layout], local_by_rank: Sequence[Sequence[int]]
) -> list[list[int]]:
    """For each rank (`wants[r]`: its state's layout), the shards holding a chunk its state overlaps.

    Of the shards holding the same chunk (a replicated tensor, a value every rank saved), a rank reads
    one: one held on its node (`local_by_rank[r]`, in order) that it needs anyway, else its own shard,
    else the first there; with none on its node, one it needs anyway, else its own, else the first.
    A chunk no shard holds needs none: the rank's load planner reports what is missing.
    """
    if not wants or not any(len(layout.fqns) for layout in shards.values()):
        return [[] for _ in wants]
    names = _Names()
    dims = max(layout.offsets.shape[1] for layout in [*shards.values(), *wants, Layout.of([])])
    stored = _Chunks.of(shards, names, dims)
    rank_of = torch.cat([torch.full((len(w.fqns),), r, dtype=torch.int64) for r, w in enumerate(wants)] or [_EMPTY])
    want_fqn = torch.cat([names.of(w.fqns, add=False) for w in wants] or [_EMPTY])
    widened = [w.widened(dims) for w in wants]
    want_off = torch.cat([o for o, _ in widened] or [_EMPTY.reshape(0, dims)])
    want_size = torch.cat([s for _, s in widened] or [_EMPTY.reshape(0, dims)])
    known = want_fqn >= 0
    rank_of, want_fqn, want_off, want_size = rank_of[known], want_fqn[known], want_off[known], want_size[known]

    # The candidates of each wanted chunk: along its tensor's sweep dimension, from the last cut at or
    # before its start (DTensor layouts cut each dimension alike everywhere: `safe_pickle.untiled`; a
    # layout that is no grid may lose a chunk here, and the rank's load then fails on what it misses)
    # up to its end.
    sweep = stored.sweep[want_fqn]
    start = want_off.gather(1, sweep[:, None]).squeeze(1)
    end = start + want_size.gather(1, sweep[:, None]).squeeze(1)
    base = want_fqn << _FQN_SHIFT
    last = torch.searchsorted(stored.keys, base + start, right=True) - 1
    same = (last >= 0) & (stored.keys[last.clamp(min=0)] >= base)
    first = torch.where(
        same, torch.searchsorted(stored.keys, stored.keys[last.clamp(min=0)]), torch.searchsorted(stored.keys, base)
    )
    stop = torch.searchsorted(stored.keys, base + end)
    counts = (stop - first).clamp(min=0)
    want = torch.repeat_interleave(torch.arange(len(counts)), counts)
    chunk = first[want] + torch.arange(len(want)) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    overlap = (
        (stored.offsets[chunk] < want_off[want] + want_size[want])
        & (want_off[want] < stored.offsets[chunk] + stored.sizes[chunk])
    ).all(1)
    want, chunk = want[overlap], chunk[overlap]
    return stored.pick(rank_of[want], chunk, len(wants), local_by_rank)


@dataclasses.dataclass
class _Chunks:
    """Every distinct saved chunk, sorted by its name's number and its start along its tensor's sweep
    dimension (the one cut into the most pieces), with the shards that hold it."""

    keys: torch.Tensor  # the sort key of each chunk
    offsets: torch.Tensor
    sizes: torch.Tensor
    sweep: torch.Tensor  # by name's number: the sweep dimension
    holder: torch.Tensor  # the shard holding each chunk; -1: several (`groups`)
    group: torch.Tensor  # of a chunk several shards hold: which of `groups`
    groups: list[list[int]]  # sets of shards holding the same chunks, in order

    @classmethod
    def of(cls, shards: Mapping[int, Layout], names: _Names, dims: int) -> _Chunks:
        order = sorted(shards)
        fqn = torch.cat([names.of(shards[s].fqns, add=True) for s in order] or [_EMPTY])
        shard = torch.cat([torch.full((len(shards[s].fqns),), s, dtype=torch.int64) for s in order] or [_EMPTY])
        widened = [shards[s].widened(dims) for s in order]
        offsets = torch.cat([o for o, _ in widened] or [_EMPTY.reshape(0, dims)])
        sizes = torch.cat([s for _, s in widened] or [_EMPTY.reshape(0, dims)])
        # One row per distinct chunk (name and offsets); its copies together, in shard order.
        rows, inverse = _unique_rows(torch.cat([fqn[:, None], offsets], 1))
        copies = torch.bincount(inverse, minlength=len(rows))
        by_chunk = inverse.argsort(stable=True)
        bounds = torch.cat([torch.zeros(1, dtype=torch.int64), copies.cumsum(0)])
        first_copy = by_chunk[bounds[:-1]]
        holder = torch.where(copies == 1, shard[first_copy], -1)
        group = torch.full((len(rows),), -1, dtype=torch.int64)
        seen: dict[tuple[int, ...], int] = {}
        held_by = shard[by_chunk].tolist()
        edges = bounds.tolist()
        for u in (copies > 1).nonzero().squeeze(1).tolist():  # replicated tensors and values: few
            group[u] = seen.setdefault(tuple(held_by[edges[u] : edges[u + 1]]), len(seen))
        sweep = _sweep_dims(rows[:, 0], rows[:, 1:], len(names))
        keys = (rows[:, 0] << _FQN_SHIFT) + rows[:, 1:].gather(1, sweep[rows[:, 0]][:, None]).squeeze(1)
        by_key = keys.argsort(stable=True)
        return cls(
            keys[by_key],
            rows[by_key, 1:],
            sizes[first_copy][by_key],
            sweep,
            holder[by_key],
            group[by_key],
            [list(members) for members in seen],
        )

    def pick(
        self, ranks: torch.Tensor, chunks: torch.Tensor, world: int, local_by_rank: Sequence[Sequence[int]]
    ) -> list[list[int]]:
        """The shards each rank reads, from the (rank, chunk) pairs it overlaps."""
        single = self.holder[chunks] >= 0
        pairs = torch.unique(ranks[single] * (1 << 32) + self.holder[chunks[single]])
        needed: list[set[int]] = [set() for _ in range(world)]
        for rank, shard in zip((pairs >> 32).tolist(), (pairs & 0xFFFFFFFF).tolist()):
            needed[rank].add(shard)
        shared = torch.unique(ranks[~single] * (1 << 32) + self.group[chunks[~single]])
        for rank, group in zip((shared >> 32).tolist(), (shared & 0xFFFFFFFF).tolist()):
            needed[rank].add(_one_of(self.groups[group], rank, local_by_rank[rank], needed[rank]))
        return [sorted(shards) for shards in needed]


def _one_of(members: list[int], rank: int, local: Sequence[int], needed: set[int]) -> int:
    held = set(members)
    here = [shard for shard in local if shard in held]
    if here:
        return next((shard for shard in here if shard in needed), rank if rank in here else here[0])
    if among := needed & held:
        return min(among)
    return rank if rank in held else members[0]


class _Names:
    """Numbers for tensor names. The ranks' lists are mostly one list: each distinct one is numbered once."""

    def __init__(self) -> None:
        self.numbers: dict[str, int] = {}
        self._lists: dict[tuple[tuple[str, ...], bool], torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.numbers)

    def of(self, fqns: tuple[str, ...], *, add: bool) -> torch.Tensor:
        """The numbers of `fqns` (-1: unknown), numbering new ones with `add`."""
        found = self._lists.get((fqns, add))
        if found is None:
            get = (
                (lambda f: self.numbers.setdefault(f, len(self.numbers)))
                if add
                else (lambda f: self.numbers.get(f, -1))
            )
            found = self._lists[fqns, add] = torch.tensor([get(f) for f in fqns], dtype=torch.int64)
        return found


def _sweep_dims(fqn: torch.Tensor, offsets: torch.Tensor, names: int) -> torch.Tensor:
    """By name's number: the dimension along which its chunks start at the most places."""
    dims = offsets.shape[1]
    cuts = torch.zeros(names, dims, dtype=torch.int64)
    for d in range(dims):
        starts = torch.unique((fqn << _FQN_SHIFT) + offsets[:, d])
        cuts[:, d] = torch.bincount(starts >> _FQN_SHIFT, minlength=names)
    return cuts.argmax(1)


def _unique_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.unique(rows, dim=0, return_inverse=True), by one stable sort per column (many times faster)."""
    order = torch.arange(len(rows))
    for column in reversed(range(rows.shape[1])):
        order = order[rows[order, column].argsort(stable=True)]
    ordered = rows[order]
    new = torch.ones(len(rows), dtype=torch.bool)
    new[1:] = (ordered[1:] != ordered[:-1]).any(1)
    inverse = torch.empty_like(order)
    inverse[order] = new.cumsum(0) - 1
    return ordered[new], inverse
