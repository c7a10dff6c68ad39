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

import numpy as np
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType

from spotguard.snapshots.items import BYTES, StoredItem


@dataclasses.dataclass(frozen=True)
class Layout:
    """Chunks of a state: chunk i is part of `fqns[i]`, at `offsets[i]` of `sizes[i]` (int64, n x d; a
    dimension a chunk lacks, as a non-tensor value lacks all, counts as one of size 1 at 0)."""

    fqns: tuple[str, ...]
    offsets: np.ndarray
    sizes: np.ndarray

    @classmethod
    def of(cls, chunks: Sequence[tuple[str, tuple[int, ...], tuple[int, ...]]]) -> Layout:
        dims = max([1, *(len(o) for _, o, _ in chunks)])  # a value: a chunk [0] of [1]
        offsets = [list(o) + [0] * (dims - len(o)) for _, o, _ in chunks]
        sizes = [list(s) + [1] * (dims - len(s)) for _, _, s in chunks]
        return cls(
            tuple(f for f, _, _ in chunks),
            np.array(offsets, dtype=np.int64).reshape(len(chunks), dims),
            np.array(sizes, dtype=np.int64).reshape(len(chunks), dims),
        )

    def widened(self, dims: int) -> tuple[np.ndarray, np.ndarray]:
        """offsets and sizes with `dims` dimensions."""
        more = ((0, 0), (0, dims - self.offsets.shape[1]))
        return np.pad(self.offsets, more), np.pad(self.sizes, more, constant_values=1)


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


def shards_needed(
    shards: Mapping[int, Layout], wants: Sequence[Layout], local_by_rank: Sequence[Sequence[int]]
) -> list[list[int]]:
    """For each rank (`wants[r]`: its state's layout), the shards holding a chunk its state overlaps.

    Of the shards holding the same chunk (a replicated tensor, a value every rank saved), a rank reads
    one: one held on its node (`local_by_rank[r]`, in order) that it needs anyway, else its own shard,
    else the first there; with none on its node, one it needs anyway, else its own, else the first.
    A chunk no shard holds needs none: the rank's load planner reports what is missing. numpy, not
    torch: torch's sorts start threads of their own, which a rank's busy cores make many times slower.
    """
    if not wants or not any(len(layout.fqns) for layout in shards.values()):
        return [[] for _ in wants]
    names = _Names()
    dims = max(layout.offsets.shape[1] for layout in [*shards.values(), *wants])
    stored = _Chunks.of(shards, names, dims)
    rank_of = np.repeat(np.arange(len(wants)), [len(w.fqns) for w in wants])
    want_fqn = np.concatenate([names.of(w.fqns, add=False) for w in wants])
    widened = [w.widened(dims) for w in wants]
    want_off = np.concatenate([o for o, _ in widened])
    want_size = np.concatenate([s for _, s in widened])
    known = want_fqn >= 0
    rank_of, want_fqn, want_off, want_size = rank_of[known], want_fqn[known], want_off[known], want_size[known]

    # The candidates of each wanted chunk: along its tensor's sweep dimension, from the last cut at or
    # before its start (DTensor layouts cut each dimension alike everywhere: `chunk_grid`; a
    # layout that is no grid may lose a chunk here, and the rank's load then fails on what it misses)
    # up to its end.
    sweep = stored.sweep[want_fqn]
    start = np.take_along_axis(want_off, sweep[:, None], 1)[:, 0]
    end = start + np.take_along_axis(want_size, sweep[:, None], 1)[:, 0]
    base = want_fqn << _FQN_SHIFT
    last = np.searchsorted(stored.keys, base + start, side="right") - 1
    before = stored.keys[np.maximum(last, 0)]
    same = (last >= 0) & (before >= base)  # a chunk of this tensor starts at or before the wanted one
    first = np.where(same, np.searchsorted(stored.keys, before), np.searchsorted(stored.keys, base))
    counts = np.maximum(np.searchsorted(stored.keys, base + end) - first, 0)
    want = np.repeat(np.arange(len(counts)), counts)
    chunk = first[want] + np.arange(len(want)) - np.repeat(np.cumsum(counts) - counts, counts)
    overlap = (
        (stored.offsets[chunk] < want_off[want] + want_size[want])
        & (want_off[want] < stored.offsets[chunk] + stored.sizes[chunk])
    ).all(1)
    # A chunk with nothing in it (FSDP's last ranks when a tensor has fewer rows than the job has ranks)
    # overlaps no chunk, but the load planner still looks its tensor up: any one chunk of it will do.
    empty = np.flatnonzero((want_size == 0).any(1))
    ranks = np.concatenate([rank_of[want[overlap]], rank_of[empty]])
    chunks = np.concatenate([chunk[overlap], np.searchsorted(stored.keys, base[empty])])
    return stored.pick(ranks, chunks, len(wants), local_by_rank)


@dataclasses.dataclass
class _Chunks:
    """Every distinct saved chunk, sorted by its name's number and its start along its tensor's sweep
    dimension (the one cut into the most pieces), with the shards that hold it."""

    keys: np.ndarray  # the sort key of each chunk
    offsets: np.ndarray
    sizes: np.ndarray
    sweep: np.ndarray  # by name's number: the sweep dimension
    holder: np.ndarray  # the shard holding each chunk; -1: several (`groups`)
    group: np.ndarray  # of a chunk several shards hold: which of `groups`
    groups: list[list[int]]  # sets of shards holding the same chunks, in order

    @classmethod
    def of(cls, shards: Mapping[int, Layout], names: _Names, dims: int) -> _Chunks:
        order = sorted(shards)
        fqn = np.concatenate([names.of(shards[s].fqns, add=True) for s in order])
        shard = np.repeat(np.array(order, dtype=np.int64), [len(shards[s].fqns) for s in order])
        widened = [shards[s].widened(dims) for s in order]
        offsets = np.concatenate([o for o, _ in widened])
        sizes = np.concatenate([s for _, s in widened])
        # One row per distinct chunk (name and offsets); its copies together, in shard order.
        by_chunk = np.lexsort([*offsets.T[::-1], fqn])  # stable: shards in order within a chunk
        rows = np.column_stack([fqn, offsets])[by_chunk]
        new = np.ones(len(rows), dtype=bool)
        new[1:] = (rows[1:] != rows[:-1]).any(1)
        starts = np.flatnonzero(new)
        copies = np.diff(np.append(starts, len(rows)))
        first_copy = by_chunk[starts]
        rows = rows[starts]
        holder = np.where(copies == 1, shard[first_copy], -1)
        group = np.full(len(rows), -1, dtype=np.int64)
        seen: dict[tuple[int, ...], int] = {}
        held_by = shard[by_chunk].tolist()
        for u in np.flatnonzero(copies > 1).tolist():  # replicated tensors and values: few
            members = tuple(held_by[starts[u] : starts[u] + copies[u]])
            group[u] = seen.setdefault(members, len(seen))
        sweep = _sweep_dims(rows[:, 0], rows[:, 1:], len(names))
        keys = (rows[:, 0] << _FQN_SHIFT) + np.take_along_axis(rows[:, 1:], sweep[rows[:, 0]][:, None], 1)[:, 0]
        by_key = np.argsort(keys, kind="stable")
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
        self, ranks: np.ndarray, chunks: np.ndarray, world: int, local_by_rank: Sequence[Sequence[int]]
    ) -> list[list[int]]:
        """The shards each rank reads, from the (rank, chunk) pairs it overlaps."""
        single = self.holder[chunks] >= 0
        needed: list[set[int]] = [set() for _ in range(world)]
        for rank, shard in _distinct_pairs(ranks[single], self.holder[chunks[single]]):
            needed[rank].add(shard)
        for rank, group in _distinct_pairs(ranks[~single], self.group[chunks[~single]]):
            needed[rank].add(_one_of(self.groups[group], rank, local_by_rank[rank], needed[rank]))
        return [sorted(shards) for shards in needed]


def _distinct_pairs(a: np.ndarray, b: np.ndarray) -> Iterable[tuple[int, int]]:
    pairs = np.unique((a << 32) + b)
    return zip((pairs >> 32).tolist(), (pairs & 0xFFFFFFFF).tolist())


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
        self._lists: dict[tuple[tuple[str, ...], bool], np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.numbers)

    def of(self, fqns: tuple[str, ...], *, add: bool) -> np.ndarray:
        """The numbers of `fqns` (-1: unknown), numbering new ones with `add`."""
        found = self._lists.get((fqns, add))
        if found is None:
            known = self.numbers
            numbers = [known.setdefault(f, len(known)) if add else known.get(f, -1) for f in fqns]
            found = self._lists[fqns, add] = np.array(numbers, dtype=np.int64)
        return found


def _sweep_dims(fqn: np.ndarray, offsets: np.ndarray, names: int) -> np.ndarray:
    """By name's number: the dimension along which its chunks start at the most places."""
    cuts = np.zeros((names, offsets.shape[1]), dtype=np.int64)
    for d in range(offsets.shape[1]):
        starts = np.unique((fqn << _FQN_SHIFT) + offsets[:, d])
        cuts[:, d] = np.bincount(starts >> _FQN_SHIFT, minlength=names)
    return cuts.argmax(1)
