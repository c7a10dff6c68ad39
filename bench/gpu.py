"""The data path on one GPU, every method on the same state in one run: save, background-save stall, resume.

    python bench/gpu.py [--gb 8] [--repeat 1] [--dir DIR] [--device cuda|cpu] [--threads N] [--snapshots N]
                        [--layouts huge,mid] [--layout-gb 1] [--resume-trials 3] [--only-layouts]

One process holds an MLP of --width x --width float32 layers with its AdamW state (weights +
exp_avg + exp_avg_sq after one real step), --gb GB in all, on --device. Without CUDA the
script says so and exits 0; `--device cpu` runs the same table on CPU tensors. Timed (the
files of at most two methods on the disk at a time, so --gb 24 fits a 64 GB disk):

  copy limit          every tensor into host buffers allocated beforehand: device -> pinned
                      memory with non_blocking copies on CUDA, a memcpy on CPU (median of 5)
  disk limit          the state's bytes written by --threads threads (spotguard's default:
                      from os.cpu_count()), writeback started as they go, then fsync
  torch.save          the full state_dict to one file, then fsync (the classic rank-0 save)
  dcp.save            torch.distributed.checkpoint.save with its defaults (fsyncs its files)
  spotguard emergency a GCP preemption raised on a local metadata emulator while the loop runs
                      training steps; timed from the raise to guard.step() returning True with
                      the step committed (the notice's detection included). Twice: in a Guard
                      that made no save before (each piece crosses through the pinned pool while
                      the one before is written), and in one that made a background save first
                      (`save_every`; the notice comes once it is done), whose buffers the
                      emergency stages into
  snapshot stall      a Guard taking a snapshot every few steps (files under /dev/shm): what
                      guard.step() holds the training thread at a snapshot step (median of
                      --snapshots after the first, which allocates the pinned copy), against
                      the copy limit; then a new Guard's resume from that memory into the GPU
  background stall    what Checkpointer.save(wait=False) holds the training thread, between real
                      training steps (median of --stall-saves saves after the first, which
                      allocates the buffers), against the copy limit and dcp.async_save's call
  resume, cold cache  the page cache dropped (/proc/sys/vm/drop_caches as root, else
                      posix_fadvise DONTNEED on each file): Checkpointer.resume into the
                      existing state against torch.load + load_state_dict of the torch.save
                      file, and the disk's read limit (--threads threads reading that file)
  resume by layout    the same cold resume for states of another shape, --layout-gb GB each,
                      in the same run: `huge`, layers 8192 wide (a few tensors of 268 MB: one
                      layer, its two AdamW moments, 0.8 GB) and `mid`, layers 2048 wide (many
                      of 16.8 MB: 160 tensors in 1 GB); each state saved by Checkpointer.save
                      and by torch.save, then --resume-trials cold resumes of each (into a
                      new AdamW that took no step, as in a process started again), and as
                      many bare reads of spotguard's files (8 threads, 4 MiB reads, sequential
                      readahead, no check: an estimate of the disk's read limit), the three
                      taking turns to go first; the median of each, how many times faster
                      spotguard is than torch.load, and how many times faster than torch.load
                      the bare read is (about the most any reader of these bytes could be).
                      --only-layouts runs these rows alone (a minute at 1 GB on 2 cores), e.g.
                      `--device cpu --only-layouts`.

Each row also gives the GPU memory the method added at its peak (over what the state held).
Goals (the project's GPU issue): emergency >= 0.9 of the disk limit at 8 and 24 GB; cold resume
>= 0.95 of the read limit; snapshot and background-save stalls <= 1.1x the copy limit. On CPU:
cold resume of ~1 GB >= 1.5x faster than torch.load + load_state_dict for both layouts (the rows
say whether the disk leaves that much room: on the 2-core VM it does not).
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from _common import BLOCK, table, write_file  # also puts the checkout on sys.path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=8.0, help="state size in GB (weights + AdamW moments)")
    parser.add_argument("--width", type=int, default=8192, help="layer width (a layer's weight is width x width)")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of each disk method (the fastest counts)")
    parser.add_argument("--stall-saves", type=int, default=3, help="0: no background-save rows")
    parser.add_argument("--snapshots", type=int, default=3, help="0: no snapshot rows")
    parser.add_argument("--threads", type=int, default=None, help="disk threads (default: spotguard's choice)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dir", help="where the files go (default: a temporary directory)")
    parser.add_argument("--layouts", default="huge,mid", help="cold-resume states by layout ('' for none): huge, mid")
    parser.add_argument("--layout-gb", type=float, default=1.0, help="size of each layout's state in GB")
    parser.add_argument("--resume-trials", type=int, default=3, help="cold resumes of each method per layout")
    parser.add_argument("--only-layouts", action="store_true", help="only the cold resumes by layout")
    args = parser.parse_args()
    args.layouts = [name for name in args.layouts.split(",") if name]
    unknown = set(args.layouts) - set(LAYOUTS)
    if unknown:
        parser.error(f"--layouts: unknown {sorted(unknown)} (known: {', '.join(LAYOUTS)})")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device here; nothing measured (`--device cpu` runs the same table on CPU)")
        return 0
    from spotguard.checkpoint.checkpointer import default_write_threads

    threads = args.threads or default_write_threads()
    with tempfile.TemporaryDirectory(prefix="spotguard-bench-gpu-", dir=args.dir) as tmp:
        if args.only_layouts:
            print(f"torch {torch.__version__}; {os.cpu_count()} CPU cores; files under {tmp}", flush=True)
            print_layouts(layout_resumes(args, Path(tmp), torch.device(args.device)), args)
        else:
            Bench(args, Path(tmp), threads).run()
    return 0


class LayoutResume(NamedTuple):
    """One layout's cold resumes, in seconds per trial: spotguard's, torch.load + load_state_dict's, and
    the bare read of spotguard's files (the disk's read limit)."""

    name: str
    tensors: int
    spotguard: list[float]
    torch: list[float]
    limit: list[float]


# Layer widths of the cold-resume layouts: a few huge tensors, or many mid-size ones.
LAYOUTS = {"huge": 8192, "mid": 2048}


def layout_resumes(args: argparse.Namespace, work: Path, device: torch.device) -> list[LayoutResume]:
    """Per layout: (name, tensors, spotguard's cold resumes, torch.load + load_state_dict's), in seconds."""
    results = []
    for name in args.layouts:
        results.append(layout_resume(args, name, work / f"layout-{name}", device))
        gc.collect()
    return results


def layout_resume(args: argparse.Namespace, name: str, root: Path, device: torch.device) -> LayoutResume:
    from spotguard.checkpoint import Checkpointer

    model, optim, nbytes = build(args.layout_gb, LAYOUTS[name], device)
    state = {"model": model, "optim": optim}
    with Checkpointer(str(root / "spotguard")) as ckpt:
        ckpt.save(1, state, reason="manual")
    torch_file = root / "torch.pt"
    with open(torch_file, "wb") as f:
        torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())

    # Each resume goes into a new AdamW, with no state yet, as in a process that starts again.
    def spotguard_resume() -> None:
        if Checkpointer(str(root / "spotguard")).resume({"model": model, "optim": fresh_optimizer(model)}) != 1:
            raise SystemExit(f"{name}: spotguard resumed no step")

    def torch_load() -> None:
        loaded = torch.load(torch_file, map_location="cpu", weights_only=True)
        model.load_state_dict(loaded["model"])
        fresh_optimizer(model).load_state_dict(loaded["optim"])

    files = sorted(p for p in (root / "spotguard").rglob("*") if p.is_file())

    def read_limit() -> None:  # every byte of spotguard's files, no check, no copy into the state
        read_files(files, max(8, args.threads or 0))

    times: dict[str, list[float]] = {"spotguard": [], "torch": [], "limit": []}
    order = [("spotguard", spotguard_resume), ("torch", torch_load), ("limit", read_limit)]
    for trial in range(args.resume_trials):
        for method, run in order[trial % 3 :] + order[: trial % 3]:  # each goes first in turn
            drop_page_cache([root])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[method].append(time.perf_counter() - started)
    tensors = len(model.state_dict()) + sum(len(s) for s in optim.state.values())
    print(f"  resume by layout, {name}: {nbytes / 1e9:.2f} GB, {tensors} tensors; spotguard "
          f"{', '.join(f'{t:.3f}' for t in times['spotguard'])} s; torch.load + load_state_dict "
          f"{', '.join(f'{t:.3f}' for t in times['torch'])} s; a bare read "
          f"{', '.join(f'{t:.3f}' for t in times['limit'])} s", flush=True)  # fmt: skip
    shutil.rmtree(root)
    return LayoutResume(name, tensors, times["spotguard"], times["torch"], times["limit"])


def print_layouts(results: list[LayoutResume], args: argparse.Namespace) -> None:
    if not results:
        return
    rows = []
    for r in results:
        ours, theirs, limit = (statistics.median(times) for times in (r.spotguard, r.torch, r.limit))
        per_trial = ", ".join(f"{b / a:.2f}" for a, b in zip(r.spotguard, r.torch))
        rows.append([f"{r.name} ({LAYOUTS[r.name]} wide, {r.tensors} tensors)", f"{ours:.3f}", f"{theirs:.3f}",
                     f"{limit:.3f}", f"{theirs / ours:.2f}x", f"{limit / ours:.2f}", f"{theirs / limit:.2f}x",
                     per_trial])  # fmt: skip
    print()
    print(table([f"cold resume of {args.layout_gb:g} GB, median of {args.resume_trials}", "spotguard (s)",
                 "torch.load + load_state_dict (s)", "bare read (s)", "spotguard faster by",
                 "bare read / spotguard", "bare read faster by", "per trial"],
                rows))  # fmt: skip
    print()
    print("resume by layout: " + "; ".join(
        f"{r.name} {statistics.median(r.torch) / statistics.median(r.spotguard):.2f}x"
        f" (a bare read {statistics.median(r.torch) / statistics.median(r.limit):.2f}x)" for r in results
    ) + " faster than torch.load + load_state_dict (goal >= 1.5x)")  # fmt: skip


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path, threads: int) -> None:
        self.args, self.work, self.threads = args, work, threads
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        started = time.perf_counter()
        self.model, self.optim, self.nbytes = build(args.gb, args.width, self.device)
        self.state = {"model": self.model, "optim": self.optim}
        self.tensors = [p for p in self.model.parameters()] + [
            t for s in self.optim.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0
        ]
        self.rows: list[list[str]] = []
        self.results: dict[str, float] = {}
        self.added: dict[str, float] = {}  # GPU memory each method added at its peak, GB
        name = torch.cuda.get_device_name(self.device) if self.cuda else f"{os.cpu_count()} CPU cores"
        print(
            f"state: {self.nbytes / 1e9:.2f} GB on {name} ({len(self.tensors)} tensors), built in "
            f"{time.perf_counter() - started:.1f} s; torch {torch.__version__}; disk threads {threads}; "
            f"files under {work}",
            flush=True,
        )

    # ---- helpers -----------------------------------------------------------------------------
    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def timed(self, what: str, run: Callable[[], object], repeat: int, after: Callable[[], object] = lambda: None):
        times = []
        for _ in range(repeat):
            self.sync()
            base = self.peak_from()
            started = time.perf_counter()
            run()
            self.sync()
            times.append(time.perf_counter() - started)
            self.added[what] = max(self.added.get(what, 0.0), self.peak_added(base))
            after()
        best = min(times)
        self.results[what] = best
        print(f"  {what}: {best:.3f} s (of {', '.join(f'{t:.3f}' for t in times)})", flush=True)
        return best

    def peak_from(self) -> int:
        """Start counting the GPU memory a method adds: what is allocated now."""
        if not self.cuda:
            return 0
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak_added(self, base: int) -> float:
        """GB allocated at the peak since `peak_from` over `base`."""
        return (torch.cuda.max_memory_allocated(self.device) - base) / 1e9 if self.cuda else 0.0

    def train_step(self) -> None:
        x = torch.randn(64, self.args.width, device=self.device)
        self.model(x).square().mean().backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)

    def free_host_memory(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch._C._host_emptyCache()  # pinned blocks the caching host allocator keeps

    # ---- rows --------------------------------------------------------------------------------
    def run(self) -> None:
        work = self.work
        copy = self.copy_limit()
        self.free_host_memory()  # the copy's buffers
        disk = self.timed("disk limit", lambda: write_bytes(work / "raw", self.nbytes, self.threads),
                          self.args.repeat, lambda: shutil.rmtree(work / "raw"))  # fmt: skip
        dcp_s = self.timed("dcp.save", lambda: dcp.save(self.state_dict(), checkpoint_id=work / "dcp", no_dist=True),
                           self.args.repeat, lambda: shutil.rmtree(work / "dcp"))  # fmt: skip
        stall, async_stall = self.stalls(work / "background") if self.args.stall_saves else (float("nan"),) * 2
        self.free_host_memory()
        cold_emergency, _ = self.emergency(work / "cold", save_every=None)
        shutil.rmtree(work / "cold")
        self.free_host_memory()
        emergency, _ = self.emergency(work / "spotguard", save_every=10_000)  # a background save of step 0 only
        self.free_host_memory()
        snapshot, restore = float("nan"), float("nan")
        if self.args.snapshots:
            try:
                snapshot, restore = self.snapshots(work / "snapshots")
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - the other rows still count
                print(f"  snapshots not measured: {exc}", flush=True)
        self.free_host_memory()
        # Kept for the resumes (at most two copies of the state on the disk at any time).
        torch_file = work / "torch.pt"
        torch_save = self.timed("torch.save", lambda: self.torch_save(torch_file), self.args.repeat)
        read_limit, ours, theirs = self.resumes(work / "spotguard", torch_file)
        gb = self.nbytes / 1e9
        copy_name = "device -> pinned host copy (the D2H limit)" if self.cuda else "memcpy into buffers (the limit)"
        added = self.added.get
        self.rows = [
            [copy_name, f"{copy:.3f}", f"{gb / copy:.1f}", "", ""],
            [f"disk write, {self.threads} threads + fsync (the disk limit)", f"{disk:.2f}", f"{gb / disk:.2f}", "1.00",
             ""],
            ["torch.save + fsync", f"{torch_save:.2f}", f"{gb / torch_save:.2f}", f"{disk / torch_save:.2f}",
             _gb(added("torch.save"))],
            ["dcp.save, defaults", f"{dcp_s:.2f}", f"{gb / dcp_s:.2f}", f"{disk / dcp_s:.2f}", _gb(added("dcp.save"))],
            ["spotguard emergency save, no save before (notice -> committed)", f"{cold_emergency:.2f}",
             f"{gb / cold_emergency:.2f}", f"{disk / cold_emergency:.2f}", _gb(added("emergency, no save before"))],
            ["spotguard emergency save after a background save (notice -> committed)", f"{emergency:.2f}",
             f"{gb / emergency:.2f}", f"{disk / emergency:.2f}", _gb(added("emergency, after a background save"))],
            ["background save: spotguard stall", f"{stall:.3f}", "", f"{stall / copy:.2f}x copy",
             _gb(added("background stall"))],
            ["background save: dcp.async_save call", f"{async_stall:.3f}", "", f"{async_stall / copy:.2f}x copy",
             _gb(added("dcp.async_save"))],
            ["snapshot: spotguard stall", f"{snapshot:.3f}", "", f"{snapshot / copy:.2f}x copy",
             _gb(added("snapshot stall"))],
            ["snapshot: resume from the node's memory", f"{restore:.2f}", f"{gb / restore:.2f}", "",
             _gb(added("snapshot resume"))],
            [f"disk read, {self.threads} threads, cold (the read limit)", f"{read_limit:.2f}",
             f"{gb / read_limit:.2f}", "1.00", ""],
            ["resume, cold: torch.load + load_state_dict", f"{theirs:.2f}", f"{gb / theirs:.2f}",
             f"{read_limit / theirs:.2f}", _gb(added("torch.load + load_state_dict"))],
            ["resume, cold: spotguard", f"{ours:.2f}", f"{gb / ours:.2f}", f"{read_limit / ours:.2f}",
             _gb(added("spotguard resume"))],
        ]  # fmt: skip
        print()
        print(table(["what", "seconds", "GB/s", "vs the limit", "GPU memory added (GB)"], self.rows))
        print()
        print(f"emergency save: {disk / cold_emergency:.2f} of the disk limit with no save before, "
              f"{disk / emergency:.2f} after a background save (goal >= 0.9); "
              f"{30 - cold_emergency:.1f} s left of GCP's 30 s")  # fmt: skip
        print(f"stalls: background save {stall / copy:.2f}x the copy limit, snapshot {snapshot / copy:.2f}x "
              f"(goal <= 1.1x); dcp.async_save {async_stall / stall:.1f}x spotguard's")  # fmt: skip
        print(f"resume: {read_limit / ours:.2f} of the read limit (goal >= 0.95), {theirs / ours:.2f}x faster than "
              f"torch.load")  # fmt: skip
        if self.args.layouts:
            shutil.rmtree(work / "spotguard")
            torch_file.unlink()
            self.free_host_memory()
            print(flush=True)
            print_layouts(layout_resumes(self.args, work, self.device), self.args)

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}

    def copy_limit(self) -> float:
        buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=self.cuda) for t in self.tensors]

        def copy() -> None:
            for buffer, tensor in zip(buffers, self.tensors):
                buffer.copy_(tensor, non_blocking=self.cuda)

        copy()  # first touch of the buffers
        return self.timed("copy limit", copy, 5)

    def torch_save(self, path: Path) -> None:
        with open(path, "wb") as f:
            torch.save(self.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())

    def emergency(self, path: Path, save_every: int | None) -> tuple[float, float]:
        """(notice raised -> committed, the guard.step() that saved); with `save_every`, the
        notice comes once the Guard's first background save is done."""
        import spotguard
        from cloud_adapters.gcp.emulator import GCPMetadataEmulator

        with GCPMetadataEmulator() as emulator:
            guard = spotguard.Guard(
                str(path), cloud="gcp", metadata_url=emulator.url, exit_code=None, save_every=save_every
            )
            with guard:
                raised: list[float] = []
                began = time.perf_counter()
                for step in range(100_000):
                    self.train_step()
                    self.sync()
                    if not raised and step >= 3 and time.perf_counter() - began >= 1.0:  # the watcher is up
                        while save_every is not None and guard.last_save is None:
                            time.sleep(0.05)  # until the background save of step 0 is done
                        raised.append(time.perf_counter())
                        emulator.raise_notice()
                    called = time.perf_counter()
                    base = self.peak_from()  # the save's own memory, not the training step's
                    if guard.step(step, self.state):
                        break
                done = time.perf_counter()
                saved = guard.last_save
        what = "emergency, after a background save" if save_every else "emergency, no save before"
        self.added[what] = self.peak_added(base)
        if saved is None or not saved.durable:
            raise SystemExit(f"the emergency save failed: {saved.error if saved else 'no save'}")
        save_s, committed = done - called, done - raised[0]
        print(f"  spotguard emergency ({'after a background save' if save_every else 'no save before'}): "
              f"notice -> committed {committed:.2f} s, guard.step {save_s:.2f} s (write {saved.write_s:.2f}, "
              f"commit {saved.commit_s:.2f})", flush=True)  # fmt: skip
        for old in sorted(path.glob("step-*"))[:-1]:  # only the emergency step stays on the disk
            shutil.rmtree(old)
        return committed, save_s

    def stalls(self, root: Path) -> tuple[float, float]:
        """(spotguard's median stall, dcp.async_save's median call)."""
        from spotguard.checkpoint import Checkpointer

        ours = []
        with Checkpointer(str(root / "spotguard"), keep_last=1) as ckpt:
            for i in range(self.args.stall_saves + 1):
                for _ in range(3):
                    self.train_step()
                self.sync()
                base = self.peak_from()
                started = time.perf_counter()
                ckpt.save(i + 1, self.state, reason="periodic", wait=False)
                ours.append(time.perf_counter() - started)
                self.added["background stall"] = self.peak_added(base)
                self.train_step()  # the next step runs beside the save's writes
                ckpt.wait()
        theirs = []
        for i in range(self.args.stall_saves):
            self.train_step()
            self.sync()
            base = self.peak_from()
            started = time.perf_counter()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore")
                future = dcp.async_save(self.state_dict(), checkpoint_id=root / f"dcp{i}", no_dist=True)
            theirs.append(time.perf_counter() - started)
            self.added["dcp.async_save"] = self.peak_added(base)
            self.train_step()
            future.result()
            shutil.rmtree(root / f"dcp{i}")
        shutil.rmtree(root)
        print(f"  background stall: spotguard {', '.join(f'{t:.3f}' for t in ours)} (the first allocates); "
              f"dcp.async_save {', '.join(f'{t:.3f}' for t in theirs)}", flush=True)  # fmt: skip
        return statistics.median(ours[1:]), statistics.median(theirs)

    def snapshots(self, root: Path) -> tuple[float, float]:
        """(the median stall of a snapshot after the first, a new Guard's resume from the snapshot)"""
        import spotguard

        every = 5
        shm = Path(tempfile.mkdtemp(prefix="spotguard-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        os.environ["SPOTGUARD_SNAPSHOT_DIR"] = str(shm)
        stalls = []
        try:
            with spotguard.Guard(str(root), cloud="none", exit_code=None, snapshot_every=every) as guard:
                for step in range(every * self.args.snapshots + every + 1):
                    self.train_step()
                    self.sync()
                    base = self.peak_from()
                    guard.step(step, self.state)
                    if guard.snapshots is None:
                        raise SystemExit("the snapshot tier is off (no room in /dev/shm?)")
                    if step % every == 0:
                        guard.snapshots.wait(600)  # its file written: the next stall is the copy alone
                        done = guard.snapshots.last
                        if done is None or not done.ok:
                            raise SystemExit(f"the snapshot of step {step} failed: {done}")
                        stalls.append(done.stall_s)
                        if len(stalls) > 1:
                            self.added["snapshot stall"] = max(self.added.get("snapshot stall", 0.0),
                                                               self.peak_added(base))  # fmt: skip
            print(f"  snapshot stalls: {', '.join(f'{t:.3f}' for t in stalls)} (the first allocates)", flush=True)
            self.free_host_memory()
            guard = spotguard.Guard(str(root), cloud="none", exit_code=None, snapshot_every=every)
            with guard:
                restore = self.timed("snapshot resume", lambda: guard.resume(self.state), 1)
                resumed = [e for e in guard.timeline.entries if e.event == "resumed"]
                if not resumed or resumed[-1].detail.get("tier") != "snapshot":
                    raise SystemExit(f"the resume did not come from the snapshot: {guard.timeline.format()}")
        finally:
            os.environ.pop("SPOTGUARD_SNAPSHOT_DIR")
            shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(root, ignore_errors=True)
        return statistics.median(stalls[1:]), restore

    def resumes(self, spotguard_dir: Path, torch_file: Path) -> tuple[float, float, float]:
        from spotguard.checkpoint import Checkpointer

        def cold() -> str:
            return drop_page_cache([spotguard_dir, torch_file])

        how = cold()
        read_limit = self.timed("read limit", lambda: read_bytes(torch_file, self.threads), 1)
        cold()
        ours = self.timed("spotguard resume", lambda: Checkpointer(str(spotguard_dir)).resume(self.state), 1)
        cold()

        def torch_load() -> None:
            loaded = torch.load(torch_file, map_location="cpu", weights_only=True)
            self.model.load_state_dict(loaded["model"])
            self.optim.load_state_dict(loaded["optim"])

        theirs = self.timed("torch.load + load_state_dict", torch_load, 1)
        print(f"  page cache dropped with {how}", flush=True)
        return read_limit, ours, theirs


def _gb(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def build(gb: float, width: int, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    layers = max(1, round(gb * 1e9 / (3 * 4 * (width * width + width))))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers))).to(device)
    optim = fresh_optimizer(model)
    model(torch.randn(2, width, device=device)).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim, sum(p.numel() * p.element_size() for p in model.parameters()) * 3


def fresh_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer `build` makes, before its first step: no state."""
    return torch.optim.AdamW(model.parameters(), lr=1e-6)


def write_bytes(path: Path, nbytes: int, threads: int) -> None:
    """`nbytes` of incompressible data in `threads` files written in parallel, each fsynced."""
    path.mkdir()
    block = os.urandom(BLOCK)
    share = -(-nbytes // threads)
    run_threads(lambda i: write_file(path / f"part{i}", max(0, min(share, nbytes - i * share)), block), threads)


def read_bytes(path: Path, threads: int) -> None:
    """Read a file by `threads` threads, each a contiguous range, in 16 MiB reads."""
    size = path.stat().st_size
    share = -(-size // threads)

    def one(i: int) -> None:
        buffer = bytearray(BLOCK)
        fd = os.open(path, os.O_RDONLY)
        try:
            offset, end = i * share, min(size, (i + 1) * share)
            while offset < end and (got := os.preadv(fd, [memoryview(buffer)[: min(BLOCK, end - offset)]], offset)):
                offset += got
        finally:
            os.close(fd)

    run_threads(one, threads)


LIMIT_READ = 4 << 20  # 8 threads reading 4 MiB each: the fastest bare read of a few tried on the 2-core VM


def read_files(files: list[Path], threads: int) -> None:
    """Read `files` whole, `threads` threads taking LIMIT_READ-byte reads from one queue in file order."""
    sizes = {path: path.stat().st_size for path in files}
    reads = collections.deque((path, at) for path in files for at in range(0, sizes[path], LIMIT_READ))
    fds = {path: os.open(path, os.O_RDONLY) for path in files}
    for fd in fds.values():
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # the kernel's larger readahead, as spotguard asks

    def one(_: int) -> None:
        buffer = memoryview(bytearray(LIMIT_READ))
        while True:
            try:
                path, at = reads.popleft()
            except IndexError:
                return
            os.preadv(fds[path], [buffer[: min(LIMIT_READ, sizes[path] - at)]], at)

    try:
        run_threads(one, threads)
    finally:
        for fd in fds.values():
            os.close(fd)


def run_threads(work: Callable[[int], None], count: int) -> None:
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:
            errors.append(exc)

    pool = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]


def drop_page_cache(paths: list[Path]) -> str:
    """Make the next reads of `paths` come from the disk; returns how."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return "/proc/sys/vm/drop_caches"
    except OSError:
        pass
    for root in paths:
        for file in [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]:
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "posix_fadvise(DONTNEED) per file"


if __name__ == "__main__":
    sys.exit(main())
