"""save_interval_s="auto" against fixed intervals, on replayed interruption traces, with save costs measured here.

    python bench/cadence_sim.py [--mb 256] [--interruptions 400] [--seed 0]

1. Save costs, measured in this run: a state of --mb MB of float32 tensors saved by the Checkpointer
   to a temporary directory, the SaveReport's `stall_s` (the median of 5 after one that allocates):
     background   save(wait=False), what the interval saves do: the training thread copies into
                  reused buffers and goes on;
     blocking     save(wait=True): the training thread waits for write and commit.
2. Traces (hours of running, each with --interruptions interruptions, fixed seed): Poisson at 0.05, 0.2,
   1 and 4 per hour, and a bursty one (20 h calm at 0.05/h, then 1 h storm at 4/h, repeated).
3. Policies, each replayed over every trace: a save every T seconds for T on a grid of 64 intervals from
   1 s to 6 h, and "auto": spotguard.goodput.cadence.Cadence itself, with bounds set to the grid's ends. As in
   the Guard, each run segment (between interruptions) starts a fresh Cadence: told the interruptions
   and hours of the segments before (what the ledger holds), no prior, the lower bound until its first
   save is measured, asked for the next interval after every save.
   An interruption is taken at its worst, as one whose emergency save does not commit: it loses the
   work since the last save began. Each save costs its stall. Cost = lost + stall, in hours.
Printed per trace: the best fixed interval in hindsight, its cost, auto's cost and their ratio
(goal: <= 1.10 on every trace), and the cost of fixed 60 s / 10 min / 1 h saves against the best.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import numpy as np
import torch
from _common import table  # also puts the checkout on sys.path

from spotguard.checkpoint import Checkpointer  # noqa: E402
from spotguard.goodput.cadence import Cadence  # noqa: E402

GRID = np.geomspace(1.0, 6 * 3600.0, 64)
RATES = (0.05, 0.2, 1.0, 4.0)
GOAL = 1.10


def measure_costs(mb: int) -> dict[str, float]:
    """Median stall of a background and of a blocking save of `mb` MB, as SaveReport.stall_s says."""
    torch.manual_seed(0)
    state = {f"layer{i}": torch.randn(4 << 20) for i in range(max(1, mb // 16))}  # 16 MiB tensors
    costs = {}
    with tempfile.TemporaryDirectory(prefix="spotguard-bench-cadence-") as tmp, Checkpointer(tmp, keep_last=1) as ckpt:
        steps = iter(range(1, 1000))
        for name, wait in (("background", False), ("blocking", True)):
            stalls = []
            for _ in range(6):
                ckpt.save(next(steps), state, reason="periodic", wait=wait)
                stalls.append(ckpt.wait().stall_s if not wait else ckpt.last_report.stall_s)
            costs[name] = statistics.median(stalls[1:])  # the first allocates the staging buffers
    return costs


def poisson_gaps(rate_per_h: float, count: int, rng: np.random.Generator) -> np.ndarray:
    return rng.exponential(3600.0 / rate_per_h, count)


def bursty_gaps(count: int, rng: np.random.Generator) -> np.ndarray:
    """Interruption times from alternating regimes (20 h at 0.05/h, 1 h at 4/h), as gaps."""
    times, t = [], 0.0
    while len(times) < count:
        for hours, rate in ((20.0, 0.05), (1.0, 4.0)):
            end = t + hours * 3600
            while (t := t + rng.exponential(3600.0 / rate)) < end:
                times.append(t)
            t = end
    return np.diff(np.array([0.0] + times[:count]))


def fixed_costs(gaps: np.ndarray, cost_s: float, intervals: np.ndarray = GRID) -> np.ndarray:
    """Lost + stall seconds of a save every T for each T of `intervals` (every gap ends in an interruption)."""
    saves = np.floor(gaps[None, :] / intervals[:, None])
    lost = gaps[None, :] - saves * intervals[:, None]
    return (saves * cost_s + lost).sum(axis=1)


def auto_cost(gaps: np.ndarray, cost_s: float) -> float:
    """Lost + stall seconds of the Cadence, replayed segment by segment."""
    total, hours = 0.0, 0.0
    for k, gap in enumerate(gaps):
        cadence = Cadence(min_s=GRID[0], max_s=GRID[-1])
        cadence.observe_history(k, hours)
        t = 0.0
        while (nxt := t + cadence.interval(t / 3600)) < gap:
            t = nxt
            total += cost_s
            cadence.observe_save(cost_s)
        total += gap - t
        hours += gap / 3600
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256, help="state size for the measured saves")
    parser.add_argument("--interruptions", type=int, default=400, help="interruptions per trace")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    costs = measure_costs(args.mb)
    rng = np.random.default_rng(args.seed)
    traces = [(f"Poisson {r:g}/h", poisson_gaps(r, args.interruptions, rng)) for r in RATES]
    traces.append(("bursty (20 h at 0.05/h, 1 h at 4/h)", bursty_gaps(args.interruptions, rng)))
    print(f"measured save stalls of a {args.mb} MB state (median of 5): "
          + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in costs.items()))  # fmt: skip
    rows, worst = [], 0.0
    for cost_name, cost_s in costs.items():
        for name, gaps in traces:
            fixed = fixed_costs(gaps, cost_s)
            best = int(np.argmin(fixed))
            auto = auto_cost(gaps, cost_s)
            worst = max(worst, auto / fixed[best])
            ref = fixed_costs(gaps, cost_s, np.array([60.0, 600.0, 3600.0])) / fixed[best]
            rows.append([
                f"{cost_name} {cost_s * 1000:.0f} ms", name, f"{gaps.sum() / 3600:.0f}", f"{GRID[best]:.0f}",
                f"{fixed[best] / 3600:.3f}", f"{auto / 3600:.3f}", f"{auto / fixed[best]:.3f}",
                *(f"{r:.2f}" for r in ref),
            ])  # fmt: skip
    print(table(["save cost", "trace", "hours", "best fixed T (s)", "best: lost+stall (h)", "auto: lost+stall (h)",
                 "auto / best", "60 s / best", "10 min / best", "1 h / best"], rows))  # fmt: skip
    print(f"goal: auto within {GOAL:.2f}x of the best fixed interval on every trace: "
          f"{'met' if worst <= GOAL else 'NOT met'} (worst {worst:.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
