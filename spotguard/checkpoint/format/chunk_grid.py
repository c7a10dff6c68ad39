"""The geometry of a tensor's saved chunks, as arrays: whether they tile it, and which a rank needs.

Each is done with numpy over all the chunks of a tensor at once: at 2,048 ranks a `.metadata`
holds over a million chunks, and a Python loop over them takes longer than the load it serves.
Both `.metadata` (`safe_pickle.untiled`) and `.metadata.index` are checked here.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

# The grid that every chunk edge of a tensor draws: a DTensor's chunks (any placements, even shards)
# cut each dimension the same way everywhere, so it has about one cell per chunk. A layout whose grid
# has many more (cut differently from row to row) is refused rather than checked at quadratic cost.
_CELLS_PER_CHUNK = 4
_CELLS_ANY = 64
# Dimensions cut more than once (2 ** this many corners per chunk are counted); DCP's layouts cut two.
MAX_CUT_DIMS = 6
_MAX_ELEMENTS = 1 << 62  # above a tensor's element count and each dimension: a chunk's fits int64


def chunk_boxes(chunks: Sequence[Any], d: int) -> np.ndarray | None:
    """One row per chunk (DCP's `ChunkStorageMetadata`): its offsets, then its sizes; None when the
    offsets or sizes of one are not `d` long."""
    # map() and attrgetter keep the loops over a million chunks in C (a Python loop: seconds at 1,024 ranks).
    offsets, sizes = list(map(operator.attrgetter("offsets"), chunks)), list(map(operator.attrgetter("sizes"), chunks))
    if set(map(len, itertools.chain(offsets, sizes))) - {d}:
        return None
    # operator.index: an unpickled `.metadata` may hold floats or strs, which fromiter would make ints.
    flat = map(operator.index, itertools.chain.from_iterable(itertools.chain(offsets, sizes)))
    rows = np.fromiter(flat, dtype=np.int64, count=2 * d * len(chunks))
    return rows.reshape(2, len(chunks), d).transpose(1, 0, 2).reshape(len(chunks), 2 * d)


def chunks_problem(size: Sequence[int], chunks: Sequence[Any], *, whole: bool = True) -> str | None:
    """`tiling_problem` of DCP's chunks (`ChunkStorageMetadata`), which need not have as many
    dimensions as their tensor."""
    boxes = chunk_boxes(chunks, len(size))
    if boxes is None:
        odd = next(c for c in chunks if len(c.offsets) != len(size) or len(c.sizes) != len(size))
        return _outside(odd.offsets, odd.sizes, size)
    return tiling_problem(size, boxes, whole=whole)


def tiling_problem(size: Sequence[int], boxes: np.ndarray, *, whole: bool = True) -> str | None:
    """Why `boxes` (one row per chunk: its offsets, then its sizes) do not tile a tensor of `size`;
    None when they do. Each chunk must lie inside it and overlap no other; with `whole` (the chunks
    of every rank, not of one shard) they must also cover it."""
    size = list(map(operator.index, size))  # as the chunks' (chunk_boxes): numpy would truncate a float
    volume = _elements(size)
    if volume is None:
        return f"a size {size} no tensor has"
    d = len(size)
    offsets, sizes, n = boxes[:, :d], boxes[:, d:], np.asarray(size, dtype=np.int64)
    outside = ((offsets < 0) | (sizes < 0) | (offsets > n) | (sizes > n - offsets)).any(axis=1)
    if outside.any():
        i = int(outside.argmax())
        return _outside(offsets[i].tolist(), sizes[i].tolist(), size)
    # Summed as Python ints: each chunk holds at most `volume` elements, but a million of them can
    # add up past int64 and wrap round to a count that looks right.
    held = sum(sizes.prod(axis=1).tolist())
    if held > volume or (whole and held != volume):  # more than the tensor holds: some overlap
        return f"its chunks hold {held} elements, the tensor {volume}"
    nonempty = (sizes > 0).all(axis=1)  # an empty chunk covers nothing, wherever it lies
    # The count being right, an overlap is all that is left to find: with `whole`, a part left
    # uncovered would mean another part covered twice.
    return _overlap(offsets[nonempty], offsets[nonempty] + sizes[nonempty])


def _overlap(offsets: np.ndarray, ends: np.ndarray) -> str | None:
    """Two of the chunks from `offsets` to `ends` (none empty) that overlap, found on the grid their
    edges draw: the first two (as listed) that cover its first cell covered twice."""
    if len(offsets) < 2:
        return None
    cuts = [np.unique(np.concatenate((offsets[:, j], ends[:, j]))) for j in range(offsets.shape[1])]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > _CELLS_PER_CHUNK * len(offsets) + _CELLS_ANY:
        return f"its {len(offsets)} chunks cut it into {cells} cells, a layout DCP does not write"
    cut = [j for j in range(len(cuts)) if len(cuts[j]) > 2]  # along the others every chunk spans the same
    if len(cut) > MAX_CUT_DIMS:
        return f"its chunks cut {len(cut)} dimensions, more than {MAX_CUT_DIMS}"
    first, second = 0, 1  # with no dimension cut, every chunk is the same box
    if cut:
        # How many chunks cover each cell: +1/-1 at each chunk's corners on the grid, then a running
        # sum along every dimension.
        lows = [np.searchsorted(cuts[j], offsets[:, j]) for j in cut]
        highs = [np.searchsorted(cuts[j], ends[:, j]) for j in cut]
        counts = np.zeros([len(cuts[j]) for j in cut], dtype=np.int64)
        for corner in itertools.product((0, 1), repeat=len(cut)):
            at = tuple(highs[i] if high else lows[i] for i, high in enumerate(corner))
            np.add.at(counts, at, -1 if sum(corner) % 2 else 1)
        for axis in range(len(cut)):
            counts = np.cumsum(counts, axis=axis)
        twice = np.flatnonzero(counts[tuple(slice(0, len(cuts[j]) - 1) for j in cut)] > 1)
        if not len(twice):
            return None
        cell = np.unravel_index(twice[0], [len(cuts[j]) - 1 for j in cut])
        on = np.logical_and.reduce([(low <= c) & (c < high) for low, high, c in zip(lows, highs, cell)])
        first, second = np.flatnonzero(on)[:2]
    return f"the chunks at {offsets[first].tolist()} and {offsets[second].tolist()} overlap"


def _elements(size: list[int]) -> int | None:
    """How many elements a tensor of `size` holds; None when no tensor has that size (a dimension
    negative, or _MAX_ELEMENTS elements or more). Multiplied only that far: the whole product of
    100,000 large dimensions takes minutes."""
    if not all(0 <= n < _MAX_ELEMENTS for n in size):
        return None
    if 0 in size:
        return 0
    volume = 1
    for n in size:
        volume *= n
        if volume >= _MAX_ELEMENTS:
            return None
    return volume


def _outside(offsets: Sequence[int], sizes: Sequence[int], size: Sequence[int]) -> str:
    return f"a chunk at {list(offsets)} of {list(sizes)} lies outside its size {list(size)}"


def overlapping(boxes: np.ndarray, wanted: Sequence[tuple[Sequence[int], Sequence[int]]]) -> np.ndarray:
    """Which of `boxes` (rows: offsets, then sizes) overlap any of `wanted` (offsets, sizes), by the
    test DCP's load planner uses (`_check_shard_metadata_pair_overlap`): a read item is made for each."""
    d = boxes.shape[1] // 2
    offsets, ends = boxes[:, :d], boxes[:, :d] + boxes[:, d:]
    hit = np.zeros(len(boxes), dtype=bool)
    for want_offsets, want_sizes in wanted:
        start = np.asarray(want_offsets, dtype=np.int64)
        hit |= ((offsets < start + np.asarray(want_sizes, dtype=np.int64)) & (start < ends)).all(axis=1)
    return hit
