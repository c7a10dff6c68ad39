"""Coordination at scale: N ranks, one store server, one interruption. How long until every rank
knows the agreed step, and what does it cost the store?

N ranks run as threads spread over a few processes around one real TCPStore server (the default
libuv one, as torchrun hosts it, in a process of its own). Each rank is a real `Guard` with a stated
topology (`store=`, `rank=`, `world_size=`, `local_rank=`, `node=`; 8 ranks per node): its listener,
its agreement and the node claim, with no process group, so no save (the other benchmarks measure
saves; here the save at the agreed step fails at once for want of a process group). Each rank's
training loop is a sleep of `--step-ms` (default: 0.1 ms per rank, 10 ms at least, so that the
simulation leaves the two cores mostly idle) and `guard.step()`.

Per trial: the Guards enter and train; the store's requests are counted over an idle window; then
one round, timed from the rank timelines (one host, one clock):
- interruption: node N/8-1's leader gets a spot interruption from its AWS metadata emulator
  (polled every 0.2 s); from its "notice" entry to the last rank's "agreed" entry;
- request: rank 0 calls `guard.request_checkpoint()`; from its "save-requested" entry to the last
  "agreed" entry.
Every rank must agree on one step, and must then stop at it (interruption) or train on (request).

Requests are counted by a wrapping store in every rank (`tests/counting.py`; a TCPStore `get` is
two requests on the server: a wait, then the read) and checked against the server process's CPU
time. Each rank's connections (its own, and the three its Guard clones at start: listener, publishing,
meeting place; and the liveness ring's on a node's local rank 0) are made before the trials, in
parallel: the TCPStore server looks up the name of each new connection's peer, and this host's
resolver stalls 5 s now and then. The baseline,
measured in the same run: the store's fan-out floor, one `set` waking N ranks blocked in a `get`
on the same processes and connections: no protocol in which every rank learns of the notice
through the store can be faster.

The liveness ring (spotguard.health.liveness: one member per node, its local rank 0; LOCAL_WORLD_SIZE
is set to 8 in the worker processes, as torchrun would, so 1,024 ranks make 128 members) beats node to
node over TCP, not through the store. Its store requests (keys with `health/`, told apart by a tap
under the counting wrapper) are given per node: per second over the idle window (goal <= 1 at 1,024
ranks), from the guards' entry to the idle window (its one-time set-up: the address set, the watched
node's address read), and over the whole trial.

    python bench/scale.py [--ranks 16,64,128,256,512,1024] [--trials 5] [--procs 4 | --ranks-per-proc 64]
                          [--json] [--plot FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

from _common import table  # also puts the checkout on sys.path

from tests.counting import Counts, counting_store, server_requests  # noqa: E402

RANKS_PER_NODE = 8
GUARD_CLONES = 3  # the connections a Guard clones at start: its listener's, its publishing one, its meeting place's


def guard_clones(rank: int) -> int:
    """The connections rank's Guard clones at start; a node's local rank 0, a liveness ring member, one more."""
    return GUARD_CLONES + (rank % RANKS_PER_NODE == 0)


HEALTH_KEY = "health/"  # the liveness ring's keys (spotguard.health): counted apart
IDLE_S = 3.0  # the idle window over which an idle guard's requests are counted
SERVER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(minutes=5))
print(store.port, flush=True)
sys.stdin.read()  # until the parent closes it
"""


# -- a worker process: some of the ranks -----------------------------------------------------


def liveness_tap(inner: Any, counts: Counts) -> Any:
    """`inner`, counting into `counts` the calls on keys of the liveness ring (`health/` in the key),
    as tests/counting.py counts every call (it keeps no keys); its clones are tapped too. It sits
    under the counting wrapper, so both see the same calls."""
    import torch.distributed as dist

    def ours(*keys: str) -> bool:
        return any(HEALTH_KEY in key for key in keys)

    class Tap(dist.Store):
        def __init__(self, store: Any) -> None:
            super().__init__()
            self.inner = store

        def clone(self) -> Any:
            clone = self.inner.clone()
            return self if clone is self.inner else Tap(clone)

        def set_timeout(self, timeout: timedelta) -> None:
            self.inner.set_timeout(timeout)

        def set(self, key: str, value: Any) -> None:
            if ours(key):
                counts.add("set")
            self.inner.set(key, value)

        def get(self, key: str) -> bytes:
            if ours(key):
                counts.add("get")
            return self.inner.get(key)

        def add(self, key: str, value: int) -> int:
            if ours(key):
                counts.add("add")
            return self.inner.add(key, value)

        def append(self, key: str, value: Any) -> None:
            if ours(key):
                counts.add("append")
            self.inner.append(key, value)

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            if ours(key):
                counts.add("compare_set")
            return self.inner.compare_set(key, expected, desired)

        def check(self, keys: list[str]) -> bool:
            if ours(*keys):
                counts.add("check")
            return self.inner.check(keys)

        def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
            if ours(*keys):
                counts.add("wait")
            self.inner.wait(keys, timeout) if timeout is not None else self.inner.wait(keys)

        def delete_key(self, key: str) -> bool:
            if ours(key):
                counts.add("delete_key")
            return self.inner.delete_key(key)

    return Tap(inner)


class Rank:
    def __init__(self, guard: Any, step_s: float) -> None:
        self.guard = guard
        self.step_s = step_s
        self.stop = threading.Event()
        self.acted_at: int | None = None  # the step at which guard.step() returned True
        self.steps = 0
        self.thread = threading.Thread(target=self.train, daemon=True)

    def train(self) -> None:
        step = 0
        while not self.stop.is_set():
            time.sleep(self.step_s)
            if self.guard.step(step, {}):
                self.acted_at = step
                return
            step += 1
            self.steps = step


class Worker:
    """Some of the ranks, in one process: their connections, Guards and training loops."""

    def __init__(self, ranks: list[int], world: int, port: int) -> None:
        import torch.distributed as dist

        from cloud_adapters.aws.emulator import AWSMetadataEmulator

        self.ranks, self.world = ranks, world
        self.counts = Counts()
        self.health = Counts()  # the liveness ring's share of `counts`
        base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(minutes=5))
        with ThreadPoolExecutor(64) as connecting:  # in parallel: a new connection can stall 5 s on this host
            made = connecting.map(lambda r: tuple(base.clone() for _ in range(1 + guard_clones(r))), ranks)
            self.connections = dict(zip(ranks, made))
        self.doomed_leader = world - RANKS_PER_NODE
        self.emulator = AWSMetadataEmulator() if self.doomed_leader in ranks else None
        if self.emulator is not None:
            self.emulator.start()
        # One job, one checkpoint_dir on every rank (it keys the guards in the store); nothing is saved in it.
        self.checkpoint_dir = os.path.join(tempfile.gettempdir(), f"spotguard-scale-{port}")
        self.current: list[Rank] = []

    def enter(self, prefix: str, step_s: float) -> str:
        entering = threading.Thread(target=self._enter_all, args=(prefix, step_s))
        entering.start()  # off the main thread: the Guards install no signal handlers
        entering.join()
        return "entered"

    def _enter_all(self, prefix: str, step_s: float) -> None:
        import torch.distributed as dist

        import spotguard

        self.current = []
        for rank in self.ranks:
            doomed = rank == self.doomed_leader
            own, *spares = (dist.PrefixStore(prefix, c) for c in self.connections[rank])
            guard = spotguard.Guard(
                self.checkpoint_dir,
                cloud="aws" if doomed else "none",
                metadata_url=self.emulator.url if doomed else None,
                poll_interval_s=0.2,
                store=counting_store(
                    liveness_tap(own, self.health), self.counts, spares=[liveness_tap(s, self.health) for s in spares]
                ),
                rank=rank,
                world_size=self.world,
                local_rank=rank % RANKS_PER_NODE,
                node=f"node-{rank // RANKS_PER_NODE}",
                exit_code=None,
            )
            guard.start()
            self.current.append(Rank(guard, step_s))

    def train(self) -> str:
        for r in self.current:
            r.thread.start()
        return "training"

    def agreed(self, kind: str) -> dict[int, dict[str, Any]]:
        """Per rank: when it knew the agreed step of the round, which step, when the round began
        (on the rank that began it), and the step its loop acted at."""
        on, began = ("emergency", "notice") if kind == "interruption" else ("checkpoint", "save-requested")
        out = {}
        for rank, r in zip(self.ranks, self.current):
            agreed = [e for e in r.guard.timeline.entries if e.event == "agreed" and e.detail["on"] == on]
            start = [e for e in r.guard.timeline.entries if e.event == began]
            out[rank] = {
                "agreed_at": agreed[-1].at.timestamp() if agreed else None,
                "step": agreed[-1].detail["step"] if agreed else None,
                "start_at": start[-1].at.timestamp() if start else None,
                "acted_at": r.acted_at,
            }
        return out

    def leave(self, kind: str) -> dict[int, dict[str, Any]]:
        """Let the loops reach the agreed step (an interruption ends them), stop them, leave the
        Guards; then `agreed()` as it ended."""
        if kind == "interruption":
            for r in self.current:
                r.thread.join(60)
        for r in self.current:
            r.stop.set()
        for r in self.current:
            r.thread.join()
        ended = self.agreed(kind)
        # Ring members that knew their watched node's address (private attributes: the bench checks the ring
        # formed; a guard without its health monitor is an error here, not a silent 0).
        rings = [r.guard._health.monitor.liveness for r in self.current]
        watching = sum(1 for ring in rings if ring is not None and ring.watched)
        for rank in ended:
            ended[rank]["watching"] = 0
        if self.ranks:
            ended[self.ranks[0]]["watching"] = watching
        for r in self.current:
            r.guard.close()
        if self.emulator is not None:
            self.emulator.clear()  # the next trial's guards start without a notice
        return ended

    def floor(self, key: str, pipe: Any) -> dict[int, float]:
        """Every rank blocks in a get of `key` on its own connection until the parent sets it."""
        times: dict[int, float] = {}

        def blocked(rank: int) -> None:
            self.connections[rank][1].get(key)
            times[rank] = time.time()

        threads = [threading.Thread(target=blocked, args=(r,), daemon=True) for r in self.ranks]
        for t in threads:
            t.start()
        pipe.send("waiting")
        for t in threads:
            t.join()
        return times


def worker(pipe: Any, ranks: list[int], world: int, port: int) -> None:
    # torchrun's LOCAL_WORLD_SIZE, which spotguard reads for the ranks per node (topology.ranks_per_node()):
    # the liveness ring has one member per node (its local rank 0), 1,024 ranks make 128 members.
    os.environ["LOCAL_WORLD_SIZE"] = str(RANKS_PER_NODE)
    logging.disable(logging.CRITICAL)  # a failed save per rank per round (no process group): expected here
    warnings.simplefilter("ignore")  # "Guard entered outside the main thread: signals are not watched"
    w = Worker(ranks, world, port)
    while True:
        command, arg = pipe.recv()
        if command == "connected":
            pipe.send("yes")
        elif command == "enter":
            pipe.send(w.enter(*arg))
        elif command == "train":
            pipe.send(w.train())
        elif command == "counts":
            pipe.send(w.counts.snapshot())
        elif command == "health":
            pipe.send(w.health.snapshot())
        elif command == "interrupt":
            w.emulator.raise_notice(kind="interruption")
            pipe.send("raised")
        elif command == "request":
            w.current[0].guard.request_checkpoint("manual")
            pipe.send("requested")
        elif command == "agreed":
            pipe.send(w.agreed(arg))
        elif command == "leave":
            pipe.send(w.leave(arg))
        elif command == "floor":
            pipe.send(w.floor(arg, pipe))
        elif command == "quit":
            if w.emulator is not None:
                w.emulator.stop()
            pipe.send("bye")
            return


# -- the parent ------------------------------------------------------------------------------


class Job:
    """`world` ranks over `procs` worker processes, for several trials."""

    def __init__(self, world: int, procs: int, port: int) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.pipes, self.procs, self.owner = [], [], {}
        for i in range(procs):
            ranks = list(range(i, world, procs))
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker, args=(child, ranks, world, port), daemon=True)
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)
            for r in ranks:
                self.owner[r] = i
        self.all("connected", timeout_s=600)

    def all(self, command: str, arg: Any = None, timeout_s: float = 300.0) -> list[Any]:
        for pipe in self.pipes:
            pipe.send((command, arg))
        return [self._recv(pipe, timeout_s) for pipe in self.pipes]

    def one(self, rank: int, command: str, arg: Any = None) -> Any:
        pipe = self.pipes[self.owner[rank]]
        pipe.send((command, arg))
        return self._recv(pipe, 60.0)

    @staticmethod
    def _recv(pipe: Any, timeout_s: float) -> Any:
        if not pipe.poll(timeout_s):
            raise TimeoutError("a worker did not answer")
        return pipe.recv()

    def cpu_s(self) -> float:
        """CPU time of the worker processes so far."""
        return sum(cpu_s(proc.pid) for proc in self.procs)

    def counts(self, which: str = "counts") -> dict[str, int]:
        total: collections.Counter[str] = collections.Counter()
        for c in self.all(which):
            total.update(c)
        return dict(total)

    def close(self) -> None:
        try:
            self.all("quit", timeout_s=30)
        finally:
            for proc in self.procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()


def diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) - before.get(k, 0)}


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def trial(job: Job, server_pid: int, name: str, kind: str, step_s: float) -> dict[str, Any]:
    world = job.world
    health_start = job.counts("health")
    job.all("enter", (f"{name}/", step_s))
    job.all("train")
    time.sleep(0.5)
    idle_before, busy_before, health_before = job.counts(), job.cpu_s(), job.counts("health")
    time.sleep(IDLE_S)
    idle, busy = diff(job.counts(), idle_before), (job.cpu_s() - busy_before) / IDLE_S / os.cpu_count()
    health_idle = diff(job.counts("health"), health_before)
    health_setup = diff(health_before, health_start)
    before, cpu_before = job.counts(), cpu_s(server_pid)
    if kind == "interruption":
        job.one(world - RANKS_PER_NODE, "interrupt")
    else:
        job.one(0, "request")
    # Until every rank knows the agreed step (or the round's timeouts are long past). Looking costs the
    # workers' CPU, so the first look comes after the round is expected to be over.
    deadline, pause = time.monotonic() + 120, 1.0 + world / 1000
    while True:
        time.sleep(pause)
        if all(v["agreed_at"] is not None for part in job.all("agreed", kind) for v in part.values()):
            break
        if time.monotonic() > deadline:
            break
        pause = 0.5
    time.sleep(0.3)  # the deciding rank's clean-up
    round_calls, cpu = diff(job.counts(), before), cpu_s(server_pid) - cpu_before
    ranks = {int(r): v for part in job.all("leave", kind) for r, v in part.items()}
    health_trial = diff(job.counts("health"), health_start)
    nodes = max(1, world // RANKS_PER_NODE)
    start = min(v["start_at"] for v in ranks.values() if v["start_at"] is not None)
    known = [v["agreed_at"] for v in ranks.values()]
    steps = {v["step"] for v in ranks.values()}
    acted = {v["acted_at"] for v in ranks.values()}
    return {
        "ranks": world,
        "kind": kind,
        "all_knew": all(k is not None for k in known),
        "seconds": max(known) - start if all(k is not None for k in known) else None,
        "one_step": len(steps) == 1 and None not in steps,
        "acted_ok": acted == (steps if kind == "interruption" else {None}),
        "round_requests": server_requests(round_calls),
        "round_calls": round_calls,
        "server_cpu_s": cpu,
        "idle_requests_per_rank_per_10s": server_requests(idle) / world / IDLE_S * 10,
        "simulation_load": busy,  # the workers' CPU while idle, as a share of this machine's cores
        # The liveness ring (one member per node; beats go node to node, not through the store): its
        # requests per node per second over the idle window, per node from the guards' entry to the
        # idle window (its set-up), and per node over the whole trial (the round and the exit included).
        "liveness_idle_requests_per_node_per_s": server_requests(health_idle) / nodes / IDLE_S,
        "liveness_setup_requests_per_node": server_requests(health_setup) / nodes,
        "liveness_trial_requests_per_node": server_requests(health_trial) / nodes,
        "liveness_trial_calls": health_trial,
        "ring_watching": sum(v["watching"] for v in ranks.values()),  # members that found their watched node
    }


def fan_out_floor(job: Job, base: Any, key: str) -> float:
    for pipe in job.pipes:
        pipe.send(("floor", key))
    for pipe in job.pipes:
        assert job._recv(pipe, 60) == "waiting"
    time.sleep(1.0)  # every get is on the server
    sent = time.time()
    base.set(key, "go")
    times = [t for pipe in job.pipes for t in job._recv(pipe, 120).values()]
    return max(times) - sent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="16,64,128,256,512,1024")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument(
        "--ranks-per-proc", type=int, default=None,
        help="instead of --procs: this many ranks (threads) per process, processes added as N grows",
    )  # fmt: skip
    parser.add_argument("--step-ms", type=float, default=None, help="fake step (default: 0.1 ms per rank, >= 10)")
    parser.add_argument("--kinds", default="interruption,request")
    parser.add_argument("--json", action="store_true", help="one JSON document with every trial")
    parser.add_argument("--plot", default=None, help="draw the curve into this PNG (needs matplotlib)")
    args = parser.parse_args()
    import torch.distributed as dist

    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    port = int(server.stdout.readline())
    base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(minutes=5))
    results: list[dict[str, Any]] = []
    floors: dict[int, list[float]] = {}
    try:
        for world in [int(n) for n in args.ranks.split(",")]:
            step_s = (args.step_ms or max(10.0, 0.1 * world)) / 1000
            procs = -(-world // args.ranks_per_proc) if args.ranks_per_proc else args.procs
            job = Job(world, min(procs, world), port)
            try:
                floors[world] = [fan_out_floor(job, base, f"floor/{world}/{t}") for t in range(args.trials)]
                for kind in args.kinds.split(","):
                    for t in range(args.trials):
                        row = trial(job, server.pid, f"n{world}/{kind}/{t}", kind, step_s)
                        results.append(row)
                        print(json.dumps(row), file=sys.stderr, flush=True)
            finally:
                job.close()
    finally:
        server.stdin.close()
        server.wait(10)
    print_report(results, floors, args)
    return 0 if all(r["all_knew"] and r["one_step"] and r["acted_ok"] for r in results) else 1


def print_report(results: list[dict[str, Any]], floors: dict[int, list[float]], args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps({"trials": results, "fan_out_floor_s": floors}))
        return
    rows = []
    for (world, kind), group in sorted(collections.defaultdict(list, _group(results)).items()):
        times = [r["seconds"] for r in group if r["seconds"] is not None]
        floor = statistics.median(floors[world])
        per_rank = [r["round_requests"] / world for r in group]
        rows.append([
            world, kind, len(group),
            f"{statistics.median(times):.3f}" if times else "-", f"{max(times):.3f}" if times else "-",
            f"{floor:.3f}", f"{statistics.median(times) / floor:.1f}x" if times else "-",
            "yes" if all(r["one_step"] and r["acted_ok"] for r in group) else "NO",
            f"{statistics.median(per_rank):.2f}", int(statistics.median(r["round_requests"] for r in group)),
            f"{statistics.median(r['server_cpu_s'] for r in group):.2f}",
            f"{statistics.median(r['idle_requests_per_rank_per_10s'] for r in group):.3f}",
            f"{statistics.median(r['simulation_load'] for r in group):.0%}",
            f"{max(r['liveness_idle_requests_per_node_per_s'] for r in group):.3f}",
            f"{max(r['liveness_setup_requests_per_node'] for r in group):.2f}",
            f"{max(r['liveness_trial_requests_per_node'] for r in group):.2f}",
            f"{min(r['ring_watching'] for r in group)}/{world // RANKS_PER_NODE}",
        ])  # fmt: skip
    print(table(
        ["ranks", "round", "trials", "median s", "max s", "fan-out floor s", "median / floor", "one step, all",
         "requests per rank", "server requests", "server CPU s", "idle req / rank / 10 s", "simulation load",
         "liveness idle req / node / s", "liveness set-up req / node", "liveness req / node, whole trial",
         "ring members watching"], rows,
    ))  # fmt: skip
    worst = max((r["liveness_idle_requests_per_node_per_s"] for r in results if r["ranks"] >= 1024), default=None)
    if worst is not None:
        print(
            f"liveness ring at >= 1,024 ranks: at most {worst:.3f} store requests per node per second while idle "
            f"(goal <= 1); ring members: one per node of {RANKS_PER_NODE} ranks (LOCAL_WORLD_SIZE)"
        )
    for kind in ("interruption", "request"):
        by_n = _median_time(results, kind)
        if 128 in by_n and 1024 in by_n:
            print(f"{kind}: 1024 ranks / 128 ranks = {by_n[1024] / by_n[128]:.1f}x the time (goal <= 8x)")
    if args.plot:
        plot(results, floors, args.plot)


def _group(results: list[dict[str, Any]]) -> dict[tuple[int, str], list[dict[str, Any]]]:
    out: dict[tuple[int, str], list[dict[str, Any]]] = collections.defaultdict(list)
    for r in results:
        out[(r["ranks"], r["kind"])].append(r)
    return out


def _median_time(results: list[dict[str, Any]], kind: str) -> dict[int, float]:
    out = {}
    for (world, k), group in _group(results).items():
        times = [r["seconds"] for r in group if r["seconds"] is not None]
        if k == kind and times:
            out[world] = statistics.median(times)
    return out


def plot(results: list[dict[str, Any]], floors: dict[int, list[float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for kind, marker in (("interruption", "o"), ("request", "s")):
        by_n = _median_time(results, kind)
        if by_n:
            ax.plot(
                sorted(by_n),
                [by_n[n] for n in sorted(by_n)],
                marker=marker,
                label=f"{kind}: notice -> all ranks agreed",
            )
    ns = sorted(floors)
    ax.plot(ns, [statistics.median(floors[n]) for n in ns], linestyle="--", color="grey", label="store fan-out floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks (threads over processes, one TCPStore)")
    ax.set_ylabel("seconds (median)")
    ax.set_title("spotguard coordination at scale (2-core VM)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
