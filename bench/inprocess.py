"""The survivors' pause when one node of three announces its departure: in-process recovery against
today's restart path (torchrun restarting the survivors), in the same run.

    python bench/inprocess.py [--runs 3] [--size-gb 1.0] [--notice-at 5] [--logs DIR] [--quick]

Three torchrun agents on this host stand for three nodes (tests/nodes.py: one rank each, its own AWS
metadata emulator, its snapshot dir in /dev/shm: the node's memory; checkpoints on the local disk)
train examples/train_ddp.py (a 64 -> H -> 64 -> 1 MLP, DDP) at `--hidden H`, chosen so that params +
AdamW's two moments are --size-gb GB per rank (every rank holds all of it; H = 645,994 for 1 GB).
SPOTGUARD_SNAPSHOT_EVERY=1000 in both ways: step 0's snapshot is the one taken before the notice (an
emergency's snapshot is taken only by a tier that has taken one). Once rank 0 printed step
--notice-at, the node of rank 2 is reclaimed through its emulator; the ranks agree on a step S and
commit its emergency checkpoint, and the survivors go on from S + 1 at world 2:

- in-process: `--in-process` (spotguard.run), static rendezvous: the survivors also take the
  emergency's snapshot of S, keep their processes, form generation 1's group, build the model again
  and load S from the snapshot in the nodes' memory.
- restart path (baseline): elastic torchrun, `--nnodes 2:3 --max-restarts 3` (c10d,
  localnodes.Rendezvous): the survivors exit 143 (no emergency snapshot: a cloud takes a node), their
  agents meet again and restart them at world 2, and the new workers load S from the durable checkpoint.

The pause: rank 0's line of step S at world 3 -> its line of step S + 1 at world 2, as this process
read them (so it includes the emergency save and one step at world 2; the median step at world 2 is
shown beside it), and its parts, cut at log lines (MARKS); beside it the in-process runner's own
figures (its log line: paused, group formed). Then the weights: the in-process run's final digest
(rank 0's --out) against two fresh nodes restarted from a copy of the same emergency checkpoint.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from _common import table  # also puts the checkout on sys.path

from spotguard.checkpoint import list_checkpoints  # noqa: E402
from tests.nodes import Node, rendezvous, run_nodes, start_nodes, stop_all  # noqa: E402

SNAPSHOTS = {"SPOTGUARD_SNAPSHOT_EVERY": "1000"}  # step 0's snapshot, then only the emergency's
RECOVERED = re.compile(
    r"in-process recovery: generation 1, world 3 -> 2 .* at step (\d+): this process \(pid \d+\) paused ([\d.]+) s "
    r"\(group formed after ([\d.]+) s\), state from (.*)"
)
# The pause's parts end at: the emergency checkpoint durable, the next guard watching (in-process: its group
# formed; restart: the new worker started), the agreed step loaded, then the first step at world 2.
MARKS = [r"timeline: .* durable +step=", r"spotguard.watcher: watching", r"timeline: .* resumed +step="]
PARTS = ["emergency save", "-> next guard", "model + load", "first step"]


def hidden_for(gb: float) -> int:
    """The example's --hidden whose params (129 h + 129 floats) with AdamW's two moments make `gb` GB."""
    return max(1, round(gb * 1e9 / (3 * 4 * 129)) - 1)


def records(nodes: list[Node]) -> list[tuple[dict, float]]:
    """Every rank's step line (--log-samples) and when this process read it."""
    return [
        (json.loads(line), t)
        for node in nodes
        for line, t in zip(list(node.lines), list(node.arrived))
        if line.startswith('{"step"')
    ]


def wait_step(nodes: list[Node], step: int, world: int, timeout: float = 600) -> Node:
    """Wait for rank 0's line of `step` at `world`; the node that printed it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for node in nodes:
            if any(r["step"] == step and r["rank"] == 0 and r["world"] == world for r, _ in records([node])):
                return node
        if any("<eof>" in n.lines for n in nodes):
            break
        time.sleep(0.05)
    raise RuntimeError(f"rank 0 never printed step {step} at world {world}:\n" + "\n".join(n.tail(15) for n in nodes))


def pause(nodes: list[Node], step: int) -> dict:
    """Rank 0's step `step` at world 3 -> its step `step` + 1 at world 2 (s), cut at the first line of
    each of MARKS in between, on any node; and the median step at world 2 after it."""
    rank0 = sorted((r["step"], r["world"], t) for r, t in records(nodes) if r["rank"] == 0)
    at = {(s, w): t for s, w, t in rank0}
    later = [t for s, w, t in rank0 if w == 2 and s > step]
    t0, t1 = at[(step, 3)], at[(step + 1, 2)]
    lines = sorted((t, line) for n in nodes for line, t in zip(n.lines, n.arrived) if t0 < t < t1)
    marks = [t0, *(next((t for t, line in lines if re.search(m, line)), t0) for m in MARKS), t1]
    return {"pause": t1 - t0, "parts": [b - a for a, b in zip(marks, marks[1:])],
            "step_s": statistics.median([b - a for a, b in zip(later, later[1:])] or [float("nan")])}  # fmt: skip


def agreed_step(ckpt: Path) -> int:
    (info,) = [c for c in list_checkpoints(str(ckpt)) if c.committed and c.reason == "emergency"]
    return info.step


def in_memory(tmp: Path, shm: Path) -> None:
    """Each node's snapshot dir (localnodes: tmp/node<i>-memory) a link into /dev/shm: the node's memory."""
    for i in range(3):
        (shm / f"node{i}").mkdir(parents=True)
        (tmp / f"node{i}-memory").symlink_to(shm / f"node{i}")


def keep(logs: Path | None, name: str, nodes: list[Node]) -> None:
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
        for node in nodes:
            lines = [f"{t:.3f} {line}" for line, t in zip(node.lines, node.arrived)]
            (logs / f"{name}-node{node.rank}.log").write_text("\n".join(lines) + "\n")


def measured(nodes: list[Node], ckpt: Path) -> dict:
    step = agreed_step(ckpt)
    tiers = re.findall(rf"timeline: .* resumed +step={step} .*tier=(\w+)", "\n".join(nodes[0].lines + nodes[1].lines))
    return {"step": step, **pause(nodes, step), "source": "/".join(sorted(set(tiers))) or "?"}


def in_process(tmp: Path, train: list[str], args: argparse.Namespace, name: str) -> dict:
    ckpt, out = tmp / "ckpt", tmp / "out.json"
    nodes = start_nodes(3, str(ckpt), tmp, [*train, "--in-process", "--out", str(out)], SNAPSHOTS)
    try:
        wait_step(nodes, args.notice_at, 3)
        nodes[2].emulator.raise_notice()
        codes = [node.finish(900) for node in nodes]
    finally:
        stop_all(nodes)
        keep(args.logs, name, nodes)
    if codes != [0, 0, 0]:
        raise RuntimeError(f"in-process run ended with {codes}:\n" + "\n".join(n.tail() for n in nodes))
    found = RECOVERED.search(nodes[0].output())
    if found is None:
        raise RuntimeError(f"no in-process recovery on node 0:\n{nodes[0].tail()}")
    result = {**measured(nodes, ckpt), "own": float(found[2]), "formed": float(found[3])}
    result["digest"] = json.loads(out.read_text())["digest"]

    # The restart path from the same emergency checkpoint: two fresh nodes, static, no snapshots.
    fresh = tmp / "restart"
    shutil.copytree(ckpt, fresh / "ckpt")
    restarted = run_nodes(2, fresh / "ckpt", fresh, train, fresh / "out.json")
    result["identical"] = restarted["start"] == result["step"] + 1 and restarted["digest"] == result["digest"]
    return result


def restart(tmp: Path, train: list[str], args: argparse.Namespace, name: str) -> dict:
    ckpt = tmp / "ckpt"
    rdzv = rendezvous("2:3", max_restarts=3)
    nodes = [rdzv.join(i, str(ckpt), tmp, train, SNAPSHOTS) for i in range(3)]
    try:
        wait_step(nodes, args.notice_at, 3)
        # The node of rank 2 (the rendezvous numbers the nodes), as in-process: never the store's host.
        (leaving,) = [n for n in nodes if any(r["rank"] == 2 and r["world"] == 3 for r, _ in records([n]))]
        leaving.emulator.raise_notice()
        leaving.finish(600)
        leaving.kill()  # and the VM vanishes
        survivors = [n for n in nodes if n is not leaving]
        codes = [node.finish(900) for node in survivors]
    finally:
        stop_all(nodes)
        keep(args.logs, name, nodes)
    if codes != [0, 0]:
        raise RuntimeError(f"restart path ended with {codes}:\n" + "\n".join(n.tail() for n in nodes))
    return measured(survivors, ckpt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs of both ways (default 3; order reversed every other)")
    parser.add_argument("--size-gb", type=float, default=1.0, help="params + AdamW state per rank in GB (default 1.0)")
    parser.add_argument("--notice-at", type=int, default=5, help="rank 0's step after which node 2 is reclaimed")
    parser.add_argument("--after", type=int, default=8, help="steps trained after --notice-at (default 8)")
    parser.add_argument("--logs", type=Path, help="keep every node's output here (timestamped lines)")
    parser.add_argument("--quick", action="store_true", help="a smoke test: tiny state (--hidden 256), 1 run")
    args = parser.parse_args()
    hidden = 256 if args.quick else hidden_for(args.size_gb)
    runs = 1 if args.quick else args.runs
    train = ["--steps", str(args.notice_at + args.after), "--hidden", str(hidden), "--log-samples"]
    if args.quick:
        train += ["--step-time", "0.2"]  # tiny steps: the notice lands while they train
    print(f"state: {12 * 129 * (hidden + 1) / 1e9:.3f} GB per rank (--hidden {hidden}: params + AdamW), 3 nodes x 1 "
          f"rank, the node of rank 2 reclaimed after step {args.notice_at}", flush=True)  # fmt: skip
    rows, parts = [], []
    for run in range(1, runs + 1):
        ways = [("in-process", in_process), ("restart", restart)]
        result = {}
        for way, measure in ways if run % 2 else ways[::-1]:
            with (
                tempfile.TemporaryDirectory(prefix="spotguard-bench-inprocess-") as tmp,
                tempfile.TemporaryDirectory(prefix="spotguard-bench-inprocess-", dir="/dev/shm") as shm,
            ):
                in_memory(Path(tmp), Path(shm))
                r = result[way] = measure(Path(tmp), train, args, f"run{run}-{way}")
            print(f"run {run} {way}: agreed step {r['step']}, pause {r['pause']:.2f} s", flush=True)
            parts.append([run, way, r["step"], f"{r['pause']:.2f}", *(f"{p:.2f}" for p in r["parts"]),
                          f"{r['step_s']:.2f}", r["source"]])  # fmt: skip
        a, b = result["in-process"], result["restart"]
        rows.append([run, f"{a['pause']:.2f}", f"{a['own']:.2f} / {a['formed']:.2f}", f"{b['pause']:.2f}",
                     f"{b['pause'] / a['pause']:.1f}x", "yes" if a["identical"] else "NO"])  # fmt: skip
    print()
    print(table(["run", "in-process pause s", "its log line: paused / group formed s", "restart-path pause s",
                 "restart / in-process", "weights identical"], rows))  # fmt: skip
    if runs > 1:
        ratios = sorted(float(r[4][:-1]) for r in rows)
        print(f"restart path / in-process: median {statistics.median(ratios):.1f}x (min {ratios[0]:.1f}x, "
              f"max {ratios[-1]:.1f}x)")  # fmt: skip
    print()
    print("the pause in parts (s), cut at the first line of each on any survivor (see MARKS):")
    print(table(["run", "way", "agreed step", "pause", *PARTS, "median step at world 2", "state from"], parts))
    if any(r[-1] != "yes" for r in rows):
        raise SystemExit("the in-process run's weights differ from a restart from the same emergency checkpoint")


if __name__ == "__main__":
    main()
