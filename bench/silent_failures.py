"""Silent failures: how long a job whose node froze, or whose rank hung, takes to end, with no notice.

    python bench/silent_failures.py [--trials 10] [--hang-timeout 60] [--parts freeze,hang,gil] [--quick] [--json]

Three torchrun agents as nodes on 127.0.0.1 (spotguard.demo.localnodes: static rendezvous hosted by
node 0, one worker per node, gloo), each with its own snapshot dir (SPOTGUARD_SNAPSHOT_EVERY=5).

  freeze  examples/train_ddp.py (`--step-time 0.05`). Per trial: start the nodes, wait until rank 0
          printed step 5, then SIGSTOP node 2's agent and worker (`LocalNode.freeze()`: its
          connections stay open and silent, no FIN, no RST; t0 = that moment). Node 0 watches
          node 2 in the liveness ring and declares it lost after `peer_timeout_s` of silence; every
          survivor then ends with code 75. Measured from t0: "workers exited", the later of the two
          survivors' `$SPOTGUARD_EXIT_FILE` "at" stamps (written just before the worker's exit;
          wall clock, millisecond precision, against time.time() taken at t0), and "agents
          exited", when the later survivor's torchrun agent ended (polled every 20 ms). Both
          survivors' exit files must say cause "peer-lost" and a culprit ending in "node-2", or
          the trial is a failure. Then node 2 is killed. `--trials` trials with the default
          settings (SPOTGUARD_PEER_TIMEOUT unset: 20 s) and as many with SPOTGUARD_PEER_TIMEOUT=5.
  hang    tests/silent_worker.py with `--hang-rank 1 --hang-at 20` and SPOTGUARD_HANG_TIMEOUT=
          --hang-timeout (60): rank 1 never returns from its data loader at step 20; ranks 0 and 2
          wait for it in DDP's allreduce. From the arrival of rank 0's line for step 19 (the last
          step every rank completed: rank 1 is stuck from then on) to the last worker's exit file
          "at" and the last agent's exit. Every exit file must say cause "hang", culprit "rank 1",
          and node 1's output must hold its stack ("in next_batch"). One trial.

  gil     no failure at all, a false alarm to avoid: tests/silent_worker.py with every setting at its
          default, node 1's worker keeps its GIL for --gil-s (60) seconds in one C call after step 10
          (as a backtracking regex or a sort of tens of millions of floats does; nothing of that
          process runs meanwhile), three times peer_timeout_s. The job must run to its end: every
          worker exits 0 and no exit file is written. One trial; its wall time against the same run
          without the hold, in the same process (the hold's cost is the hold itself).

The limit, in the same run: the configured timeout itself (a silence, or a stall, cannot be called
a failure before it has lasted that long): worst / timeout. The baseline without spotguard is a
constant, not measured: gloo's default collective timeout, 30 minutes, for which the survivors wait
in their next allreduce (NCCL's: 10 minutes).

Goals, on the worst trial's last agent exit: <= 30 s with the default peer_timeout_s (20 s),
<= 10 s with peer_timeout_s=5, <= 120 s for a hang with hang_timeout_s=60. Exit status 1 when a
goal is missed or a trial failed. SPOTGUARD_PEER_TIMEOUT and SPOTGUARD_HANG_TIMEOUT are removed
from this process's environment first, so that "default" means the default.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from _common import ROOT, table  # also puts the checkout on sys.path

from spotguard.demo import localnodes  # noqa: E402

TRAIN = [str(ROOT / "examples" / "train_ddp.py")]
SILENT = [str(ROOT / "tests" / "silent_worker.py")]
ENV = {"PYTHONPATH": str(ROOT), "SPOTGUARD_SNAPSHOT_EVERY": "5"}
FREEZE_ARGS = ["--steps", "100000", "--step-time", "0.05"]
FREEZE_AT = 5  # rank 0 printed this step: node 2 is frozen
HANG_AT = 20  # rank 1 never returns from its data loader at this step
DEFAULT_PEER_TIMEOUT_S = 20.0  # spotguard's default (options.DEFAULT_PEER_TIMEOUT_S)
GLOO_TIMEOUT_S = 1800.0  # the baseline: gloo's default collective timeout (a constant, not measured)
SETTINGS = (("default (20 s)", None, 30.0), ("peer_timeout_s=5", 5.0, 10.0))  # (name, env value, goal s)
HANG_GOAL_S = 120.0
GIL_ARGS = ["--steps", "40", "--hold-gil-rank", "1", "--hold-gil-at", "10"]
POLL_S = 0.02


def at_s(node: localnodes.LocalNode, wall0: float) -> float | None:
    """Seconds from `wall0` (time.time()) to the exit file's "at", or None without one."""
    try:
        ended = json.loads(node.exit_file.read_text())
    except (OSError, ValueError):
        return None
    return datetime.fromisoformat(ended["at"].replace("Z", "+00:00")).timestamp() - wall0


def wait_agents(nodes: list[localnodes.LocalNode], t0: float, timeout_s: float) -> list[float | None]:
    """When each agent of `nodes` ended, in seconds from t0 (None: still running after timeout_s)."""
    ended: list[float | None] = [None] * len(nodes)
    deadline = t0 + timeout_s
    while None in ended and time.monotonic() < deadline:
        now = time.monotonic()
        for i, node in enumerate(nodes):
            if ended[i] is None and node.proc.poll() is not None:
                ended[i] = now - t0
        time.sleep(POLL_S)
    return ended


def exit_files(nodes: list[localnodes.LocalNode]) -> list[dict[str, Any] | None]:
    out = []
    for node in nodes:
        try:
            out.append(json.loads(node.exit_file.read_text()))
        except (OSError, ValueError):
            out.append(None)
    return out


def freeze_trial(peer_timeout: float | None, timeout_s: float) -> dict[str, Any]:
    """One frozen node: seconds to the survivors' workers' and agents' exits, and what they wrote."""
    env = dict(ENV)
    if peer_timeout is not None:
        env["SPOTGUARD_PEER_TIMEOUT"] = f"{peer_timeout:g}"
    with tempfile.TemporaryDirectory(prefix="spotguard-silent-") as tmp:
        nodes = localnodes.start_nodes(3, TRAIN, str(Path(tmp) / "ckpt"), Path(tmp), FREEZE_ARGS, env)
        try:
            nodes[0].step_reached(FREEZE_AT, timeout=180)
            t0, wall0 = time.monotonic(), time.time()
            nodes[2].freeze()
            agents = wait_agents(nodes[:2], t0, timeout_s)
            workers = [at_s(node, wall0) for node in nodes[:2]]
            nodes[2].kill()
            files = exit_files(nodes[:2])
            noticed = silence_noticed(Path(tmp) / "ckpt")
        finally:
            localnodes.stop_all(nodes)
        tails = [node.tail(15) for node in nodes[:2]]
    problems = []
    if None in agents:
        problems.append(f"a survivor's agent still ran {timeout_s:g} s after the freeze")
    for i, f in enumerate(files):
        if f is None:
            problems.append(f"node {i}: no exit file")
        elif f.get("cause") != "peer-lost" or not str(f.get("culprit", "")).endswith("node-2"):
            problems.append(f"node {i}: exit file says cause={f.get('cause')!r} culprit={f.get('culprit')!r}")
    return {
        "workers_s": None if None in workers else round(max(workers), 3),
        "agents_s": None if None in agents else round(max(agents), 3),
        "per_node_workers_s": [None if w is None else round(w, 3) for w in workers],
        "per_node_agents_s": [None if a is None else round(a, 3) for a in agents],
        "noticed_after_s": noticed,
        "exit_files": files,
        "ok": not problems,
        "problems": problems,
        "tails": tails if problems else None,
    }


def silence_noticed(ckpt: Path) -> float | None:
    """The silence when the node was declared lost, from the goodput ledger (rank 0's record)."""
    try:
        lines = (ckpt / "spotguard-ledger.jsonl").read_text().splitlines()
    except OSError:
        return None
    for record in map(json.loads, lines):
        if record.get("event") == "silent-failure":
            return record.get("noticed_after_s")
    return None


def hang_trial(hang_timeout: float, timeout_s: float) -> dict[str, Any]:
    """Rank 1 stuck in its data loader: from its last step to every worker's and agent's exit."""
    env = {**ENV, "SPOTGUARD_HANG_TIMEOUT": f"{hang_timeout:g}"}
    args = ["--steps", "100000", "--hang-rank", "1", "--hang-at", str(HANG_AT)]
    with tempfile.TemporaryDirectory(prefix="spotguard-silent-") as tmp:
        nodes = localnodes.start_nodes(3, SILENT, str(Path(tmp) / "ckpt"), Path(tmp), args, env)
        try:
            nodes[0].step_reached(HANG_AT - 1, timeout=180)
            t0 = stopped_at(nodes[0], HANG_AT - 1)
            wall0 = time.time() - (time.monotonic() - t0)
            agents = wait_agents(nodes, t0, timeout_s)
            workers = [at_s(node, wall0) for node in nodes]
            files = exit_files(nodes)
            after = max((int(json.loads(line)["step"]) for line in list(nodes[0].lines) if line.startswith('{"step"')),
                        default=None)  # fmt: skip
        finally:
            localnodes.stop_all(nodes)
        node1 = "\n".join(nodes[1].lines)
        tails = [node.tail(15) for node in nodes]
    problems = []
    if None in agents:
        problems.append(f"an agent still ran {timeout_s:g} s after the hang")
    for i, f in enumerate(files):
        if f is None:
            problems.append(f"node {i}: no exit file")
        elif (f.get("cause"), f.get("culprit")) != ("hang", "rank 1"):
            problems.append(f"node {i}: exit file says cause={f.get('cause')!r} culprit={f.get('culprit')!r}")
    if "in next_batch" not in node1:
        problems.append("node 1's output has no stack in next_batch")
    if after != HANG_AT - 1:
        problems.append(f"rank 0 printed step {after} after the hang at {HANG_AT}")
    return {
        "workers_s": None if None in workers else round(max(workers), 3),
        "agents_s": None if None in agents else round(max(agents), 3),
        "per_node_workers_s": [None if w is None else round(w, 3) for w in workers],
        "per_node_agents_s": [None if a is None else round(a, 3) for a in agents],
        "exit_files": files,
        "ok": not problems,
        "problems": problems,
        "tails": tails if problems else None,
    }


def gil_trial(hold_s: int) -> dict[str, Any]:
    """Node 1's worker holds its GIL for `hold_s` s, then the same run without it: the job ends well both times."""
    runs = []
    for seconds in (hold_s, 0):
        with tempfile.TemporaryDirectory(prefix="spotguard-silent-") as tmp:
            started = time.monotonic()
            nodes = localnodes.start_nodes(3, SILENT, str(Path(tmp) / "ckpt"), Path(tmp),
                                           [*GIL_ARGS, "--hold-gil-s", str(seconds)], ENV)  # fmt: skip
            try:
                codes = [node.finish(hold_s + 240) for node in nodes]
                files = exit_files(nodes)
            finally:
                localnodes.stop_all(nodes)
            runs.append({"codes": codes, "exit_files": files, "took_s": round(time.monotonic() - started, 2),
                         "tails": [node.tail(15) for node in nodes]})  # fmt: skip
    problems = [f"hold {s} s: codes {r['codes']}, exit files {r['exit_files']}" for s, r in zip((hold_s, 0), runs)
                if r["codes"] != [0, 0, 0] or any(r["exit_files"])]  # fmt: skip
    return {"took_s": runs[0]["took_s"], "baseline_s": runs[1]["took_s"], "ok": not problems, "problems": problems,
            "tails": runs[0]["tails"] if problems else None}  # fmt: skip


def stopped_at(node: localnodes.LocalNode, step: int) -> float:
    """When node's line for `step` arrived (monotonic)."""
    for line, when in zip(list(node.lines), list(node.arrived)):
        if line.startswith("{") and json.loads(line).get("step") == step:
            return when
    raise localnodes.LocalNodeError(f"node {node.rank} printed no line for step {step}")


def stats(values: list[float]) -> tuple[str, str, str]:
    if not values:
        return "-", "-", "-"
    return f"{min(values):.2f}", f"{statistics.median(values):.2f}", f"{max(values):.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10, help="frozen-node trials per setting (default 10)")
    parser.add_argument("--hang-timeout", type=float, default=60.0, help="SPOTGUARD_HANG_TIMEOUT of the hang (60)")
    parser.add_argument("--parts", default="freeze,hang,gil", help="comma-separated subset of freeze,hang,gil")
    parser.add_argument("--gil-s", type=int, default=60, help="how long node 1 keeps its GIL in the gil part (60)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 frozen-node trials per setting")
    parser.add_argument("--json", action="store_true", help="one JSON document with every trial")
    args = parser.parse_args()
    if args.quick:
        args.trials = 2
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or parts - {"freeze", "hang", "gil"}:
        parser.error(f"--parts takes a subset of freeze,hang,gil, got {args.parts!r}")
    for name in ("SPOTGUARD_PEER_TIMEOUT", "SPOTGUARD_HANG_TIMEOUT"):
        os.environ.pop(name, None)

    started = time.monotonic()
    freeze: dict[str, list[dict[str, Any]]] = {}
    if "freeze" in parts:
        for name, value, _goal in SETTINGS:
            timeout = value or DEFAULT_PEER_TIMEOUT_S
            freeze[name] = []
            for t in range(args.trials):
                row = freeze_trial(value, timeout_s=timeout + 90)
                freeze[name].append(row)
                print(f"freeze, {name}, trial {t + 1}/{args.trials}: workers {row['workers_s']} s, agents "
                      f"{row['agents_s']} s" + ("" if row["ok"] else f"  FAILED: {'; '.join(row['problems'])}"),
                      file=sys.stderr, flush=True)  # fmt: skip
                for tail in row["tails"] or []:
                    print(tail, file=sys.stderr, flush=True)
    hang = None
    if "hang" in parts:
        hang = hang_trial(args.hang_timeout, timeout_s=args.hang_timeout + 120)
        print(f"hang, hang_timeout_s={args.hang_timeout:g}: workers {hang['workers_s']} s, agents "
              f"{hang['agents_s']} s" + ("" if hang["ok"] else f"  FAILED: {'; '.join(hang['problems'])}"),
              file=sys.stderr, flush=True)  # fmt: skip
        for tail in hang["tails"] or []:
            print(tail, file=sys.stderr, flush=True)
    gil = None
    if "gil" in parts:
        gil = gil_trial(args.gil_s)
        print(
            f"gil, node 1 held its GIL {args.gil_s} s: run {gil['took_s']} s against {gil['baseline_s']} s without"
            + ("" if gil["ok"] else f"  FAILED: {'; '.join(gil['problems'])}"),
            file=sys.stderr,
            flush=True,
        )
        for tail in gil["tails"] or []:
            print(tail, file=sys.stderr, flush=True)
    elapsed = time.monotonic() - started

    rows, verdicts = [], []
    if gil is not None:
        verdicts.append(gil["ok"])

    def judge(failure: str, trials: list[dict[str, Any]], limit: float, goal: float) -> None:
        """Two rows (workers, agents) of one failure; the goal is judged on the worst agent exit."""
        good = [r for r in trials if r["ok"]]
        failed = len(trials) - len(good)
        worst = max((r["agents_s"] for r in good), default=None)
        met = failed == 0 and worst is not None and worst <= goal
        verdicts.append(met)
        for measure, key in (("workers exited", "workers_s"), ("agents exited", "agents_s")):
            values = [r[key] for r in good]
            top = max(values, default=None)
            rows.append([
                failure if key == "workers_s" else "", measure,
                f"{len(trials)}" + (f" ({failed} FAILED)" if failed else ""), *stats(values),
                f"{limit:g}", f"{top / limit:.2f}x" if top else "-", f"{GLOO_TIMEOUT_S / top:.0f}x" if top else "-",
                f"<= {goal:g}" if key == "agents_s" else "", ("pass" if met else "FAIL") if key == "agents_s" else "",
            ])  # fmt: skip

    for name, value, goal in SETTINGS:
        if name in freeze:
            judge(f"node 2 frozen, {name}", freeze[name], value or DEFAULT_PEER_TIMEOUT_S, goal)
    if hang is not None:
        judge(f"rank 1 hung, hang_timeout_s={args.hang_timeout:g}", [hang], args.hang_timeout, HANG_GOAL_S)

    if args.json:
        print(json.dumps({
            "trials": args.trials, "hang_timeout_s": args.hang_timeout, "elapsed_s": round(elapsed, 1),
            "cpus": os.cpu_count(), "python": platform.python_version(), "gloo_timeout_s": GLOO_TIMEOUT_S,
            "freeze": freeze, "hang": hang, "gil": gil, "pass": all(verdicts),
        }, indent=2))  # fmt: skip
    else:
        print(f"silent failures, 3 torchrun nodes on 127.0.0.1 (1 worker each, gloo); {os.cpu_count()} CPUs, "
              f"{elapsed:.0f} s")  # fmt: skip
        print(table(
            ["failure, setting", "last survivor's", "trials", "min s", "median s", "max s", "timeout s (limit)",
             "max / timeout", "gloo 30 min / max", "goal s", "result"], rows,
        ))  # fmt: skip
        if gil is not None:
            outcome = "no false alarm, every worker exited 0" if gil["ok"] else "FAIL"
            print(f"node 1's worker kept its GIL {args.gil_s} s in one C call, every setting at its default "
                  f"(peer_timeout_s {DEFAULT_PEER_TIMEOUT_S:g} s): {outcome}"
                  f" (run {gil['took_s']} s, the same run without the hold {gil['baseline_s']} s: "
                  f"{gil['took_s'] - gil['baseline_s']:.1f} s more)")  # fmt: skip
        for name, trials in freeze.items():
            silences = [r["noticed_after_s"] for r in trials if r["noticed_after_s"] is not None]
            if silences:
                print(
                    f"{name}: node 2 declared lost after {min(silences):.2f} to {max(silences):.2f} s of silence "
                    f"(the ledger's noticed_after_s: from its last beat, up to one beat interval before the freeze)"
                )
        print(f"baseline without spotguard: the survivors wait in their next collective until gloo's timeout, "
              f"{GLOO_TIMEOUT_S:g} s (a constant, not measured); times from the freeze, or from rank 0's line "
              f"for step {HANG_AT - 1} for the hang")  # fmt: skip
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
