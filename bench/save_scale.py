"""The checkpoint save path's coordination at N ranks: what a save, its commit and a resume cost
beyond writing the bytes, at N = 16 ... 1,024, with a per-rank state shaped like an FSDP2 model.

Each rank's state: `--tensors` parameters, each a DTensor sharded Shard(0) over the N ranks
(`--rows-per-rank` rows of 4 floats per rank), AdamW's exp_avg and exp_avg_sq sharded the same way,
a replicated 0-dim `step` per parameter and the param_groups (non-tensor values), saved as
spotguard's `SaveProtocol.run` saves it (DCP's steps run by `save.dcp_steps`). The bytes are a few
rows per rank, so what is measured is coordination, not the disk.

Phases, each timed at each N (seconds):

1. local plan: DefaultSavePlanner set_up_planner + create_local_plan + FileSystemWriter
   prepare_local_plan, on a rank's real state (the median of ranks 0, N/2 and N-1; every rank does
   this at once in a real job). Every rank's state is made for real in this process, with torch's
   fake process group re-initialised at each rank (a CPU DeviceMesh of N, `DTensor.from_local`),
   and every rank's real local plan is kept: they feed the rank-0 phases below.
2. plan gather: `Comm.gather` of the local plans to rank 0 (the sizes gathered, then each rank's
   pickle sent to rank 0 alone, unpickled there), over real gloo (see below). The cached plan's gather
   and the written gather run a second time through torch's `gather_object` (the sizes all-gathered in
   gloo's ring, every pickle padded to the largest), spotguard's before, as the baseline.
3. global plan: rank 0's `create_global_plan` (dedup, metadata, validation) + `prepare_global_plan`
   with the N real local plans.
4. write (information only, not coordination): rank 0's real `write_data` of its small bytes, through
   spotguard's ChecksummingFileSystem as `write_shards` does.
5. plan scatter: `Comm.scatter` of the N global plans (the sizes scattered, then each rank's pickle
   sent to it alone, unpickled there); and again through torch's `scatter_object_list`, spotguard's
   before, as the baseline (the largest size broadcast, every pickle padded to it and scattered, then
   the sizes scattered).
   written gather: the save's one gather after the write (`write.Written`, unpickled on rank 0 with the
   collector off, as `write_shards` does): each rank's FileRecords, error and `dcp_steps.Placements`
   (where its items went: three arrays in its final plan's order and its file names). It replaces
   DCP's gather of N lists of WriteResult objects and spotguard's separate gather of the records.
6. finish: rank 0's `dcp_steps.write_metadata` (the WriteResults rebuilt from the placements and the
   global plan's items, then `FileSystemWriter.finish`: the `.metadata` pickle, its size in the
   notes). DCP's broadcast of the whole Metadata to every rank is gone: no rank receives it.
7. commit: rank 0's `SaveProtocol._commit` (the real function: the Manifest of N ranks' records,
   `commit_dir`), the broadcast of its LocalCommit.
8. resume: one rank's `.metadata` read as `VerifiedReader` reads it (`load_metadata`) and its local
   load plan (`WeightsOnlyLoadPlanner` set_up_planner + create_local_plan).
9. snapshot index exchange (`snapshots.loading.PlanLoader._indexes` at another world size: the snapshot
   taken by the N ranks, resumed by N - 8, one node lost): the gather of what each rank sends (the
   chunks of the shards it read, a lost node's read by its buddy, and of its own state at the new size,
   `snapshots.needed.Layout`), rank 0's `shards_needed`, the scatter of each rank's list, and one rank's
   read of those shards' indexes (their trailers parsed as `fetch_info` gets them, then `metadata_of`).

The communication (2, 5, 7's broadcast, 9's gather and scatter) runs over
a REAL gloo group: N ranks as threads spread over `--procs` processes around one TCPStore, each
thread with its own `ProcessGroupGloo` (TORCH_GLOO_LAZY_INIT=1, as `comm.new_gloo_group` makes them:
only the pairs a collective uses connect), calling the group's allgather / gather / scatter /
broadcast the way torch's object collectives do, with the bytes a real rank sends (its pickled plan,
results, records, layouts). A collective is timed from rank 0's start to the last rank done (one host,
one clock).

How this differs from a real job:
- ranks are threads on one host: no network latency or bandwidth limit between hosts, but all N
  ranks' work in a collective shares this host's cores (a real job spreads it over N hosts), so the
  collectives' times are an upper bound for CPU, a lower bound for the network;
- the per-rank work that all ranks do at once (local plan, unpickles, load plan) is timed on one rank;
- the rank-0 phases (global plan, finish, commit, merge) get the N ranks' real local plans, but the
  other ranks' write results, FileRecords and snapshot indexes are made from their real plans and
  states without writing their files (same names, sizes and layout as rank 0's real ones);
- the bytes are a few rows per rank: the write is not what a real model's is.

    python bench/save_scale.py [--ranks 16,64,256,1024] [--tensors 200] [--rows-per-rank 2]
                               [--procs 4] [--phases ...] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import multiprocessing as mp
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import threading
import time
import types
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

from _common import table  # also puts the checkout on sys.path

COLS = 4  # each tensor's row: 4 floats
RANKS_PER_NODE = 8
PHASES = ("local_plan", "plan_gather", "global_plan", "write", "plan_scatter", "written_gather", "finish",
          "commit", "resume", "snapshot")  # fmt: skip
# The rounds the gloo threads run, in order: (name, kind).
# "NAME@torch": NAME's payloads, through torch's gather_object or scatter_object_list (the baseline, in the
# same run).
ROUNDS = (("plan_gather", "gather"), ("plan_scatter", "scatter"), ("plan_scatter@torch", "scatter_torch"),
          ("written_gather", "gather"),
          ("written_gather@torch", "gather_torch"), ("commit_bcast", "bcast"), ("plan_gather_cached", "gather"),
          ("plan_gather_cached@torch", "gather_torch"), ("plan_scatter_cached", "scatter"),
          ("index_gather", "gather"), ("needed_scatter", "scatter"))  # fmt: skip
NO_GC_GATHERS = {"plan_gather", "written_gather"}  # unpickled on rank 0 with the collector off (`dcp_steps.no_gc`)
ROUND_OF_PHASE = {"plan_gather": ("plan_gather", "plan_gather_cached", "plan_gather_cached@torch"),
                  "plan_scatter": ("plan_scatter", "plan_scatter@torch", "plan_scatter_cached"),
                  "written_gather": ("written_gather", "written_gather@torch"), "commit": ("commit_bcast",),
                  "snapshot": ("index_gather", "needed_scatter")}  # fmt: skip


# -- one rank's state, under torch's fake process group ---------------------------------------


def rank_state(rank: int, world: int, tensors: int, rows: int, total: int | None = None) -> dict[str, Any]:
    """Rank `rank`'s FSDP2-shaped state (a DCP state dict), its DTensors on a CPU mesh of `world` fake ranks:
    `rows` rows of each tensor, or its part of `total` rows as FSDP2 splits them (ceil, the last fewer)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    mesh = DeviceMesh("cpu", list(range(world)))
    total = world * rows if total is None else total
    shape, stride = torch.Size((total, COLS)), (COLS, 1)
    per = -(-total // world)
    mine = max(0, min(per, total - rank * per))

    def sharded() -> Any:
        local = torch.full((mine, COLS), float(rank))
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)

    model = {f"layers.{i}.weight": sharded() for i in range(tensors)}
    state = {fqn: {"step": torch.tensor(1.0), "exp_avg": sharded(), "exp_avg_sq": sharded()} for fqn in model}
    groups = [{"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "params": list(model)}]
    return {"model": model, "optim": {"state": state, "param_groups": groups}}


def writer_for(path: Path, threads: int) -> Any:
    """The writer `write_shards` makes (host memory), with spotguard's ChecksummingFileSystem."""
    from spotguard.checkpoint.save.indexed_write import IndexedWriter
    from spotguard.checkpoint.save.shard_io import ChecksummingFileSystem

    writer = IndexedWriter(path, thread_count=threads, sync_files=True)
    writer.fs = ChecksummingFileSystem(sha256=False)
    return writer


def local_plan(state: dict[str, Any], rank: int, writer: Any, planner: Any = None) -> tuple[Any, Any, float]:
    """DCP's local step (state_dict_saver.local_step) with the job's `CachedPlanner` (a new one, or
    `planner` again): (planner, plan, seconds)."""
    from spotguard.checkpoint.save.plan_cache import CachedPlanner

    t = time.perf_counter()
    planner = planner or CachedPlanner()
    planner.set_up_planner(state_dict=state, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
    writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    plan = writer.prepare_local_plan(planner.create_local_plan())
    return planner, plan, time.perf_counter() - t


def shard_info(state: dict[str, Any], rank: int, world: int) -> Any:
    """The index of rank's snapshot shard, as `MappedShard` lays it out and `finish` records it (no file)."""
    from spotguard.snapshots.items import laid_out, stored
    from spotguard.snapshots.shard_file import BLOCK, ShardInfo, _padded

    entries, paths = laid_out(state)
    items, offset = [], 0
    for entry in entries:
        items.append(stored(entry, offset))
        offset += _padded(items[-1].nbytes)
    blocks = tuple("%08x" % b for b in range(max(1, -(-offset // BLOCK))))
    return ShardInfo("run", "job", "attempt", 1, rank, world, offset, BLOCK, blocks, tuple(items), paths)


# -- the gloo threads ------------------------------------------------------------------------


def _pg(store: Any, rank: int, world: int) -> Any:
    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    opts._threads = 1
    opts._timeout = timedelta(minutes=10)
    return dist.ProcessGroupGloo(store, rank, world, opts)


class PgWire:
    """`rooted.Wire` on a bare gloo group (each thread's own, unknown to torch.distributed's registry)."""

    def __init__(self, pg: Any) -> None:
        import torch.distributed as dist

        from spotguard.checkpoint.rooted import BYTES_TAG

        self.pg, self.dist, self.tag = pg, dist, BYTES_TAG

    def gather(self, size: Any, sizes: list[Any] | None) -> None:
        opts = self.dist.GatherOptions()
        opts.rootRank = 0
        self.pg.gather([sizes] if sizes is not None else [], [size], opts).wait()

    def scatter(self, size: Any, sizes: list[Any] | None) -> None:
        opts = self.dist.ScatterOptions()
        opts.rootRank = 0
        self.pg.scatter([size], [sizes] if sizes is not None else [], opts).wait()

    def isend(self, data: Any, peer: int) -> Any:
        return self.pg.send([data], peer, self.tag)

    def irecv(self, data: Any, peer: int) -> Any:
        return self.pg.recv([data], peer, self.tag)


def spotguard_gather(pg: Any, rank: int, world: int, data: bytes, without_gc: bool = False) -> list[Any] | None:
    """`Comm.gather` to rank 0 on `pg` (`rooted.gather_bytes`), with `data` already pickled."""
    from spotguard.checkpoint.rooted import gather_bytes
    from spotguard.checkpoint.save.dcp_steps import no_gc

    gathered = gather_bytes(PgWire(pg), rank, world, data)
    if gathered is None:
        return None
    with no_gc() if without_gc else contextlib.nullcontext():
        return [pickle.loads(b) for b in gathered]


def torch_gather(pg: Any, rank: int, world: int, data: bytes, without_gc: bool = False) -> list[Any] | None:
    """torch's gather_object to rank 0 on `pg` (spotguard's before), with `data` already pickled (as
    `_object_to_tensor` does): the sizes all-gathered (gloo's ring), every rank's bytes padded to the largest."""
    import torch
    import torch.distributed as dist

    from spotguard.checkpoint.save.dcp_steps import no_gc

    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.long)
    sizes = torch.zeros(world, dtype=torch.long)
    pg.allgather([[sizes[i].unsqueeze(0) for i in range(world)]], [size]).wait()
    top = int(sizes.max())
    payload = torch.cat([payload, torch.zeros(top - payload.numel(), dtype=torch.uint8)])
    opts = dist.GatherOptions()
    opts.rootRank = 0
    if rank != 0:
        pg.gather([], [payload], opts).wait()
        return None
    out = torch.empty(top * world, dtype=torch.uint8)
    pg.gather([[out[top * i : top * (i + 1)] for i in range(world)]], [payload], opts).wait()
    with no_gc() if without_gc else contextlib.nullcontext():
        return [pickle.loads(out[top * i : top * i + int(sizes[i])].numpy().tobytes()) for i in range(world)]


GATHERS = {"gather": spotguard_gather, "gather_torch": torch_gather}


def spotguard_scatter(pg: Any, rank: int, world: int, datas: list[bytes] | None) -> Any:
    """`Comm.scatter` from rank 0 on `pg` (`rooted.scatter_bytes`), its `datas` already pickled: this rank's object."""
    from spotguard.checkpoint.rooted import scatter_bytes

    return pickle.loads(scatter_bytes(PgWire(pg), rank, world, datas))


def torch_scatter(pg: Any, rank: int, world: int, datas: list[bytes] | None) -> Any:
    """torch's scatter_object_list from rank 0 (its `datas` already pickled; spotguard's before): the largest
    size broadcast, every object padded to it and scattered, then the sizes scattered."""
    import torch
    import torch.distributed as dist

    size = torch.tensor([max(map(len, datas)) if rank == 0 else 0], dtype=torch.long)
    bopts = dist.BroadcastOptions()
    bopts.rootRank, bopts.rootTensor = 0, 0
    pg.broadcast([size], bopts).wait()
    top = int(size)
    out = torch.empty(top, dtype=torch.uint8)
    opts = dist.ScatterOptions()
    opts.rootRank = 0
    sizes_out = torch.zeros(1, dtype=torch.long)
    if rank == 0:
        tensors = [torch.frombuffer(bytearray(d.ljust(top, b"\0")), dtype=torch.uint8) for d in datas]
        pg.scatter([out], [tensors], opts).wait()
        pg.scatter([sizes_out], [[torch.tensor([len(d)], dtype=torch.long) for d in datas]], opts).wait()
    else:
        pg.scatter([out], [], opts).wait()
        pg.scatter([sizes_out], [], opts).wait()
    return pickle.loads(out[: int(sizes_out)].numpy().tobytes())


SCATTERS = {"scatter": spotguard_scatter, "scatter_torch": torch_scatter}


def broadcast_object(pg: Any, rank: int, data: bytes | None, unpickle: bool) -> Any:
    """torch's broadcast_object_list of one object from rank 0 (already pickled): the sizes, then the bytes."""
    import torch
    import torch.distributed as dist

    bopts = dist.BroadcastOptions()
    bopts.rootRank, bopts.rootTensor = 0, 0
    size = torch.tensor([len(data) if rank == 0 else 0], dtype=torch.long)
    pg.broadcast([size], bopts).wait()
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8) if rank == 0 else torch.empty(int(size), dtype=torch.uint8)
    )
    pg.broadcast([buf], bopts).wait()
    if rank != 0 and unpickle:
        return pickle.loads(buf.numpy().tobytes())
    return None


def _on_threads(fn: Any, ranks: list[int]) -> None:
    """`fn(rank)` for each of `ranks`, each on a thread of its own, all at once."""
    threads = [threading.Thread(target=fn, args=(r,)) for r in ranks]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


@dataclasses.dataclass
class _Round:
    """One collective over a worker's ranks: each loads its payload, waits for the go, runs it."""

    folder: Path
    name: str
    kind: str
    ready: threading.Barrier
    go: threading.Event = dataclasses.field(default_factory=threading.Event)
    done: dict[int, float] = dataclasses.field(default_factory=dict)
    errors: list[str] = dataclasses.field(default_factory=list)

    def run(self, rank: int, pg: Any, world: int) -> None:
        try:
            mine = (self.folder / f"{rank}.pkl").read_bytes() if self.kind in GATHERS else None
            datas = None
            if rank == 0 and self.kind in SCATTERS:
                datas = [(self.folder / f"{r}.pkl").read_bytes() for r in range(world)]
            if rank == 0 and self.kind == "bcast":
                mine = (self.folder / "root.pkl").read_bytes()
            self.ready.wait()
            self.go.wait()
            if self.kind in GATHERS:
                GATHERS[self.kind](pg, rank, world, mine, without_gc=self.name.split("@")[0] in NO_GC_GATHERS)
            elif self.kind in SCATTERS:
                SCATTERS[self.kind](pg, rank, world, datas)
            else:  # one rank's unpickle of a large broadcast is timed apart, in the parent
                broadcast_object(pg, rank, mine, unpickle=self.name == "commit_bcast")
            self.done[rank] = time.time()
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            self.errors.append(f"rank {rank}: {type(exc).__name__}: {exc}")


def comm_worker(pipe: Any, ranks: list[int], world: int, port: int, payloads: str) -> None:
    """Some of the ranks, as threads, each with its own gloo group; runs the rounds the parent starts."""
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(minutes=10))
    pgs: dict[int, Any] = {}

    def make(rank: int) -> None:
        pgs[rank] = _pg(dist.PrefixStore("g", base.clone()), rank, world)

    t = time.perf_counter()
    _on_threads(make, ranks)

    # The first collectives connect the pairs they use (lazy init): done once, before the timed rounds,
    # as a job's earlier saves (and the stage name's broadcast at the start of each save) would have.
    def warm(rank: int) -> None:
        for gather in GATHERS.values():
            gather(pgs[rank], rank, world, pickle.dumps(rank))
        for scatter in SCATTERS.values():
            scatter(pgs[rank], rank, world, [pickle.dumps(r) for r in range(world)] if rank == 0 else None)
        broadcast_object(pgs[rank], rank, pickle.dumps(0) if rank == 0 else None, unpickle=True)

    made = time.perf_counter() - t
    t = time.perf_counter()
    _on_threads(warm, ranks)
    pipe.send(("ready", made, time.perf_counter() - t))
    while True:
        command = pipe.recv()
        if command == "quit":
            pipe.send("bye")
            return
        name, kind, skip = command
        rnd = _Round(Path(payloads) / name.split("@")[0], name, kind, threading.Barrier(len(ranks) + 1))

        threads = [threading.Thread(target=rnd.run, args=(r, pgs[r], world)) for r in ranks]
        for th in threads:
            th.start()
        rnd.ready.wait()  # this process's ranks have their payloads
        pipe.send("loaded")
        start = pipe.recv()
        rnd.go.set()
        for th in threads:
            th.join()
        pipe.send({"start": start, "done": rnd.done, "errors": rnd.errors})
        gc.collect()


class Comms:
    """N gloo ranks as threads over `procs` processes around one TCPStore (in the parent)."""

    def __init__(self, world: int, procs: int, payloads: Path) -> None:
        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(minutes=10))  # fmt: skip
        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        for i in range(procs):
            parent, child = ctx.Pipe()
            ranks = list(range(i, world, procs))
            proc = ctx.Process(target=comm_worker, args=(child, ranks, world, self.store.port, str(payloads)),
                               daemon=True)  # fmt: skip
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)
        ready = [self._recv(p, 900) for p in self.pipes]
        self.setup_s = max(r[1] for r in ready)
        self.connect_s = max(r[2] for r in ready)

    @staticmethod
    def _recv(pipe: Any, timeout_s: float) -> Any:
        if not pipe.poll(timeout_s):
            raise TimeoutError("a gloo worker did not answer")
        return pipe.recv()

    def round(self, name: str, kind: str) -> float:
        """Seconds from rank 0's start to the last rank done."""
        for p in self.pipes:
            p.send((name, kind, False))
        for p in self.pipes:
            self._recv(p, 600)
        start = time.time()
        for p in self.pipes:
            p.send(start)
        results = [self._recv(p, 600) for p in self.pipes]
        errors = [e for r in results for e in r["errors"]]
        if errors:
            raise RuntimeError(f"{name}: {errors[:3]}")
        return max(t for r in results for t in r["done"].values()) - start

    def close(self) -> None:
        for p in self.pipes:
            try:
                p.send("quit")
                self._recv(p, 30)
            except (OSError, TimeoutError, EOFError):
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


# -- one N ---------------------------------------------------------------------------------------


def measure(world: int, args: argparse.Namespace, phases: set[str], work: Path) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.storage import WriteResult

    from spotguard.checkpoint.format.layout import DCP_METADATA_NAME, METADATA_INDEX_NAME, sibling_name
    from spotguard.checkpoint.format.manifest import FileRecord
    from spotguard.checkpoint.format.metadata_index import read_index
    from spotguard.checkpoint.format.runs import RunClaim
    from spotguard.checkpoint.format.safe_pickle import WeightsOnlyLoadPlanner, load_metadata
    from spotguard.checkpoint.resume.local_chunks import local_boxes
    from spotguard.checkpoint.save.dcp_steps import Placements, write_metadata
    from spotguard.checkpoint.save.indexed_write import MetadataFiles
    from spotguard.checkpoint.save.protocol import SaveProtocol
    from spotguard.checkpoint.save.shard_io import without_zip_crc32
    from spotguard.checkpoint.save.write import Written
    from spotguard.snapshots.items import metadata_of
    from spotguard.snapshots.needed import Layout, shard_layout, shards_needed, state_layout
    from spotguard.snapshots.shard_file import parse_trailer

    out: dict[str, Any] = {"ranks": world, "s": {}, "notes": {}}
    s, notes = out["s"], out["notes"]
    payloads = work / f"payloads-{world}"
    stage = work / f"ckpt-{world}" / sibling_name(1, "tmp")
    stage.mkdir(parents=True)
    for name, _ in ROUNDS:
        (payloads / name.split("@")[0]).mkdir(parents=True, exist_ok=True)

    def put(name: str, rank: int | str, obj: Any) -> int:
        data = pickle.dumps(obj)
        (payloads / name / f"{rank}.pkl").write_bytes(data)
        return len(data)

    # 1. every rank's real state and local plan; the sampled ranks' times; the snapshot indexes.
    samples = sorted({0, world // 2, world - 1})
    plans, times = [], {}
    planner0 = writer0 = None
    t_all = time.perf_counter()
    plan_bytes = index_bytes = 0
    infos: dict[int, Any] = {}
    for rank in range(world):
        state = rank_state(rank, world, args.tensors, args.rows_per_rank)
        writer = writer_for(stage, args.write_threads)
        planner, plan, took = local_plan(state, rank, writer)
        if rank in samples:
            times[rank] = took
        plans.append(plan)
        plan_bytes = max(plan_bytes, put("plan_gather", rank, plan))
        if "snapshot" in phases:
            infos[rank] = shard_info(state, rank, world)
        if rank == 0:
            planner0, writer0, state0 = planner, writer, state
    if "snapshot" in phases:  # 9. at one node (8 ranks) fewer: what each rank of the new world sends
        lost = min(RANKS_PER_NODE, world // 2)
        survivors = world - lost
        for rank in range(world):
            read = [rank, *([survivors + rank] if rank < lost else [])]  # a lost node's shards: its buddy's
            if rank < survivors:
                wants = state_layout(
                    rank_state(rank, survivors, args.tensors, args.rows_per_rank, world * args.rows_per_rank)
                )
                part = ({shard: shard_layout(infos[shard].items) for shard in read}, False, wants)
            else:  # gone: sends nothing (a group of the survivors in a real job)
                part = ({}, False, Layout.of([]))
            index_bytes = max(index_bytes, put("index_gather", rank, part))
        notes["reshard"] = f"{world} -> {survivors}"
    s["local_plan"] = statistics.median(times.values())
    notes["make_all_plans_s"] = round(time.perf_counter() - t_all, 1)
    notes["plan_pickle_bytes"] = plan_bytes
    notes["index_pickle_bytes"] = index_bytes
    notes["items_per_rank"] = len(plans[0].items)

    # 3. the global plan on rank 0.
    t = time.perf_counter()
    global_plans, metadata = planner0.create_global_plan(plans)
    global_plans = writer0.prepare_global_plan(global_plans)
    s["global_plan"] = time.perf_counter() - t
    del plans
    for rank, gp in enumerate(global_plans):
        put("plan_scatter", rank, gp)
    # what every rank does at the end of the scatter, at once in a real job (here N threads on 2 cores)
    data = pickle.dumps(global_plans[world - 1])
    t = time.perf_counter()
    pickle.loads(data)
    notes["a_rank_unpickles_its_plan_s"] = round(time.perf_counter() - t, 4)

    # 4. rank 0's real write.
    t = time.perf_counter()
    final0 = planner0.finish_plan(global_plans[0])
    with without_zip_crc32():
        fut = writer0.write_data(final0, planner0)
        fut.wait()
    results0 = fut.value()
    s["write"] = time.perf_counter() - t
    # The other ranks' write results: their final plans' items laid out as rank 0's were written
    # (same file names with their prefix, each item's length as rank 0's of the same fqn).
    length = {r.index.fqn: r.storage_data.length for r in results0}
    files0 = sorted({r.storage_data.relative_path for r in results0})
    # 5. what each rank sends after its write: its records and placements (rank 0's real ones, the
    # others' of the same sizes, in their final plans' order).
    fs = writer0.fs
    records0 = tuple(fs.record_for(p) for p in sorted(stage.iterdir()) if p.name.startswith("__0_"))
    gathered = [Written(records0, Placements.of(final0, results0), None)]
    for rank in range(1, world):
        gp = global_plans[rank]
        offsets: dict[str, int] = {}
        res = []
        for i, item in enumerate(gp.items):
            rel = f"{gp.storage_data.prefix}{i % len(files0)}.distcp"
            n = length.get(item.index.fqn, length[next(iter(length))])
            res.append(WriteResult(index=item.index, size_in_bytes=n,
                                   storage_data=_StorageInfo(rel, offsets.get(rel, 0), n)))  # fmt: skip
            offsets[rel] = offsets.get(rel, 0) + n
        recs = tuple(FileRecord(r.name.replace("__0_", f"__{rank}_", 1), r.size, r.crc32c) for r in records0)
        gathered.append(Written(recs, Placements.of(gp, res), None))
    notes["written_pickle_bytes"] = max(put("written_gather", rank, w) for rank, w in enumerate(gathered))
    del global_plans

    # 6. finish: the .metadata (and its index) on rank 0, from the placements.
    kept = MetadataFiles()
    placements = [w.placements for w in gathered]
    t = time.perf_counter()
    write_metadata(writer0, metadata, planner0.global_plan, placements, kept)
    s["finish"] = time.perf_counter() - t
    meta_path = stage / DCP_METADATA_NAME
    notes["metadata_bytes"] = meta_path.stat().st_size
    notes["index_bytes"] = (stage / METADATA_INDEX_NAME).stat().st_size

    # The next save of the same layout (the emergency's after periodic saves): rank 0's cached local
    # plan (its planner's cache promoted by finish_plan above), N empty plans gathered and scattered,
    # the cached global plan, the same placements: the kept files written again.
    # (rank 0's state made again: the fake group now stands for the last rank made, and a DTensor of
    # another rank's mesh coordinate takes a slow path of its own, O(N) per tensor)
    state0 = rank_state(0, world, args.tensors, args.rows_per_rank)
    _, empty, s["local_plan_cached"] = local_plan(state0, 0, writer_for(stage, args.write_threads), planner0)
    assert not empty.usable and not empty.items, "the cached plan was not reused"
    for rank in range(world):
        put("plan_gather_cached", rank, empty)
    t = time.perf_counter()
    delta, again = planner0.create_global_plan([empty] * world)
    delta = writer0.prepare_global_plan(delta)
    s["global_plan_cached"] = time.perf_counter() - t
    assert planner0.reused and again is metadata
    for rank, gp in enumerate(delta):
        put("plan_scatter_cached", rank, gp)
    stage2 = stage.parent / sibling_name(2, "tmp")
    stage2.mkdir()
    writer2 = writer_for(stage2, args.write_threads)
    t = time.perf_counter()
    write_metadata(writer2, metadata, planner0.global_plan, placements, kept)
    s["finish_cached"] = time.perf_counter() - t
    assert (stage2 / DCP_METADATA_NAME).read_bytes() == meta_path.read_bytes()
    del metadata, placements, kept

    # 7. rank 0's commit, with the .metadata's record added to its own (as `write._finish` does).
    extra = (fs.record_for(meta_path), fs.record_for(stage / METADATA_INDEX_NAME))
    gathered[0] = dataclasses.replace(gathered[0], records=records0 + extra)
    comm = types.SimpleNamespace(members=list(range(world)), world_size=world, is_coordinator=True, rank=0)
    proto = types.SimpleNamespace(comm=comm, key=None, run_id="bench-run", job=None,
                                  claim=RunClaim("bench-run", __import__("datetime").datetime.now()))  # fmt: skip
    t = time.perf_counter()
    commit = SaveProtocol._commit(proto, 1, "bench", None, stage, gathered, comm, ())
    s["commit_rank0"] = time.perf_counter() - t
    if commit.error:
        raise RuntimeError(commit.error)
    put("commit_bcast", "root", commit)
    gathered_names = [r for w in gathered for r in w.records]
    del gathered

    # 8. resume: one rank's metadata read (through the index, as `VerifiedReader` reads a sharded
    # state's; `.metadata` as before for comparison) and its local load plan.
    rank = world - 1
    state = rank_state(rank, world, args.tensors, args.rows_per_rank)
    data = (Path(commit.path) / DCP_METADATA_NAME).read_bytes()
    t = time.perf_counter()
    load_metadata(data)
    s["metadata_unpickle"] = time.perf_counter() - t
    data = (Path(commit.path) / METADATA_INDEX_NAME).read_bytes()
    listed = {r.name for r in gathered_names}.__contains__
    t = time.perf_counter()
    loaded = read_index(data, local_boxes(state), listed)
    s["metadata_read"] = time.perf_counter() - t
    del data
    t = time.perf_counter()
    lp = WeightsOnlyLoadPlanner()
    lp.set_up_planner(state, loaded, is_coordinator=False)
    lp.create_local_plan()
    s["load_plan"] = time.perf_counter() - t
    del loaded, lp

    # 9. rank 0 finds the shards each rank needs (loading.PlanLoader._needed); a rank reads their indexes.
    if "snapshot" in phases:
        gathered = [pickle.loads((payloads / "index_gather" / f"{r}.pkl").read_bytes()) for r in range(world)]
        t = time.perf_counter()
        shards = {shard: layout for part, _, _ in gathered for shard, layout in part.items()}
        local = [[r // RANKS_PER_NODE * RANKS_PER_NODE + i for i in range(RANKS_PER_NODE)] for r in range(world)]
        needed = shards_needed(shards, [wants for _, _, wants in gathered], local)
        s["index_match"] = time.perf_counter() - t
        for r, shards_of in enumerate(needed):
            put("needed_scatter", r, shards_of)
        sample = survivors // 2
        notes["shards_a_rank_needs"] = max(len(n) for n in needed[:survivors])
        trailers = [infos[shard].encoded() for shard in needed[sample]]  # as `fetch_info` gets them
        del gathered, shards, needed
        t = time.perf_counter()
        read = {info.rank: info for info in map(parse_trailer, trailers)}
        metadata_of({shard: info.items for shard, info in read.items()}, whole=len(read) == world)
        s["index_read"] = time.perf_counter() - t
        del read, trailers
    infos.clear()
    del state, state0, planner0, writer0
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()

    # The communication, over real gloo threads.
    comm_rounds = [(n, k) for n, k in ROUNDS if any(n in ROUND_OF_PHASE.get(p, ()) for p in phases)]
    if comm_rounds:
        comms = Comms(world, min(args.procs, world), payloads)
        notes["gloo_groups_s"] = round(comms.setup_s, 2)
        notes["gloo_first_collectives_s"] = round(comms.connect_s, 2)
        try:
            for name, kind in comm_rounds:
                s[name] = comms.round(name, kind)
        finally:
            comms.close()
    shutil.rmtree(payloads, ignore_errors=True)
    shutil.rmtree(work / f"ckpt-{world}", ignore_errors=True)
    return out


def phase_rows(s: dict[str, float | None]) -> dict[str, float | None]:
    """The table's phases from the measured parts (None: a part not measured)."""

    def add(*parts: str) -> float | None:
        vals = [s.get(p) for p in parts]
        return None if any(v is None for v in vals) else sum(vals)

    rows = {
        "1 local plan (a rank)": s.get("local_plan"),
        "2 plan gather": s.get("plan_gather"),
        "3 global plan (rank 0)": s.get("global_plan"),
        "4 write (rank 0, not coord.)": s.get("write"),
        "5 plan scatter": s.get("plan_scatter"),
        "5 the same, torch's scatter_object_list (before)": s.get("plan_scatter@torch"),
        "5 written gather (records+placements)": s.get("written_gather"),
        "5 the same, torch's gather_object (before)": s.get("written_gather@torch"),
        "6 finish .metadata + index (rank 0)": s.get("finish"),
        "7 commit (rank 0)": s.get("commit_rank0"),
        "7 commit bcast": s.get("commit_bcast"),
        "R1 local plan, cached (a rank)": s.get("local_plan_cached"),
        "R2 empty plans gathered": s.get("plan_gather_cached"),
        "R2 the same, torch's gather_object (before)": s.get("plan_gather_cached@torch"),
        "R3 global plan, cached (rank 0)": s.get("global_plan_cached"),
        "R5 empty plans scattered": s.get("plan_scatter_cached"),
        "R6 the kept .metadata + index written": s.get("finish_cached"),
        "8 .metadata unpickled (before: a rank)": s.get("metadata_unpickle"),
        "8 metadata read via the index (a rank)": s.get("metadata_read"),
        "8 load plan (a rank)": s.get("load_plan"),
        "9 index gather": s.get("index_gather"),
        "9 shards each rank needs (rank 0)": s.get("index_match"),
        "9 scatter of the lists": s.get("needed_scatter"),
        "9 its shards' indexes (a rank)": s.get("index_read"),
    }
    first = ["local_plan", "plan_gather", "global_plan", "plan_scatter", "written_gather", "finish", "commit_rank0",
             "commit_bcast"]  # fmt: skip
    cached = ["local_plan_cached", "plan_gather_cached", "global_plan_cached", "plan_scatter_cached",
              "written_gather", "finish_cached", "commit_rank0", "commit_bcast"]  # fmt: skip
    rows["= coordination, a first save"] = add(*first)
    rows["= coordination, a save of the cached plan (the emergency's)"] = add(*cached)
    rows["= resume (8, via the index)"] = add("metadata_read", "load_plan")
    rows["= index exchange (9)"] = add("index_gather", "index_match", "needed_scatter", "index_read")
    return rows


def fmt(v: Any) -> str:
    return "-" if v is None else (v if isinstance(v, str) else f"{v:.3f}")


def report(results: list[dict[str, Any]]) -> str:
    per = [phase_rows(r["s"]) for r in results]
    ns = [r["ranks"] for r in results]
    headers = ["phase"] + [f"N={n} s" for n in ns]
    headers += [f"x{ns[i]}->{ns[i + 1]}" for i in range(len(ns) - 1)]
    if len(ns) > 1:
        headers.append(f"N={ns[-1]} / linear from N={ns[0]}")
    rows = []
    for key in per[0]:
        vals = [p[key] for p in per]
        row = [key] + [fmt(v) for v in vals]
        for i in range(len(ns) - 1):
            a, b = vals[i], vals[i + 1]
            row.append(f"{b / a:.1f}" if isinstance(a, float) and isinstance(b, float) and a > 0 else "")
        if len(ns) > 1:
            a, b = vals[0], vals[-1]
            row.append(
                f"{b / (a * ns[-1] / ns[0]):.2f}" if isinstance(a, float) and isinstance(b, float) and a > 0 else ""
            )
        rows.append(row)
    lines = [table(headers, rows), "", "No metadata broadcast: no rank receives DCP's Metadata (dcp_steps).", ""]
    for r in results:
        lines.append(f"N={r['ranks']}: " + ", ".join(f"{k}={v}" for k, v in r["notes"].items()))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="16,64,256,1024")
    p.add_argument("--quick", action="store_true", help="N = 16, 64 only")
    p.add_argument("--tensors", type=int, default=200)
    p.add_argument("--rows-per-rank", type=int, default=2)
    p.add_argument("--write-threads", type=int, default=2, help="the FileSystemWriter's files per rank")
    p.add_argument("--procs", type=int, default=4, help="processes the gloo threads are spread over")
    p.add_argument("--phases", default=",".join(PHASES), help=f"a subset of {','.join(PHASES)}")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    ranks = [16, 64] if args.quick else [int(n) for n in args.ranks.split(",")]
    phases = set(args.phases.split(","))
    if unknown := phases - set(PHASES):
        p.error(f"unknown phases {sorted(unknown)}")
    warnings.simplefilter("ignore")
    results = []
    with tempfile.TemporaryDirectory(prefix="spotguard-save-scale-") as tmp:
        for world in ranks:
            t = time.perf_counter()
            results.append(measure(world, args, phases, Path(tmp)))
            results[-1]["notes"]["wall_s"] = round(time.perf_counter() - t, 1)
            print(f"N={world} done in {results[-1]['notes']['wall_s']} s", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(results))
    else:
        print(report(results))


if __name__ == "__main__":
    main()
