"""Snapshots in the nodes' memory: what they cost the training, and how fast a job comes back from them.

    python bench/snapshots.py [--gb 1.0] [--every 100] [--dir /dev/shm/spotguard-bench]

Two ranks (gloo, subprocesses, one compute thread each), each its own "node" with its own snapshot
dir under --dir, hold --gb GB of state each (float32 tensors). A training step is either a 0.18 s
sleep (the step runs on an accelerator and the host's cores are free: the common case) or a
2048x2048 matmul on the rank's one core (about 0.18 s: both cores of this machine busy, the worst
case); either way it updates one 64 MB tensor of the state in place.

  overhead   for each kind of step: windows of --every steps without snapshots (the baseline: wall
             and process CPU time, between barriers of both ranks) alternate with intervals of --every
             steps with a snapshot at the first step of each (the state copied into the snapshot
             file's mapped pages on the training thread; then in the background its CRC32C, and the
             copy sent to the other rank, which keeps it as its replica): A B A B ... A. The extra
             time of an interval is its time, until both ranks' snapshots are written and
             replicated, less the mean of the two baseline windows around it; its extra CPU the same
             against their CPU time (this rank's copy, CRC32C, send, and the other rank's replica
             received). The first two snapshots make the tier's files (new tmpfs
             pages: two warm-up intervals, shown apart); later ones write over a freed snapshot's.
             The goal: the steady extra time of one snapshot a minute <= 1 % of the time (extra /
             60 s: an extrapolation, since the intervals measured are --every x t0, 18 s by default).
  lost work  at every step of the later intervals, how many steps a loss without a notice would
             lose: the step less the newest snapshot whole on every rank (each rank's shard written
             and replicated; gathered after the run; a failed snapshot's steps are left out). At most
             one interval plus the steps the newest snapshot takes to be written and replicated.
  recovery   guard.resume() of the same state, timed on rank 0, from: the peer's memory (rank 0's
             snapshot dir moved away first, a replacement VM: its shard comes from rank 1), its own
             node's memory (the dir put back: a restart of the workers), a checkpoint on the local
             disk (--disk-dir; just written: the page cache is warm) and an S3 bucket (moto on
             127.0.0.1 on the same cores, staged through a fresh local dir under --dir). The goal:
             from the peers' memory >= 5x faster than from the bucket.
  cadences   lost work at snapshots every 10, 50 and 200 steps of 10 ms, with 64 MB per rank.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import Ranks, init_worker, report, start_s3, table

TENSOR_MB = 64
STEP_MATMUL = 2048  # about 0.18 s on one core
ACCELERATOR_STEP_S = 0.18
CADENCES = (10, 50, 200)


def make_state(gb: float, rank: int) -> dict:
    import torch

    count = max(1, round(gb * 1024 / TENSOR_MB))
    g = torch.Generator().manual_seed(rank)
    layers = {f"w{i}": torch.rand(TENSOR_MB << 18, generator=g) for i in range(count)}
    return {"model": layers, "progress": {"rank": rank}}


def train_step(state: dict, a, kind: str) -> None:
    if kind == "cpu":
        a @ a  # noqa: B018 - the compute of a step, on this rank's one core
    else:
        time.sleep(ACCELERATOR_STEP_S)  # the step runs on an accelerator; the host's cores are free
    state["model"]["w0"].add_(1e-3)


def note_newest(guard, step: int, newest_by_step: dict[int, int]) -> None:
    """At `step`, this rank's newest snapshot written and replicated (none yet, or failed: nothing noted)."""
    last = guard.snapshots.last
    if last is not None and last.ok:
        newest_by_step[step] = last.step


def lost_steps(newest_by_step: dict[int, int]) -> list[int]:
    """Per step, what a loss without a notice would lose: a job resumes from the newest snapshot whole on every
    rank, so the step less the oldest of the ranks' newest snapshots written and replicated (gathered after the
    run, so that counting costs the training nothing)."""
    import torch.distributed as dist

    every_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, newest_by_step)
    steps = set.intersection(*(set(r) for r in every_rank))
    return [step - min(r[step] for r in every_rank) for step in sorted(steps)]


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import spotguard

    rank, _ = init_worker()
    import torch

    # Each rank is a node of its own (Ranks starts them as the local ranks of one node).
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank))
    os.environ["SPOTGUARD_SNAPSHOT_DIR"] = str(Path(args.dir) / f"node{rank}")
    state = make_state(args.gb, rank)
    a = torch.rand(STEP_MATMUL, STEP_MATMUL)
    nbytes = sum(t.numel() * 4 for t in state["model"].values())
    ckpt = str(Path(args.disk_dir) / "ckpt")

    def baseline_window(kind: str) -> tuple[float, float]:
        """--every steps without snapshots, timed as a snapshot window is: wall and process CPU time."""
        dist.barrier()
        began, cpu = time.perf_counter(), time.process_time()
        for _ in range(args.every):
            train_step(state, a, kind)
        dist.barrier()
        return time.perf_counter() - began, time.process_time() - cpu

    def phase(kind: str, guard: spotguard.Guard, first: int, warmup: int) -> dict:
        # Baseline and snapshot windows alternate (A B A B ... A): each snapshot window is judged against
        # the mean of the baseline windows on either side of it, so a drift of the machine cancels out.
        bases = [baseline_window(kind)]
        windows, cpus, newest_by_step, done = [], [], {}, []
        for window in range(warmup + 3):
            start = first + window * args.every
            dist.barrier()
            began, cpu = time.perf_counter(), time.process_time()
            for step in range(start, start + args.every):
                train_step(state, a, kind)
                guard.step(step, state)
                if window > warmup:
                    note_newest(guard, step, newest_by_step)
            done.append(guard.snapshots.wait())  # the interval's background work, whatever outlasted its steps
            dist.barrier()  # and the other rank's, whose replica this rank's server takes in
            elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu
            bases.append(baseline_window(kind))
            windows.append(elapsed - (bases[-2][0] + bases[-1][0]) / 2)
            cpus.append(cpu - (bases[-2][1] + bases[-1][1]) / 2)
        lost = lost_steps(newest_by_step)
        t0 = statistics.mean(b[0] for b in bases) / args.every  # the baseline's mean step time
        return {"kind": kind, "t0": t0, "warmup": warmup, "extra": windows, "cpu": cpus,
                "stall_s": [d.stall_s for d in done], "write_s": [d.write_s for d in done],
                "replicate_s": [d.replicate_s for d in done],
                "lost_mean": statistics.mean(lost), "lost_max": max(lost)}  # fmt: skip

    with spotguard.Guard(ckpt, cloud="none", snapshot_every=args.every, exit_code=None) as guard:
        # The first two snapshots make the tier's files (new tmpfs pages); every later one writes over freed ones.
        phases = [phase("accelerator", guard, 0, warmup=2), phase("cpu", guard, 5 * args.every, warmup=0)]
        dist.barrier()
    if rank == 0:
        report(kind="overhead", phases=phases, bytes=nbytes)
    dist.barrier()

    def timed_resume(location: str, **options) -> float:
        dist.barrier()
        with spotguard.Guard(location, cloud="none", exit_code=None, **options) as guard:
            began = time.perf_counter()
            step = guard.resume(state)
            took = time.perf_counter() - began
            assert step is not None, f"nothing to resume from in {location}"
        return took

    # A replacement VM for rank 0: its memory is empty; rank 1 still holds its replica. A resume from
    # the peer writes nothing back to rank 0's memory, so its files are put back from a copy before the
    # second resume: a restart of the workers on the same node.
    node0 = Path(args.dir) / "node0"
    if rank == 0:
        node0.rename(node0.with_name("node0-kept"))
    peer = timed_resume(ckpt, snapshot_every=args.every)
    if rank == 0:
        shutil.rmtree(node0, ignore_errors=True)
        node0.with_name("node0-kept").rename(node0)
    own = timed_resume(ckpt, snapshot_every=args.every)
    shutil.rmtree(Path(args.dir) / f"node{rank}")  # the memory back for the durable runs
    with spotguard.Guard(ckpt, cloud="none", exit_code=None) as guard:
        guard.save(10_000, state)
    disk = timed_resume(ckpt)
    bucket_dir = "s3://bench/run"
    with spotguard.Guard(bucket_dir, cloud="none", exit_code=None, local_dir=str(Path(args.dir) / f"stage{rank}")) as g:
        g.save(10_000, state)
    shutil.rmtree(Path(args.dir) / f"stage{rank}")  # a new VM: nothing staged locally
    bucket = timed_resume(bucket_dir, local_dir=str(Path(args.dir) / f"fresh{rank}"))
    if rank == 0:
        report(kind="recovery", peer=peer, own=own, disk=disk, bucket=bucket, bytes=nbytes)

    # Lost work at several cadences: a small state (64 MB), 10 ms steps, four intervals each.
    small = {"model": {"w0": torch.rand(TENSOR_MB << 18)}}
    by_cadence = {}
    for every in CADENCES:
        dist.barrier()
        newest_by_step = {}
        location = str(Path(args.disk_dir) / f"cadence-{every}")
        with spotguard.Guard(location, cloud="none", snapshot_every=every, exit_code=None) as guard:
            for step in range(4 * every):
                time.sleep(0.01)
                small["model"]["w0"].add_(1.0)
                guard.step(step, small)
                if step >= every:
                    note_newest(guard, step, newest_by_step)
        lost = lost_steps(newest_by_step)
        by_cadence[every] = (statistics.mean(lost), max(lost))
    if rank == 0:
        report(kind="cadences", lost=by_cadence)
    dist.barrier()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="state per rank in GB (default 1.0)")
    parser.add_argument("--every", type=int, default=100, help="steps per snapshot interval (default 100)")
    parser.add_argument("--dir", default="/dev/shm/spotguard-bench", help="the nodes' snapshot dirs and checkpoints")
    parser.add_argument("--disk-dir", default=tempfile.gettempdir(), help="where the disk checkpoint goes")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    server = start_s3()
    shutil.rmtree(args.dir, ignore_errors=True)
    disk = tempfile.mkdtemp(prefix="spotguard-bench-", dir=args.disk_dir)
    try:
        with (
            tempfile.TemporaryDirectory(prefix="spotguard-bench-") as logs,
            Ranks(
                __file__,
                2,
                ["--gb", str(args.gb), "--every", str(args.every), "--dir", args.dir, "--disk-dir", disk],
                Path(logs),
            ) as ranks,
        ):
            results = {m["kind"]: m for m in ranks.messages()}
            ranks.wait(600)
    finally:
        server.stop()
        shutil.rmtree(args.dir, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    o, r = results["overhead"], results["recovery"]
    print(f"state: {o['bytes'] / 1e9:.2f} GB per rank, 2 ranks (one node each), one compute thread each; "
          f"a snapshot every {args.every} steps")  # fmt: skip
    rows = []
    for p in o["phases"]:
        for i in range(len(p["extra"])):
            rows.append([f"{p['kind']} (t0 {p['t0'] * 1e3:.0f} ms)" if i == 0 else "",
                         f"{i + 1}{' (new pages)' if i < p['warmup'] else ''}",
                         f"{p['stall_s'][i]:.3f} s", f"{p['extra'][i]:.2f} s", f"{p['write_s'][i]:.2f} s",
                         f"{p['replicate_s'][i]:.2f} s", f"{p['cpu'][i] / o['bytes'] * 1e9:.2f} s"])  # fmt: skip
    print(table(["training step", "interval", "stall", "extra time of the interval", "write", "replicate",
                 "extra CPU per GB"], rows))  # fmt: skip
    for p in o["phases"]:
        steady = statistics.mean(p["extra"][p["warmup"] :])
        interval_s = args.every * p["t0"]
        print(f"{p['kind']}: extra time per snapshot {steady:.2f} s; at one snapshot a minute {steady:.2f} s / 60 s = "
              f"{100 * steady / 60:.2f} % (goal <= 1 %; extrapolated from intervals of {interval_s:.0f} s); lost work "
              f"on a loss without notice: mean {p['lost_mean']:.1f} steps, max {p['lost_max']} (an interval: "
              f"{args.every} steps, plus the newest snapshot's write and replication)")  # fmt: skip
    print(table(
        ["resume from", "guard.resume()", "vs the bucket"],
        [[name, f"{r[key]:.2f} s", f"{r['bucket'] / r[key]:.1f}x"] for name, key in
         (("a peer's memory (replacement VM)", "peer"), ("its own node's memory", "own"),
          ("local disk (page cache warm)", "disk"), ("S3 bucket (moto on 127.0.0.1)", "bucket"))],
    ))  # fmt: skip
    print(f"recovery from a peer's memory vs the bucket: {r['bucket'] / r['peer']:.1f}x (goal >= 5x)")
    lost = results["cadences"]["lost"]
    print(table(["snapshot every (10 ms steps, 64 MB)", "lost steps on a loss without notice: mean", "max"],
                [[f"{k} steps", f"{v[0]:.1f}", f"{v[1]}"] for k, v in lost.items()]))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
