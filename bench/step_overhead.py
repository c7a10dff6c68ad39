"""What `guard.step()` costs a training loop when nothing is happening (invariant 4).

    python bench/step_overhead.py [--calls 1000000] [--blocks 30] [--block-steps 100] [--only single|distributed]

1. Single process (no process group, cloud="none"): ns per `guard.step(i, state)` over
   --calls calls, against the same loop calling an empty method with the same
   arguments; rounds alternate, the fastest round of each counts. Goal: < 1 µs.
2. Two ranks (gloo, subprocesses, DDP on CPU, one compute thread each): a training step
   of about 10 ms, run in blocks of --block-steps steps with the guard (entered per
   block: cloud="aws" against a local IMDSv2 emulator polled every second, so the
   watcher and listener threads really run) and without it (no Guard at all), the two
   kinds alternating ABBA to cancel drift. The overhead is the mean of the paired block
   differences, in µs per step and % of the step, with a 95 % interval. Goal: < 0.5 %.
   Beside wall clock: each rank's CPU time per step (all its threads), and spotguard's
   own work per step -- the time inside guard.step() plus the CPU time of its threads --
   which stays readable when other load makes the wall clock noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import Ranks, init_worker, report, table

POLL_INTERVAL_S = 1.0  # the production default


# ---- 1. single process -------------------------------------------------------------
class _Empty:
    def step(self, step: int, state: object) -> bool:
        return False


def _ns_per_call(target: object, state: dict, calls: int) -> float:
    started = time.perf_counter_ns()
    for step in range(calls):  # the same loop for both: attribute lookup and call included
        target.step(step, state)
    return (time.perf_counter_ns() - started) / calls


def single_process(calls: int, rounds: int) -> None:
    import torch

    import spotguard

    state = {"weights": torch.zeros(16)}
    times: dict[str, list[float]] = {"empty method": [], "guard.step": []}
    with tempfile.TemporaryDirectory(prefix="spotguard-bench-") as tmp, spotguard.Guard(tmp, cloud="none") as guard:
        for _ in range(rounds):
            times["empty method"].append(_ns_per_call(_Empty(), state, calls))
            times["guard.step"].append(_ns_per_call(guard, state, calls))
    base, ours = min(times["empty method"]), min(times["guard.step"])
    print(f"\n1. single process, {calls:,} calls x {rounds} rounds (fastest round; median in brackets)")
    print(table(["loop body", "ns per call"], [
        ["empty method, same arguments", f"{base:.0f} ({statistics.median(times['empty method']):.0f})"],
        ["guard.step(step, state)", f"{ours:.0f} ({statistics.median(times['guard.step']):.0f})"],
        ["difference (guard.step's own cost)", f"{ours - base:.0f}"],
    ]))  # fmt: skip
    print(
        f"goal < 1000 ns per call: guard.step {ours:.0f} ns ({'met' if ours < 1000 else 'MISSED'}), "
        f"its own cost {ours - base:.0f} ns ({'met' if ours - base < 1000 else 'MISSED'})"
    )


# ---- 2. two ranks ----------------------------------------------------------------------
def distributed(args: argparse.Namespace) -> None:
    from cloud_adapters.aws.emulator import AWSMetadataEmulator

    with tempfile.TemporaryDirectory(prefix="spotguard-bench-") as tmp, AWSMetadataEmulator() as emulator:
        worker_args = ["--metadata-url", emulator.url, "--checkpoint-dir", str(Path(tmp) / "ckpt"),
                       "--blocks", str(args.blocks), "--block-steps", str(args.block_steps),
                       "--width", str(args.width), "--batch", str(args.batch)]  # fmt: skip
        with Ranks(__file__, 2, worker_args, Path(tmp)) as ranks:
            ranks_blocks = next(m for m in ranks.messages() if "ranks" in m)["ranks"]
            ranks.wait(timeout_s=60)
        polls = emulator.requests_seen
    wall = _Paired(ranks_blocks[0], "wall_s")
    rows = [["wall clock, rank 0", *wall.cells()]]
    rows += [
        [f"CPU time, rank {r}" + (" (polls IMDS)" if r == 0 else ""), *_Paired(blocks, "cpu_s").cells()]
        for r, blocks in enumerate(ranks_blocks)
    ]
    print(
        f"\n2. two ranks (gloo, DDP, CPU, 1 compute thread each): {args.blocks} ABBA block pairs x "
        f"{args.block_steps} steps, MLP width {args.width}, batch {args.batch}; the guard served "
        f"{polls} IMDS requests (1 s polling) while entered"
    )
    print(
        table(
            [
                "per training step",
                "without Guard (µs)",
                "with Guard (µs)",
                "overhead (µs, ± 2 s.e.)",
                "overhead (%)",
                "fastest quarter: diff (µs)",
            ],
            rows,
        )
    )
    own = [statistics.mean(b["threads_cpu_s"] * 1e6 for b in blocks if b["guarded"]) for blocks in ranks_blocks]
    in_step = [statistics.mean(b["in_step_median_s"] * 1e6 for b in blocks if b["guarded"]) for blocks in ranks_blocks]
    in_step_mean = [statistics.mean(b["in_step_s"] * 1e6 for b in blocks if b["guarded"]) for blocks in ranks_blocks]
    print(
        "spotguard's own work per step: a guard.step() call takes (median) "
        + ", ".join(f"rank {r} {us:.2f} µs" for r, us in enumerate(in_step))
        + " (mean "
        + ", ".join(f"{us:.1f}" for us in in_step_mean)
        + " µs: the mean also holds the OS preemptions and GIL hand-overs that land in the call);"
        + " CPU of its threads (watcher, listener) "
        + ", ".join(f"rank {r} {us:.1f} µs" for r, us in enumerate(own))
    )
    accounted = max(100 * (i + o) / wall.plain for i, o in zip(in_step_mean, own))
    print(
        f"accounted cost (mean time in guard.step() + its threads' CPU, worst rank): {accounted:.2f} % of a step "
        f"(goal < 0.5 %: {'met' if accounted < 0.5 else 'MISSED'}); the wall clock, below, is the direct test"
    )
    print("paired wall-clock differences, µs per step, in block order:", " ".join(f"{d:+.0f}" for d in wall.diffs))
    verdict = "met" if wall.high_pct < 0.5 else "MISSED" if wall.low_pct >= 0.5 else "not resolved at this noise"
    print(
        f"goal < 0.5 % of a ~10 ms step (wall clock): {wall.pct:.2f} % "
        f"(95 % interval {wall.low_pct:.2f} .. {wall.high_pct:.2f} %): {verdict}"
    )


class _Paired:
    """Paired differences of per-step times, block by block (guarded minus plain)."""

    def __init__(self, blocks: list[dict], key: str) -> None:
        plain = [b[key] * 1e6 for b in blocks if not b["guarded"]]
        guarded = [b[key] * 1e6 for b in blocks if b["guarded"]]
        self.plain, self.guarded = statistics.mean(plain), statistics.mean(guarded)
        self.diffs = [g - p for p, g in zip(plain, guarded)]
        self.mean = statistics.mean(self.diffs)
        self.half_width = 2 * statistics.stdev(self.diffs) / len(self.diffs) ** 0.5
        self.pct = 100 * self.mean / self.plain
        self.low_pct = 100 * (self.mean - self.half_width) / self.plain
        self.high_pct = 100 * (self.mean + self.half_width) / self.plain
        # Interference from other processes only ever adds time: the fastest quarter of each
        # kind's blocks is the least disturbed estimate (every block holds ~1 metadata poll).
        self.fast_diff = _fastest_quarter(guarded) - _fastest_quarter(plain)

    def cells(self) -> list[str]:
        return [
            f"{self.plain:.0f}", f"{self.guarded:.0f}", f"{self.mean:+.1f} ± {self.half_width:.1f}",
            f"{self.pct:+.2f} ± {100 * self.half_width / self.plain:.2f}",
            f"{self.fast_diff:+.1f} ({100 * self.fast_diff / self.plain:+.2f} %)",
        ]  # fmt: skip


def _fastest_quarter(values: list[float]) -> float:
    ordered = sorted(values)
    return statistics.mean(ordered[: max(1, len(ordered) // 4)])


def _guard_threads_cpu_s() -> float:
    """CPU seconds used so far by this process's spotguard threads (watcher, listener)."""
    return sum(
        time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        for t in threading.enumerate()
        if t.name.startswith("spotguard") and t.ident is not None
    )


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import spotguard

    rank, _ = init_worker()
    torch.manual_seed(0)
    w = args.width
    model = DDP(torch.nn.Sequential(torch.nn.Linear(w, 4 * w), torch.nn.ReLU(), torch.nn.Linear(4 * w, w)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = {"model": model, "optim": optimizer}
    x = torch.randn(args.batch, w, generator=torch.Generator().manual_seed(rank))
    y = torch.randn(args.batch, w, generator=torch.Generator().manual_seed(100 + rank))

    def train_step() -> None:
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def plain(first: int, steps: int) -> None:
        for _ in range(first, first + steps):
            train_step()

    inside_step: list[float] = []  # seconds inside each guard.step() call (perf_counter around it)

    def guarded(first: int, steps: int, guard: spotguard.Guard) -> None:
        for step in range(first, first + steps):
            train_step()
            called = time.perf_counter()
            if guard.step(step, state):
                raise RuntimeError("a notice arrived during the benchmark")
            inside_step.append(time.perf_counter() - called)

    def block(with_guard: bool) -> dict[str, float]:
        warmup = 10  # untimed: the guard's first metadata poll happens at entry, not every step
        ctx = (spotguard.Guard(args.checkpoint_dir, cloud="aws", metadata_url=args.metadata_url,
                               poll_interval_s=POLL_INTERVAL_S, exit_code=None)
               if with_guard else contextlib.nullcontext())  # fmt: skip
        with ctx as guard:
            loop = (lambda first, n: guarded(first, n, guard)) if with_guard else plain
            loop(0, warmup)
            dist.barrier()
            inside_step.clear()
            wall, cpu, own = time.perf_counter(), time.process_time(), _guard_threads_cpu_s()
            loop(warmup, args.block_steps)
            wall, cpu, own = time.perf_counter() - wall, time.process_time() - cpu, _guard_threads_cpu_s() - own
        n = args.block_steps
        return {
            "guarded": with_guard, "wall_s": wall / n, "cpu_s": cpu / n, "threads_cpu_s": own / n,
            "in_step_s": statistics.mean(inside_step) if inside_step else 0.0,
            "in_step_median_s": statistics.median(inside_step) if inside_step else 0.0,
        }  # fmt: skip

    plain(0, 30)  # warm up allocator and gloo buffers
    blocks = [
        block(with_guard) for b in range(args.blocks) for with_guard in ((False, True) if b % 2 == 0 else (True, False))
    ]  # ABBA against drift
    every_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, blocks)
    if rank == 0:
        report(ranks=every_rank)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1_000_000, help="calls per round, single process (1e6)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per loop body, single process (5)")
    parser.add_argument("--blocks", type=int, default=30, help="block pairs, two ranks (30)")
    parser.add_argument("--block-steps", type=int, default=100, help="timed steps per block (100)")
    parser.add_argument("--width", type=int, default=192, help="MLP width: sets the step time (192)")
    parser.add_argument("--batch", type=int, default=64, help="batch per rank (64)")
    parser.add_argument("--only", choices=["single", "distributed"], help="run one part")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--metadata-url", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if min(args.calls, args.rounds, args.blocks, args.block_steps, args.width, args.batch) < 1:
        parser.error("--calls, --rounds, --blocks, --block-steps, --width and --batch must be positive")
    if args.blocks < 2:
        parser.error("--blocks must be at least 2 (the spread of the differences needs two pairs)")
    if args.only != "distributed":
        single_process(args.calls, args.rounds)
    if args.only != "single":
        try:
            distributed(args)
        except RuntimeError as exc:  # a rank failed: its log tail is in the message
            sys.exit(f"benchmark failed: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
