"""Steps completed in a fixed wall-clock window when one node of two is reclaimed: elastic continue
against stop-and-wait-for-a-replacement.

Two torchrun agents on this host stand for two nodes (tests/nodes.py: each with its own AWS
metadata emulator and staging dir) training examples/train_ddp.py (DDP, --dataset with the
resumable sampler). Node 1 is reclaimed `--reclaim-at` seconds after the first step; its
replacement is ready `--replacement-after` seconds later. Both runs end `--window` seconds after
the first step; counted: steps trained and committed-or-kept (a step is counted once, by the
last world that trained it; with no step lost, the highest step trained + 1).

- elastic: `--nnodes 1:2 --rdzv-backend c10d --max-restarts 3`: node 0 goes on alone, the
  replacement's agent joins the running job.
- stop-and-wait (baseline): static `--nnodes 2`: both nodes stop after the emergency checkpoint;
  when the replacement is ready, both start again and resume.

    python bench/elastic.py [--window 150] [--reclaim-at 20] [--replacement-after 60]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from _common import table  # also puts the checkout on sys.path

from tests.nodes import Node, rendezvous, start_nodes, stop_all  # noqa: E402

TRAIN = ["--steps", "100000", "--step-time", "0.05", "--dataset", "4096", "--batch-size", "8", "--log-samples"]


def steps_done(nodes: list[Node], until: float) -> int:
    """The highest step any rank printed before `until` (monotonic), + 1."""
    printed = [
        json.loads(line)["step"]
        for node in nodes
        for line, t in zip(list(node.lines), list(node.arrived))
        if t <= until and line.startswith('{"step"')
    ]
    return 1 + max(printed, default=-1)


def first_step(node: Node) -> float:
    line = node.wait_for(r'^\{"step": 0, "rank": 0', timeout=300)
    return node.arrived[node.lines.index(line)]


def sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


def elastic(tmp: Path, args: argparse.Namespace) -> int:
    rdzv = rendezvous("1:2", max_restarts=3)
    ckpt = str(tmp / "ckpt")
    nodes = [rdzv.join(i, ckpt, tmp, TRAIN) for i in range(2)]
    try:
        t0 = first_step(nodes[0])
        sleep_until(t0 + args.reclaim_at)
        nodes[1].emulator.raise_notice()
        nodes[1].finish(60)
        nodes[1].kill()
        sleep_until(t0 + args.reclaim_at + args.replacement_after)
        nodes.append(rdzv.join(2, ckpt, tmp, TRAIN))
        sleep_until(t0 + args.window)
        return steps_done(nodes, t0 + args.window)
    finally:
        stop_all(nodes)


def stop_and_wait(tmp: Path, args: argparse.Namespace) -> int:
    ckpt = str(tmp / "ckpt")
    for part in ("a", "b"):  # each start's VMs: fresh staging dirs
        (tmp / part).mkdir()
    nodes = start_nodes(2, ckpt, tmp / "a", TRAIN)
    later: list[Node] = []
    try:
        t0 = first_step(nodes[0])
        sleep_until(t0 + args.reclaim_at)
        nodes[1].emulator.raise_notice()
        for node in nodes:
            node.finish(60)
        sleep_until(t0 + args.reclaim_at + args.replacement_after)
        later = start_nodes(2, ckpt, tmp / "b", TRAIN)
        sleep_until(t0 + args.window)
        return steps_done(nodes + later, t0 + args.window)
    finally:
        stop_all(nodes + later)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=float, default=150.0)
    parser.add_argument("--reclaim-at", type=float, default=20.0)
    parser.add_argument("--replacement-after", type=float, default=60.0)
    args = parser.parse_args()
    results = {}
    for name, run in (("stop-and-wait for a replacement (baseline)", stop_and_wait), ("elastic continue", elastic)):
        with tempfile.TemporaryDirectory(prefix="spotguard-bench-elastic-") as tmp:
            results[name] = run(Path(tmp), args)
    base = results["stop-and-wait for a replacement (baseline)"]
    rows = [[name, str(steps), f"{steps / base:.2f}"] for name, steps in results.items()]
    print(
        f"window {args.window:.0f} s from the first step; node 1 of 2 reclaimed at {args.reclaim_at:.0f} s; "
        f"replacement ready {args.replacement_after:.0f} s later"
    )
    print(table(["run", "steps completed in the window", "vs baseline"], rows))


if __name__ == "__main__":
    main()
