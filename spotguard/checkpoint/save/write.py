"""Write one step's shards with DCP into a staging directory and checksum what this rank wrote."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter, SavePlanner

from cloud_adapters.deadline import Deadline
from spotguard.checkpoint.comm import Comm
from spotguard.checkpoint.format.layout import DCP_METADATA_NAME, METADATA_INDEX_NAME, shard_prefix
from spotguard.checkpoint.format.manifest import FileRecord
from spotguard.checkpoint.io import bounce
from spotguard.checkpoint.moves.streaming import StreamedFile
from spotguard.checkpoint.save.indexed_write import IndexedWriter
from spotguard.checkpoint.save.pipelined_write import PipelinedWriter
from spotguard.checkpoint.save.shard_io import ChecksummingFileSystem, without_zip_crc32
from spotguard.checkpoint.state import tensors_of


def write_shards(
    stage_dir: Path,
    state_dict: dict[str, Any],
    comm: Comm,
    *,
    threads: int,
    planner: SavePlanner | None = None,
    sha256: bool = False,
    tee: Callable[[Path], StreamedFile | None] | None = None,
    cutoff: Deadline | None = None,
) -> list[FileRecord]:
    """Save `state_dict` into `stage_dir` (all ranks of `comm` together) and return this rank's files.

    DCP's default planner (or `planner`) de-duplicates replicated tensors (DDP) and spreads
    them over the ranks, so each tensor is written once. Rank r writes `threads` files
    `__r_*.distcp` in parallel; the coordinator also writes `.metadata`. With `sha256`
    (a checkpoint key is set) the records carry each file's SHA-256 too. `tee` (see
    `streaming.ShardStreams.open`) streams each file to the object store as it is written.
    A state with tensors on a GPU is copied out through the process's pool of pinned buffers
    (`pipelined_write`), and stops at `cutoff`.
    """
    # The stage directory is always fresh (random name), so nothing can be overwritten.
    pool = bounce.pool_for(list(tensors_of(state_dict)), count=threads + bounce.IN_FLIGHT)
    writer: FileSystemWriter
    if pool is None:
        writer = IndexedWriter(stage_dir, thread_count=threads, sync_files=True)
    else:
        writer = PipelinedWriter(stage_dir, threads=threads, pool=pool, cutoff=cutoff)
    writer.fs = fs = ChecksummingFileSystem(sha256=sha256, tee=tee)
    with comm.dcp_args() as dist_args, without_zip_crc32():
        dcp.save(state_dict, storage_writer=writer, planner=planner, **dist_args)
    mine = sorted(p for p in stage_dir.iterdir() if p.name.startswith(shard_prefix(comm.rank)))
    if comm.is_coordinator:
        mine.append(stage_dir / DCP_METADATA_NAME)  # written to a temporary name, then renamed: read it back
        mine += [p for p in [stage_dir / METADATA_INDEX_NAME] if p.exists()]  # absent if no index fits
    return [fs.record_for(path) for path in mine]
