"""The survivors' pause when one node of three is lost, after a notice or without one: in-process
recovery against today's restart path (torchrun restarting the survivors), in the same run.

    python bench/inprocess.py [--loss {notice,frozen,both}] [--runs 3] [--size-gb 1.0] [--notice-at 5]
                              [--freeze-at 6] [--snapshot-every 4] [--logs DIR] [--quick]

Three torchrun agents on this host stand for three nodes (tests/nodes.py: one rank each, its own AWS
metadata emulator, its snapshot dir in /dev/shm: the node's memory; checkpoints on the local disk)
train examples/train_ddp.py (a 64 -> H -> 64 -> 1 MLP, DDP) at `--hidden H`, chosen so that params +
AdamW's two moments are --size-gb GB per rank (every rank holds all of it; H = 645,994 for 1 GB).
The node of rank 2 is lost once rank 0 printed a step, and the survivors go on at world 2:

- `--loss notice` (default): it is reclaimed through its emulator after step --notice-at; the ranks
  agree on a step S and commit its emergency checkpoint, and the survivors go on from S + 1.
  SPOTGUARD_SNAPSHOT_EVERY=1000 in both ways: step 0's snapshot is the one taken before the notice (an
  emergency's snapshot is taken only by a tier that has taken one). The pause: rank 0's line of step S
  at world 3 -> its first line at world 2 (step S + 1).
- `--loss frozen`: it is frozen (SIGSTOP of its agent and workers: no FIN) right after rank 0 printed
  step --freeze-at, with snapshots (and durable saves, `--save-every`) every --snapshot-every steps, and
  SPOTGUARD_PEER_TIMEOUT=5: its neighbour declares it lost after 5 s and the survivors go on from the
  newest whole snapshot S. The pause: the freeze -> rank 0's first line at world 2 (step S + 1); the
  goal: training again (below) within peer_timeout_s + 2 s.

Both ways, in the same run:

- in-process: `--in-process` (spotguard.run), static rendezvous: the survivors keep their processes,
  form generation 1's group, build the model again and load S from the snapshot in the nodes' memory
  (after a notice: the emergency's snapshot of S, taken beside its durable save).
- restart path (baseline): elastic torchrun, `--nnodes 2:3 --max-restarts 3` (c10d,
  localnodes.Rendezvous): after a notice the survivors exit 143 (no emergency snapshot: a cloud takes a
  node) and the new workers load S from the durable checkpoint; without one they exit 75
  (silent-failure), their agents meet again once the frozen agent's keep-alive expired, and the new
  workers load S from the snapshot in the nodes' memory. Either way at world 2.

A frozen node's survivors' agents wait up to 300 s in torchrun's exit barrier after their workers end:
the end of a frozen run is rank 0's --out file and the survivors' workers gone, then the nodes are
stopped. The pause (as this process read the lines, so it includes one step at world 2; the median
step at world 2 is shown beside it) is cut into parts at log lines (MARKS); "training again" is the pause
up to the step's state loaded at world 2 (its first step begins: the goals are on it, 2 s after a notice,
peer_timeout_s + 2 s after a freeze); beside them the in-process runner's own figures (its log line:
paused, group formed, training again). Then the weights: the in-process run's
final digest (rank 0's --out) against two fresh nodes restarted from a copy of the same durable step
(the emergency checkpoint; frozen: the periodic save of S, when it is committed).
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
from tests.nodes import Node, rendezvous, run_nodes, start_nodes, stop_all, worker_pids  # noqa: E402

PEER_TIMEOUT = 5  # s, SPOTGUARD_PEER_TIMEOUT of the frozen case
GOAL_S = {"notice": 2.0, "frozen": PEER_TIMEOUT + 2.0}  # to the first step at world 2 begun (training again)
RECOVERED = re.compile(
    r"in-process recovery: generation 1, world 3 -> 2, rank\(s\) 2 (?:left after a notice|lost without a notice): "
    r"this process \(pid \d+\) paused ([\d.]+) s \(group formed after ([\d.]+) s, training again after ([\d.]+) s\), "
    r"going on from step (\d+)"
)
# The pause's parts end at: (notice) the emergency checkpoint durable, or (frozen) node 2 declared lost;
# the next guard watching (in-process: its group formed; restart: the new worker started), the step
# loaded, then the first step at world 2.
MARKS = {
    "notice": [r"timeline: .* durable +step=", r"spotguard.watcher: watching", r"timeline: .* resumed +step="],
    "frozen": [r"node \S+ lost", r"spotguard.watcher: watching", r"timeline: .* resumed +step="],
}
PARTS = {
    "notice": ["emergency save", "-> next guard", "model + load", "first step"],
    "frozen": ["-> declared lost", "-> next guard", "model + load", "first step"],
}


def with_common_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The arguments of this bench's and bench/join.py's: runs, state size, logs, a smoke test."""
    parser.add_argument("--runs", type=int, default=3, help="runs of both ways (default 3; order reversed every other)")
    parser.add_argument("--size-gb", type=float, default=1.0, help="params + AdamW state per rank in GB (default 1.0)")
    parser.add_argument("--logs", type=Path, help="keep every node's output here (timestamped lines)")
    parser.add_argument("--quick", action="store_true", help="a smoke test: tiny state (--hidden 256), 1 run")
    return parser


def hidden_for(gb: float) -> int:
    """The example's --hidden whose params (129 h + 129 floats) with AdamW's two moments make `gb` GB."""
    return max(1, round(gb * 1e9 / (3 * 4 * 129)) - 1)


def setting(args: argparse.Namespace) -> tuple[dict[str, str], list[str], int]:
    """The loss's environment, its extra training arguments and rank 0's step after which node 2 is lost."""
    if args.loss == "notice":
        return {"SPOTGUARD_SNAPSHOT_EVERY": "1000"}, [], args.notice_at  # step 0's, then only the emergency's
    every = str(args.snapshot_every)
    env = {"SPOTGUARD_SNAPSHOT_EVERY": every, "SPOTGUARD_PEER_TIMEOUT": str(PEER_TIMEOUT)}
    return env, ["--save-every", every], args.freeze_at  # the snapshot's step durable too: the weights check


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
        time.sleep(0.02)
    raise RuntimeError(f"rank 0 never printed step {step} at world {world}:\n" + "\n".join(n.tail(15) for n in nodes))


def lose(args: argparse.Namespace, node: Node) -> float | None:
    """Node 2 lost: reclaimed (the pause starts at the agreed step's line: None) or frozen (now)."""
    if args.loss == "notice":
        node.emulator.raise_notice()
        return None
    node.freeze()
    return time.monotonic()


def ended(survivors: list[Node], out: Path, timeout: float = 600) -> None:
    """A frozen run's end (the survivors' agents would wait 300 s in their exit barrier): rank 0's --out
    written and the survivors' workers gone."""
    deadline = time.monotonic() + timeout
    while not (out.exists() and not any(worker_pids(n) for n in survivors)):
        if time.monotonic() > deadline or all("<eof>" in n.lines for n in survivors):
            break
        time.sleep(0.2)
    if not out.exists():
        raise RuntimeError("the survivors never ended the run:\n" + "\n".join(n.tail() for n in survivors))


def pause(nodes: list[Node], t0: float | None, marks: list[str]) -> dict:
    """From `t0` (None: rank 0's line of the step before its first at world 2, at world 3) to rank 0's
    first line at world 2 (s), cut at the first line of each of `marks` in between, on any node; the step
    gone on from; and the median step at world 2 after it."""
    rank0 = sorted((t, r["step"], r["world"]) for r, t in records(nodes) if r["rank"] == 0)
    later = [(t, s) for t, s, w in rank0 if w == 2]
    if not later:
        raise RuntimeError("rank 0 never printed a step at world 2:\n" + "\n".join(n.tail(15) for n in nodes))
    t1, first = later[0]
    step = first - 1
    if t0 is None:
        t0 = next(t for t, s, w in rank0 if (s, w) == (step, 3))
    lines = sorted((t, line) for n in nodes for line, t in zip(n.lines, n.arrived) if t0 < t < t1)
    cuts = [t0, *(next((t for t, line in lines if re.search(m, line)), t0) for m in marks), t1]
    steps = [b - a for (a, _), (b, _) in zip(later, later[1:])]
    return {"step": step, "pause": t1 - t0, "parts": [b - a for a, b in zip(cuts, cuts[1:])],
            "step_s": statistics.median(steps or [float("nan")])}  # fmt: skip


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


def measured(args: argparse.Namespace, survivors: list[Node], ckpt: Path, t0: float | None) -> dict:
    result = pause(survivors, t0, MARKS[args.loss])
    step = result["step"]
    if args.loss == "notice":
        (info,) = [c for c in list_checkpoints(str(ckpt)) if c.committed and c.reason == "emergency"]
        if info.step != step:
            raise RuntimeError(f"agreed on step {info.step}, but rank 0 went on from step {step + 1}")
    text = "\n".join(n.output() for n in survivors)
    tiers = re.findall(rf"timeline: .* resumed +step={step} .*tier=(\w+)", text)
    return {**result, "source": "/".join(sorted(set(tiers))) or "?"}


def in_process(tmp: Path, train: list[str], args: argparse.Namespace, name: str) -> dict:
    ckpt, out = tmp / "ckpt", tmp / "out.json"
    env, more, at = setting(args)
    nodes = start_nodes(3, str(ckpt), tmp, [*train, *more, "--in-process", "--out", str(out)], env)
    try:
        wait_step(nodes, at, 3)
        t0 = lose(args, nodes[2])
        if args.loss == "notice":
            codes = [node.finish(900) for node in nodes]
            if codes != [0, 0, 0]:
                raise RuntimeError(f"in-process run ended with {codes}:\n" + "\n".join(n.tail() for n in nodes))
        else:
            ended(nodes[:2], out)
    finally:
        stop_all(nodes)
        keep(args.logs, name, nodes)
    found = [RECOVERED.search(n.output()) for n in nodes[:2]]
    if not all(found):
        raise RuntimeError("no in-process recovery on a survivor:\n" + "\n".join(n.tail() for n in nodes[:2]))
    own = {"own": float(found[0][1]), "formed": float(found[0][2]), "again": float(found[0][3])}
    result = {**measured(args, nodes[:2], ckpt, t0), **own}
    if int(found[0][4]) != result["step"]:
        raise RuntimeError(f"the runner went on from step {found[0][4]}, rank 0's first line at world 2 says "
                           f"{result['step']}")  # fmt: skip
    result["digest"] = json.loads(out.read_text())["digest"]

    # The restart path from the same durable step: two fresh nodes, static, no snapshots.
    step_dir = f"step-{result['step']:010d}"
    if not any(c.committed and c.step == result["step"] for c in list_checkpoints(str(ckpt))):
        result["identical"] = None  # no durable checkpoint of the step gone on from
        return result
    fresh = tmp / "restart"
    (fresh / "ckpt").mkdir(parents=True)
    shutil.copytree(ckpt / step_dir, fresh / "ckpt" / step_dir)
    restarted = run_nodes(2, fresh / "ckpt", fresh, train, fresh / "out.json")
    result["identical"] = restarted["start"] == result["step"] + 1 and restarted["digest"] == result["digest"]
    return result


def restart(tmp: Path, train: list[str], args: argparse.Namespace, name: str) -> dict:
    ckpt, out = tmp / "ckpt", tmp / "out.json"
    env, more, at = setting(args)
    rdzv = rendezvous("2:3", max_restarts=3)
    nodes = [rdzv.join(i, str(ckpt), tmp, [*train, *more, "--out", str(out)], env) for i in range(3)]
    try:
        wait_step(nodes, at, 3)
        # The node of rank 2 (the rendezvous numbers the nodes), as in-process: never the store's host.
        (leaving,) = [n for n in nodes if any(r["rank"] == 2 and r["world"] == 3 for r, _ in records([n]))]
        t0 = lose(args, leaving)
        survivors = [n for n in nodes if n is not leaving]
        if args.loss == "notice":
            leaving.finish(600)
            leaving.kill()  # and the VM vanishes
            codes = [node.finish(900) for node in survivors]
            if codes != [0, 0]:
                raise RuntimeError(f"restart path ended with {codes}:\n" + "\n".join(n.tail() for n in nodes))
        else:
            ended(survivors, out)
    finally:
        stop_all(nodes)
        keep(args.logs, name, nodes)
    if args.loss == "frozen" and not all("ending this process with code 75" in n.output() for n in survivors):
        raise RuntimeError("a survivor did not end with code 75:\n" + "\n".join(n.tail() for n in survivors))
    return measured(args, survivors, ckpt, t0)


def measure(args: argparse.Namespace, hidden: int, runs: int) -> bool:
    """Both ways, alternately first, `runs` times; prints the tables; whether every weights check held."""
    _, _, at = setting(args)
    train = ["--steps", str(at + args.after), "--hidden", str(hidden), "--log-samples"]
    if args.quick:
        train += ["--step-time", "0.2"]  # tiny steps: the loss lands while they train
    how = (f"reclaimed (a notice) after step {at}" if args.loss == "notice" else
           f"frozen (SIGSTOP, no notice) after step {at}, snapshots and durable saves every {args.snapshot_every} "
           f"steps, SPOTGUARD_PEER_TIMEOUT={PEER_TIMEOUT} (goal: training again <= {PEER_TIMEOUT + 2} s)")  # fmt: skip
    print(f"\n== {args.loss}: state {12 * 129 * (hidden + 1) / 1e9:.3f} GB per rank (--hidden {hidden}: params + "
          f"AdamW), 3 nodes x 1 rank, the node of rank 2 {how}", flush=True)  # fmt: skip
    rows, parts = [], []
    for run in range(1, runs + 1):
        ways = [("in-process", in_process), ("restart", restart)]
        result = {}
        for way, measure_way in ways if run % 2 else ways[::-1]:
            with (
                tempfile.TemporaryDirectory(prefix="spotguard-bench-inprocess-") as tmp,
                tempfile.TemporaryDirectory(prefix="spotguard-bench-inprocess-", dir="/dev/shm") as shm,
            ):
                in_memory(Path(tmp), Path(shm))
                r = result[way] = measure_way(Path(tmp), train, args, f"{args.loss}-run{run}-{way}")
            print(f"run {run} {way}: went on from step {r['step']}, pause {r['pause']:.2f} s", flush=True)
            parts.append([run, way, r["step"], f"{r['pause']:.2f}", *(f"{p:.2f}" for p in r["parts"]),
                          f"{r['step_s']:.2f}", r["source"]])  # fmt: skip
        a, b = result["in-process"], result["restart"]
        identical = {True: "yes", False: "NO", None: f"n/a (no durable step {a['step']})"}[a["identical"]]
        again = a["pause"] - a["parts"][-1]  # up to the state loaded: the first step at world 2 is training
        goal = "met" if again <= GOAL_S[args.loss] else "missed"
        rows.append([run, f"{a['pause']:.2f}", f"{again:.2f}", goal,
                     f"{a['own']:.2f} / {a['formed']:.2f} / {a['again']:.2f}", f"{b['pause']:.2f}",
                     f"{b['pause'] / a['pause']:.1f}x", identical])  # fmt: skip
    goal = f"goal <= {GOAL_S[args.loss]:.0f} s"
    start = "agreed step" if args.loss == "notice" else "freeze"
    print(f"\nthe pause: {start} -> rank 0's first step at world 2 done (training again: its state loaded)")
    print(table(["run", "in-process pause s", "training again after s", goal,
                 "its log line: paused / group formed / training again s", "restart-path pause s",
                 "restart / in-process", "weights identical"], rows))  # fmt: skip
    if runs > 1:
        ratios = sorted(float(r[-2][:-1]) for r in rows)
        print(f"restart path / in-process: median {statistics.median(ratios):.1f}x (min {ratios[0]:.1f}x, "
              f"max {ratios[-1]:.1f}x)")  # fmt: skip
    print()
    print("the pause in parts (s), cut at the first line of each on any survivor (see MARKS):")
    print(table(["run", "way", "went on from step", "pause", *PARTS[args.loss], "median step at world 2",
                 "state from"], parts))  # fmt: skip
    return all(r[-1] != "NO" for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--loss",
        choices=["notice", "frozen", "both"],
        default="notice",
        help="node 2 reclaimed after a notice, frozen without one, or both in turn (default notice)",
    )
    parser.add_argument(
        "--notice-at", type=int, default=5, help="notice: rank 0's step after which node 2 is reclaimed"
    )
    parser.add_argument("--freeze-at", type=int, default=6, help="frozen: rank 0's step after which node 2 is frozen")
    parser.add_argument("--snapshot-every", type=int, default=4, help="frozen: snapshots and durable saves (default 4)")
    parser.add_argument("--after", type=int, default=8, help="steps trained after the loss (default 8)")
    args = with_common_arguments(parser).parse_args()
    hidden = 256 if args.quick else hidden_for(args.size_gb)
    runs = 1 if args.quick else args.runs
    same = True
    for loss in ["notice", "frozen"] if args.loss == "both" else [args.loss]:
        same &= measure(argparse.Namespace(**{**vars(args), "loss": loss}), hidden, runs)
    if not same:
        raise SystemExit("the in-process run's weights differ from a restart from the same durable step")


if __name__ == "__main__":
    main()
