"""DCP's save (`state_dict_saver._save_state_dict`), step by step on spotguard's `Comm`.

The planner and storage-writer calls are DCP's own, in DCP's order; what differs is what crosses
the ranks after the write. DCP gathers every rank's WriteResult objects to rank 0 (N lists of
hundreds of pickled objects, unpickled there) and broadcasts the whole Metadata back to every rank
(26 MB at 256 ranks, each rank unpickling it, and spotguard has no use for it). Here each rank
sends where its items went as `Placements` (three arrays in the order of its final plan, plus its
file names), inside the one gather of the save protocol; rank 0 rebuilds the storage data from its
global plan's items, writes `.metadata` and tells the ranks no more than the commit's outcome.
"""

from __future__ import annotations

import contextlib
import gc
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from spotguard.checkpoint.comm import FAILURES, Comm, describe
from spotguard.checkpoint.errors import CheckpointError
from spotguard.checkpoint.save.indexed_write import IndexedWriter, MetadataFiles


class PlanFailed(CheckpointError):
    """The save's planning failed on some rank: every rank raises it, with the same message."""


@dataclass(frozen=True)
class _Failed:
    """A failure in place of a plan, in the plan gather (a rank's) or the scatter (rank 0's, to all)."""

    why: str


@dataclass(frozen=True)
class Placements:
    """Where a rank's items went: item i of its final plan is `length[i]` bytes at `offset[i]` of
    file `files[file[i]]`. Arrays pickle as their raw bytes: rank 0 unpickles N of these, not
    N x items objects."""

    files: tuple[str, ...]
    file: array
    offset: array
    length: array

    @classmethod
    def of(cls, plan: SavePlan, results: Sequence[WriteResult]) -> Placements:
        position = {item.index: i for i, item in enumerate(plan.items)}
        if len(position) != len(results) or len({r.index for r in results}) != len(results):
            raise CheckpointError(f"the write reported {len(results)} items of a plan of {len(position)}")
        # The files in name order, not in the order the writer's threads finished: placements of the same
        # writes compare equal from save to save (`indexed_write.MetadataFiles`).
        files = {name: i for i, name in enumerate(sorted({r.storage_data.relative_path for r in results}))}
        file, offset, length = (array("q", bytes(8 * len(results))) for _ in range(3))
        for result in results:
            info: _StorageInfo = result.storage_data
            if getattr(info, "transform_descriptors", None):  # (torch >= 2.7) spotguard's writers set up none
                raise CheckpointError(f"{result.index.fqn}: transformed storage is not supported")
            i = position[result.index]
            file[i], offset[i], length[i] = files[info.relative_path], info.offset, info.length
        return cls(tuple(files), file, offset, length)

    def results(self, plan: SavePlan) -> list[WriteResult]:
        """The WriteResults they stand for, the items' indexes taken from rank 0's copy of the plan."""
        if len(plan.items) != len(self.file):
            raise CheckpointError(f"{len(self.file)} items placed for a plan of {len(plan.items)}")
        files = self.files
        return [
            WriteResult(item.index, n, _StorageInfo(files[f], o, n))
            for item, f, o, n in zip(plan.items, self.file, self.offset, self.length)
        ]


@contextlib.contextmanager
def no_gc(on: bool = True) -> Iterator[None]:
    """Rank 0 (`on`) unpickles and builds hundreds of thousands of small objects, none of them garbage:
    every few thousand allocations the collector would walk the young ones again and, ever more
    often, all of them (a cost that grows faster than the ranks). Collections resume after. The
    other ranks keep theirs: the switch is the whole process's, their training thread's too."""
    was_enabled = gc.isenabled()
    if on:
        gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class DcpSave:
    """One save's DCP steps on `comm`: `plan` (collective), `write` (this rank's bytes), then on
    rank 0 `finish` with every rank's `Placements` (gathered by the caller with its own records)."""

    def __init__(
        self,
        comm: Comm,
        planner: DefaultSavePlanner,
        make_writer: Callable[[], IndexedWriter],
        kept: MetadataFiles | None = None,
    ) -> None:
        self.comm = comm
        self.planner = planner
        self._make_writer = make_writer
        self._kept = kept  # the files of the last save of this planner's layout
        self.writer: IndexedWriter | None = None
        self._metadata: Metadata | None = None  # rank 0's, from the global plan

    def plan(self, state_dict: dict[str, Any]) -> SavePlan:
        """This rank's final plan (DCP's reduce_scatter "plan"). The writer is made inside the local
        step, so that failing to make it is reported like a failed plan instead of leaving the others waiting."""
        try:
            local: SavePlan | _Failed = self._local_plan(state_dict)
        except FAILURES as exc:
            local = _Failed(describe(exc, self.comm.rank))
        with no_gc(self.comm.is_coordinator):
            gathered = self.comm.gather(local)
            plans = self._global_plan(gathered) if gathered is not None else None
        mine = self.comm.scatter(plans)
        if isinstance(mine, _Failed):
            raise PlanFailed(mine.why)
        return self.planner.finish_plan(mine)

    def write(self, plan: SavePlan) -> Placements:
        assert self.writer is not None
        results = self.writer.write_data(plan, self.planner).wait()
        self.planner.state_dict = {}  # the planner outlives the save (its cached plan), not the state
        return Placements.of(plan, results)

    def finish(self, placements: Sequence[Placements]) -> None:
        """Rank 0: write `.metadata` from every rank's placements."""
        assert self.writer is not None and self._metadata is not None
        # Under plan caching the scattered plans may be empty: the planner keeps the whole global plan.
        write_metadata(self.writer, self._metadata, self.planner.global_plan, placements, self._kept)

    def _local_plan(self, state_dict: dict[str, Any]) -> SavePlan:
        self.writer = writer = self._make_writer()
        self.planner.set_up_planner(
            state_dict=state_dict, storage_meta=writer.storage_meta(), is_coordinator=self.comm.is_coordinator
        )
        writer.set_up_storage_writer(self.comm.is_coordinator, rank=self.comm.rank, use_collectives=True)
        return writer.prepare_local_plan(self.planner.create_local_plan())

    def _global_plan(self, gathered: list[SavePlan | _Failed]) -> list[SavePlan | _Failed]:
        """Rank 0: the N plans to scatter, or one failure for all (a rank's, or the global plan's)."""
        failed = [g.why for g in gathered if isinstance(g, _Failed)]
        if not failed:
            try:
                plans, self._metadata = self.planner.create_global_plan(gathered)  # type: ignore[arg-type]
                return list(self.writer.prepare_global_plan(plans))  # type: ignore[union-attr]
            except FAILURES as exc:
                failed = [describe(exc, self.comm.rank)]
        return [_Failed("; ".join(failed))] * len(gathered)


def write_metadata(
    writer: IndexedWriter,
    metadata: Metadata,
    plans: Sequence[SavePlan],
    placements: Sequence[Placements],
    kept: MetadataFiles | None = None,
) -> None:
    """DCP's `finish_checkpoint` on rank 0: `.metadata` (and its index), from the global plan and each
    rank's placements; with `kept`, the bytes of the last save made of the same again."""
    if kept is not None and (files := kept.reuse(metadata, placements)) is not None:
        for name, data in files.items():
            writer.write_file(name, data)
        return
    with no_gc():
        results = [p.results(plan) for p, plan in zip(placements, plans, strict=True)]
        writer.finish(metadata=metadata, results=results)
    if kept is not None:
        kept.keep(metadata, list(placements), Path(writer.path))
