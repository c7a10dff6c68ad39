"""Snapshots in the nodes' memory: what they cost the training, and how fast a job comes back from them.

    python bench/snapshots.py [--gb 1.0] [--every 100] [--dir /dev/shm/spotguard-bench]
                              [--only costs,overhead,recovery,cadences]

Two ranks (gloo, subprocesses, one compute thread each), each its own "node" with its own snapshot
dir under --dir, hold --gb GB of state each (float32 tensors). A training step is either a 0.18 s
sleep (the step runs on an accelerator and the host's cores are free: the common case) or a
2048x2048 matmul on the rank's one core (about 0.18 s: both cores of this machine busy, the worst
case); either way it updates one 64 MB tensor of the state in place.

  costs      the CPU seconds per GB of each part of a snapshot, in one process with nothing else
             running (each part's thread CPU time, user and system): the copy into the snapshot file,
             its CRC32C, the send (sendfile), the receive into the replica's mapped pages with its
             CRC32C as it arrives, and the receiver's checks (trailer, rename); the first round makes
             new tmpfs pages, the figures are the best of the later ones (pages written over). Beside
             them the floor of this machine: a bare memcpy, a CRC32C pass, and a bare send + receive
             over 127.0.0.1, of the same bytes between anonymous buffers.
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
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import Ranks, init_worker, report, start_s3, table

TENSOR_MB = 64
STEP_MATMUL = 2048  # about 0.18 s on one core
ACCELERATOR_STEP_S = 0.18
CADENCES = (10, 50, 200)
SECTIONS = ("costs", "overhead", "recovery", "cadences")
COST_ROUNDS = 4  # the first makes new tmpfs pages; the best of the others is kept


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


def cpu_of(fn: Callable[[], Any]) -> tuple[Any, float]:
    """`fn()`'s result and the CPU time (user and system) of the calling thread while it ran."""
    began = time.thread_time()
    out = fn()
    return out, time.thread_time() - began


def over_loopback(send: Callable[[socket.socket], Any], receive: Callable[[socket.socket], Any]) -> dict:
    """`send` on one end of a TCP connection over 127.0.0.1 and `receive` (on a thread of its own) on
    the other: each side's thread CPU time, and what `receive` returned."""
    got: dict = {}
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def receiving() -> None:
            conn, _ = listener.accept()
            with conn:
                got["value"], got["receive"] = cpu_of(lambda: receive(conn))

        thread = threading.Thread(target=receiving)
        thread.start()
        with socket.create_connection(listener.getsockname()) as sock:
            _, got["send"] = cpu_of(lambda: send(sock))
        thread.join()
    return got


def floor_costs(nbytes: int) -> dict[str, float]:
    """This machine's floor for `nbytes`: a bare memcpy, a CRC32C pass, a bare send and receive over
    127.0.0.1 (CPU seconds, each between anonymous buffers already faulted in: filled first)."""
    import torch

    from spotguard.checkpoint.moves.handoff.wire import CHUNK
    from spotguard.snapshots.shard_file import BlockCrcs

    src, dst = torch.empty(nbytes, dtype=torch.uint8).fill_(1), torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    _, memcpy = cpu_of(lambda: dst.copy_(src))
    _, crc = cpu_of(lambda: BlockCrcs().update(src.numpy()))
    view = memoryview(dst.numpy())

    def receive(sock: socket.socket) -> None:
        got = 0
        while got < nbytes:
            got += sock.recv_into(view[got : got + CHUNK])

    bare = over_loopback(lambda sock: sock.sendall(memoryview(src.numpy())), receive)
    view.release()
    return {"memcpy": memcpy, "crc": crc, "send": bare["send"], "receive": bare["receive"]}


def snapshot_round(node_dir: Any, state: dict, step: int) -> dict[str, float]:
    """One snapshot of `state` made and sent to `node_dir` the way the tier does (its files then freed
    as spares, for the next round to write over): each part's CPU seconds."""
    from spotguard.snapshots import shard_file
    from spotguard.snapshots.node_dir import name_of
    from spotguard.snapshots.peers import receive_file

    path = node_dir.prepare(name_of(step, 0, 2))
    shard, copy = cpu_of(lambda: shard_file.MappedShard(path, state, node_dir.take_spare).fill())
    info, crc = cpu_of(lambda: shard.finish(run="r", job="j", attempt="a", step=step, rank=0, world_size=2))
    size, replica = path.stat().st_size, node_dir.prepare(name_of(step, 1, 2))
    with open(path, "rb") as f:
        sent = over_loopback(lambda sock: sock.sendfile(f, 0),
                             lambda sock: receive_file(sock, replica, size, info.body_bytes, node_dir))  # fmt: skip
    assert sent["value"] == info
    _, checks = cpu_of(lambda: shard_file.read_info(replica))  # what receive_file checks once all is in
    node_dir.keep_only(set(), spares=2)
    return {"copy": copy, "crc": crc, "send": sent["send"], "receive": sent["receive"], "checks": checks}


def part_costs(gb: float, where: Path) -> dict:
    """CPU seconds per GB of each part of a snapshot of `gb` GB, and of the floor (see the docstring)."""
    import torch

    from spotguard.snapshots.node_dir import NodeDir

    torch.set_num_threads(1)  # as a rank's
    state = make_state(gb, 0)["model"]
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    shutil.rmtree(where, ignore_errors=True)
    try:
        node_dir = NodeDir(where, "costs")
        rounds = [snapshot_round(node_dir, state, step) for step in range(1, COST_ROUNDS + 1)]
    finally:
        shutil.rmtree(where, ignore_errors=True)
    floors = [floor_costs(nbytes) for _ in rounds[1:]]
    per_gb = 1e9 / nbytes

    def best(runs: list[dict[str, float]]) -> dict[str, float]:
        return {part: min(r[part] for r in runs) * per_gb for part in runs[0]}

    return {"new_pages": best(rounds[:1]), "steady": best(rounds[1:]), "floor": best(floors), "bytes": nbytes}


def print_costs(c: dict) -> None:
    s, f = c["steady"], c["floor"]
    print(f"CPU seconds per GB of a snapshot's parts ({c['bytes'] / 1e9:.2f} GB, one process, nothing else running; "
          f"best of {COST_ROUNDS - 1} rounds over a freed snapshot's pages):")  # fmt: skip
    rows = [
        ["copy into the snapshot file (training thread)", s["copy"], c["new_pages"]["copy"], "memcpy", f["memcpy"]],
        ["CRC32C of the file, trailer, name", s["crc"], c["new_pages"]["crc"], "CRC32C pass", f["crc"]],
        ["send (sendfile)", s["send"], c["new_pages"]["send"], "send (sendall)", f["send"]],
        ["receive into mapped pages, CRC32C as it arrives", s["receive"], c["new_pages"]["receive"],
         "recv_into + CRC32C pass", f["receive"] + f["crc"]],
        ["receiver's checks (trailer, compare)", s["checks"], c["new_pages"]["checks"], "", 0.0],
    ]  # fmt: skip
    total = sum(s.values())
    floor = f["memcpy"] + 2 * f["crc"] + min(f["send"], s["send"]) + f["receive"]  # sendfile copies nothing
    rows.append(["a node's total (its snapshot made and sent, a replica taken)", total,
                 sum(c["new_pages"].values()), "floor", floor])  # fmt: skip
    print(table(["part", "CPU s per GB", "new pages", "floor on this machine", "CPU s per GB"],
                [[r[0], f"{r[1]:.3f}", f"{r[2]:.3f}", r[3], f"{r[4]:.3f}" if r[3] else ""] for r in rows]))  # fmt: skip


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

    if "overhead" in args.only:
        with spotguard.Guard(ckpt, cloud="none", snapshot_every=args.every, exit_code=None) as guard:
            # The first two snapshots make the tier's files (new tmpfs pages); every later one writes over freed ones.
            phases = [phase("accelerator", guard, 0, warmup=2), phase("cpu", guard, 5 * args.every, warmup=0)]
            dist.barrier()
        if rank == 0:
            report(kind="overhead", phases=phases, bytes=nbytes)
        dist.barrier()
    if "recovery" in args.only:
        recovery(args, state, ckpt, rank)
    if "cadences" in args.only:
        cadences(args)


def recovery(args: argparse.Namespace, state: dict, ckpt: str, rank: int) -> None:
    """Resume from the snapshots the overhead runs left, then from a disk checkpoint and the bucket."""
    import torch.distributed as dist

    import spotguard

    nbytes = sum(t.numel() * 4 for t in state["model"].values())

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


def cadences(args: argparse.Namespace) -> None:
    """Lost work at several cadences: a small state (64 MB), 10 ms steps, four intervals each."""
    import torch
    import torch.distributed as dist

    import spotguard

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
    if dist.get_rank() == 0:
        report(kind="cadences", lost=by_cadence)
    dist.barrier()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="state per rank in GB (default 1.0)")
    parser.add_argument("--every", type=int, default=100, help="steps per snapshot interval (default 100)")
    parser.add_argument("--dir", default="/dev/shm/spotguard-bench", help="the nodes' snapshot dirs and checkpoints")
    parser.add_argument("--disk-dir", default=tempfile.gettempdir(), help="where the disk checkpoint goes")
    parser.add_argument("--only", type=sections, default=",".join(SECTIONS),
                        help=f"the parts to run, comma-separated, of {','.join(SECTIONS)} (default all; "
                             "recovery resumes from the overhead runs' snapshots)")  # fmt: skip
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    if "costs" in args.only:
        print_costs(part_costs(args.gb, Path(args.dir) / "costs"))
    if args.only - {"costs"}:
        run_ranks(args)
    return 0


def sections(text: str) -> set[str]:
    chosen = set(text.split(","))
    if not chosen <= set(SECTIONS) or ("recovery" in chosen and "overhead" not in chosen):
        raise argparse.ArgumentTypeError(f"a comma-separated choice of {','.join(SECTIONS)}; recovery with overhead")
    return chosen


def run_ranks(args: argparse.Namespace) -> None:
    """The two-rank parts (overhead, recovery, cadences): run, then printed."""
    server = start_s3() if "recovery" in args.only else None
    shutil.rmtree(args.dir, ignore_errors=True)
    disk = tempfile.mkdtemp(prefix="spotguard-bench-", dir=args.disk_dir)
    only = ",".join(sorted(args.only))
    try:
        with (
            tempfile.TemporaryDirectory(prefix="spotguard-bench-") as logs,
            Ranks(
                __file__,
                2,
                ["--gb", str(args.gb), "--every", str(args.every), "--dir", args.dir, "--disk-dir", disk,
                 "--only", only],
                Path(logs),
            ) as ranks,
        ):  # fmt: skip
            results = {m["kind"]: m for m in ranks.messages()}
            ranks.wait(600)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(args.dir, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    if "overhead" in results:
        print_overhead(results["overhead"], args.every)
    if "recovery" in results:
        print_recovery(results["recovery"])
    if "cadences" in results:
        lost = results["cadences"]["lost"]
        print(table(["snapshot every (10 ms steps, 64 MB)", "lost steps on a loss without notice: mean", "max"],
                    [[f"{k} steps", f"{v[0]:.1f}", f"{v[1]}"] for k, v in lost.items()]))  # fmt: skip


def print_overhead(o: dict, every: int) -> None:
    print(f"state: {o['bytes'] / 1e9:.2f} GB per rank, 2 ranks (one node each), one compute thread each; "
          f"a snapshot every {every} steps")  # fmt: skip
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
        interval_s = every * p["t0"]
        print(f"{p['kind']}: extra time per snapshot {steady:.2f} s; at one snapshot a minute {steady:.2f} s / 60 s = "
              f"{100 * steady / 60:.2f} % (goal <= 1 %; extrapolated from intervals of {interval_s:.0f} s); lost work "
              f"on a loss without notice: mean {p['lost_mean']:.1f} steps, max {p['lost_max']} (an interval: "
              f"{every} steps, plus the newest snapshot's write and replication)")  # fmt: skip


def print_recovery(r: dict) -> None:
    print(table(
        ["resume from", "guard.resume()", "vs the bucket"],
        [[name, f"{r[key]:.2f} s", f"{r['bucket'] / r[key]:.1f}x"] for name, key in
         (("a peer's memory (replacement VM)", "peer"), ("its own node's memory", "own"),
          ("local disk (page cache warm)", "disk"), ("S3 bucket (moto on 127.0.0.1)", "bucket"))],
    ))  # fmt: skip
    print(f"recovery from a peer's memory vs the bucket: {r['bucket'] / r['peer']:.1f}x (goal >= 5x)")


if __name__ == "__main__":
    sys.exit(main())
