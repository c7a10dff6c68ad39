"""Write one step's shards with DCP into a staging directory, checksum what each rank wrote, and
bring it all to rank 0 in one gather, which writes `.metadata`."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import DefaultSavePlanner

from cloud_adapters.deadline import Deadline
from spotguard.checkpoint.comm import FAILURES, Comm, describe
from spotguard.checkpoint.format.layout import DCP_METADATA_NAME, METADATA_INDEX_NAME, shard_prefix
from spotguard.checkpoint.format.manifest import FileRecord
from spotguard.checkpoint.io import bounce
from spotguard.checkpoint.moves.streaming import StreamedFile
from spotguard.checkpoint.save.dcp_steps import DcpSave, Placements, PlanFailed, no_gc
from spotguard.checkpoint.save.indexed_write import IndexedWriter, MetadataFiles
from spotguard.checkpoint.save.pipelined_write import PipelinedWriter
from spotguard.checkpoint.save.shard_io import ChecksummingFileSystem, without_zip_crc32
from spotguard.checkpoint.state import tensors_of


@dataclass(frozen=True)
class Written:
    """What a rank sends rank 0 once its bytes are written: its files, where its items went in
    them (None: its plan or its write failed), or why it failed."""

    records: tuple[FileRecord, ...]
    placements: Placements | None
    error: str | None


def write_shards(
    stage_dir: Path,
    state_dict: dict[str, Any],
    comm: Comm,
    *,
    threads: int,
    planner: DefaultSavePlanner | None = None,
    sha256: bool = False,
    tee: Callable[[Path], StreamedFile | None] | None = None,
    cutoff: Deadline | None = None,
    kept: MetadataFiles | None = None,
) -> tuple[Written, list[Written] | None]:
    """Save `state_dict` into `stage_dir` (all ranks of `comm` together): this rank's `Written`, and
    on rank 0 every rank's (rank 0's own with `.metadata`, or the error that kept it from being written).

    DCP's default planner (or `planner`) de-duplicates replicated tensors (DDP) and spreads
    them over the ranks, so each tensor is written once. Rank r writes `threads` files
    `__r_*.distcp` in parallel; the coordinator also writes `.metadata`. With `sha256`
    (a checkpoint key is set) the records carry each file's SHA-256 too. `tee` (see
    `streaming.ShardStreams.open`) streams each file to the object store as it is written.
    A state with tensors on a GPU is copied out through the process's pool of pinned buffers
    (`pipelined_write`), and stops at `cutoff`. `kept`: the files rank 0 wrote at the last save with
    `planner`, written again when made of the same. Failures are reported, not raised: every rank
    reaches the gather.
    """
    fs = ChecksummingFileSystem(sha256=sha256, tee=tee)
    make_writer = functools.partial(_writer, stage_dir, state_dict, fs, threads=threads, cutoff=cutoff)
    save = DcpSave(comm, planner or DefaultSavePlanner(), make_writer, kept)
    records: list[FileRecord] = []
    placements = error = None
    try:
        with without_zip_crc32():
            placements = save.write(save.plan(state_dict))
        records = [fs.record_for(p) for p in sorted(stage_dir.iterdir()) if p.name.startswith(shard_prefix(comm.rank))]
    except PlanFailed as exc:  # every rank has it: rank 0 reports it
        error = str(exc) if comm.is_coordinator else None
    except FAILURES as exc:
        error = describe(exc, comm.rank)
    written = Written(tuple(records), placements, error)
    with no_gc(comm.is_coordinator):  # rank 0 unpickles N ranks' records
        gathered = comm.gather(written)
    if gathered is None:
        return written, None
    gathered[0] = _finish(save, gathered, stage_dir, fs)
    return gathered[0], gathered


def _finish(save: DcpSave, gathered: list[Written], stage_dir: Path, fs: ChecksummingFileSystem) -> Written:
    """Rank 0, once every rank wrote its shards: `.metadata`, its record added to rank 0's."""
    mine = gathered[0]
    if any(w.error or w.placements is None for w in gathered):  # a rank failed: nothing will be committed
        return mine
    try:
        save.finish([w.placements for w in gathered])  # type: ignore[misc]
        # The files rank 0 writes after the shards: `.metadata` (DCP's goes through a temporary name,
        # so its record is read back) and, when one fits, its index.
        extra = [fs.record_for(stage_dir / DCP_METADATA_NAME)]
        extra += [fs.record_for(p) for p in [stage_dir / METADATA_INDEX_NAME] if p.exists()]
    except FAILURES as exc:
        return dataclasses.replace(mine, error=describe(exc, save.comm.rank))
    return dataclasses.replace(mine, records=mine.records + tuple(extra))


def _writer(
    stage_dir: Path, state_dict: dict[str, Any], fs: ChecksummingFileSystem, *, threads: int, cutoff: Deadline | None
) -> IndexedWriter:
    # The stage directory is always fresh (random name), so nothing can be overwritten.
    pool = bounce.pool_for(list(tensors_of(state_dict)), count=threads + bounce.IN_FLIGHT)
    writer: IndexedWriter
    if pool is None:
        writer = IndexedWriter(stage_dir, thread_count=threads, sync_files=True)
    else:
        writer = PipelinedWriter(stage_dir, threads=threads, pool=pool, cutoff=cutoff)
    writer.fs = fs
    return writer
