"""The geometry of a tensor's saved chunks, as arrays: whether they tile it, and which a rank needs.

Each is done with numpy over all the chunks of a tensor at once: at 2,048 ranks a `.metadata`
holds over a million chunks, and a Python loop over them takes longer than the load it serves.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

# As in safe_pickle._untiled: a DTensor's chunks cut each dimension the same way everywhere, so the
# grid their edges draw has about one cell per chunk; a layout with many more is not one DCP writes.
_CELLS_PER_CHUNK = 4
_CELLS_ANY = 64
# Dimensions cut more than once (2 ** this many corners per chunk are counted); DCP's layouts cut two.
MAX_CUT_DIMS = 6
_MAX_ELEMENTS = 1 << 62  # a tensor's element count, so that no sum of chunk sizes overflows int64


def tiling_problem(size: Sequence[int], boxes: np.ndarray) -> str | None:
    """Why `boxes` (one row per chunk: its offsets, then its sizes) do not tile a tensor of `size`
    exactly (each inside it, none overlapping another, all covering it); None when they do."""
    d = len(size)
    if d == 0:
        return None if len(boxes) == 1 else f"{len(boxes)} chunks of a 0-d tensor"
    if min(size) < 0 or math.prod(size) >= _MAX_ELEMENTS:
        return f"a size {list(size)} no tensor has"
    offsets, sizes, n = boxes[:, :d], boxes[:, d:], np.asarray(size, dtype=np.int64)
    outside = ((offsets < 0) | (sizes < 0) | (offsets > n) | (sizes > n - offsets)).any(axis=1)
    if outside.any():
        i = int(outside.argmax())
        return f"a chunk at {offsets[i].tolist()} of {sizes[i].tolist()} lies outside its size {list(size)}"
    held = (sizes > 0).all(axis=1)  # an empty chunk covers nothing, wherever it lies
    offsets, ends = offsets[held], offsets[held] + sizes[held]
    if math.prod(size) == 0:
        return None if not len(offsets) else "a chunk holds elements of an empty tensor"
    cuts = [np.unique(np.concatenate(([0, size[j]], offsets[:, j], ends[:, j]))) for j in range(d)]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > _CELLS_PER_CHUNK * len(boxes) + _CELLS_ANY:
        return f"its {len(boxes)} chunks cut it into {cells} cells, a layout DCP does not write"
    cut = [j for j in range(d) if len(cuts[j]) > 2]  # along the others every chunk held spans the whole
    if len(cut) > MAX_CUT_DIMS:
        return f"its chunks cut {len(cut)} dimensions, more than {MAX_CUT_DIMS}"
    # How many chunks cover each cell: +1/-1 at each chunk's corners on the grid, then a running sum
    # along every dimension; a tiling covers every cell once.
    lows = [np.searchsorted(cuts[j], offsets[:, j]) for j in cut]
    highs = [np.searchsorted(cuts[j], ends[:, j]) for j in cut]
    counts = np.zeros([len(cuts[j]) for j in cut], dtype=np.int64)
    for corner in itertools.product((0, 1), repeat=len(cut)):
        at = tuple(highs[i] if high else lows[i] for i, high in enumerate(corner))
        np.add.at(counts, at, -1 if sum(corner) % 2 else 1)
    for axis in range(len(cut)):
        counts = np.cumsum(counts, axis=axis)
    counts = counts[tuple(slice(0, len(cuts[j]) - 1) for j in cut)]
    if (counts > 1).any():
        return "two of its chunks overlap"
    if (counts < 1).any():
        return "its chunks leave part of it uncovered"
    return None


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
