"""Ranks of real gloo process groups on 127.0.0.1 for the checkpoint tests, and what both sides share.

The tests start this file as `python tests/ckpt_workers.py SCENARIO ARGS_JSON`, one process
per rank (see `launch`); the model, data and state dumps defined here are also imported by
the tests to compute what a rank should have saved or loaded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
BIG_TENSORS = 8
BIG_NUMEL = 4 << 20  # 8 x 16 MiB of float32: a 128 MiB state


# -- shared by the tests and the workers ---------------------------------------------------------


def make_model(seed: int = 0, width: int = 32, depth: int = 3) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: range, rank: int = 0) -> None:
    """Deterministic steps: the batch depends only on (step, rank)."""
    width = next(model.parameters()).shape[1]
    for step in steps:
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, width, generator=gen)
        optim.zero_grad()
        model(x).pow(2).mean().backward()
        optim.step()


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(tree, (list, tuple)):
        out = {}
        for i, v in enumerate(tree):
            out.update(flatten(v, f"{prefix}{i}."))
        return out
    return {prefix.rstrip("."): tree.detach().clone() if isinstance(tree, torch.Tensor) else tree}


def snapshot(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state by parameter name (DDP prefix dropped), as plain values."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return flatten({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)})


def assert_same(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Bit-identical tensors, equal everything else, same keys."""
    assert actual.keys() == expected.keys(), sorted(set(actual) ^ set(expected))
    for key, want in expected.items():
        got = actual[key]
        if isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want), key
        else:
            assert got == want, (key, got, want)


def big_state(step: int) -> dict[str, torch.Tensor]:
    """A 128 MiB state whose values say which step they belong to."""
    return {f"w{i}": torch.linspace(0, 1, BIG_NUMEL) + (100 * i + step) for i in range(BIG_TENSORS)}


# -- launching ranks -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenario: str, world_size: int, **args: Any) -> list[subprocess.Popen]:
    """Start `world_size` ranks of `scenario` on one host (LOCAL_RANK = RANK)."""
    return launch_command([str(Path(__file__)), scenario, json.dumps(args)], world_size)


def launch_code(code: str, world_size: int, *argv: str) -> list[subprocess.Popen]:
    """Start `world_size` ranks of `python -c code argv...`, each a node of its own (no LOCAL_RANK)."""
    return launch_command(["-c", code, *argv], world_size, local_rank=None)


def launch_command(
    argv: list[str], world_size: int, *, local_rank: Callable[[int], int] | None = lambda rank: rank
) -> list[subprocess.Popen]:
    """`python argv...` as each rank of a gloo job on 127.0.0.1; stdout and stderr together, as text.
    LOCAL_RANK is `local_rank(rank)` (by default all ranks on one node), unset with None."""
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    env.update(PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo")
    env.update(WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    procs = []
    for rank in range(world_size):
        ranked = {**env, "RANK": str(rank), **({"LOCAL_RANK": str(local_rank(rank))} if local_rank else {})}
        procs.append(subprocess.Popen([sys.executable, *argv], env=ranked, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))  # fmt: skip
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 120) -> list[str]:
    """Wait for every rank; kill all on timeout; fail with the ranks' output unless all exited 0."""
    deadline = time.monotonic() + timeout
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, _ = proc.communicate()
            raise AssertionError(f"rank timed out after {timeout}s:\n{out[-3000:]}") from None
        outputs.append(out)
    bad = [(i, p.returncode, out) for i, (p, out) in enumerate(zip(procs, outputs, strict=True)) if p.returncode != 0]
    if bad:
        raise AssertionError("\n".join(f"rank {i} exited {rc}:\n{out[-3000:]}" for i, rc, out in bad))
    return outputs


def run_ranks(scenario: str, world_size: int, timeout: float = 120, **args: Any) -> list[str]:
    return finish(launch(scenario, world_size, **args), timeout)


def kill_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.communicate()


# -- scenarios (run inside a rank) -----------------------------------------------------------------


def _ddp_setup(seed: int, width: int, depth: int = 3):
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(make_model(seed, width, depth))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def ddp_train_save(group, rank: int, ckpt: str, local: str | None, out: str, save_at: list[int], steps: int) -> None:
    """Train a DDP model with Adam; save at `save_at`; rank 0 dumps what each save holds."""
    from spotguard.checkpoint import Checkpointer

    model, optim = _ddp_setup(seed=0, width=32)
    with Checkpointer(ckpt, local_dir=local, group=group) as ck:
        for step in range(steps):
            train(model, optim, range(step, step + 1), rank)
            if step in save_at:
                report = ck.save(step, {"model": model, "optim": optim, "step": step}, reason="periodic")
                assert report is not None and report.durable, report
                if rank == 0:
                    torch.save(snapshot(model, optim), Path(out) / f"step-{step}.pt")


class Own:
    """A rank's own value (as its RNG is), saved under a per-rank key."""

    def __init__(self, value: str) -> None:
        self.value = value

    def state_dict(self) -> dict[str, str]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, str]) -> None:
        self.value = state["value"]


def ddp_resume(group, rank: int, ckpt: str, local: str | None, out: str) -> None:
    """Resume a fresh DDP model (different init) and a rank's own value, if saved; dump what was loaded, per rank."""
    from spotguard.checkpoint import Checkpointer, IfSaved

    model, optim = _ddp_setup(seed=123, width=32)
    own = Own(f"fresh on rank {rank}")
    state = {"model": model, "optim": optim, "step": -1, f"own_{rank}": IfSaved(own)}
    with Checkpointer(ckpt, local_dir=local, group=group) as ck:
        step = ck.resume(state)
    torch.save(
        {"step": step, "saved_step": state["step"], "state": snapshot(model, optim), "own": own.value},
        Path(out) / f"resumed-rank{rank}.pt",
    )


def emergency_during_periodic(group, rank: int, ckpt: str, out: str) -> None:
    """A periodic async save is in flight when the emergency save arrives; both must commit intact."""
    from cloud_adapters.notice import INTERRUPTION, Notice, deadline_after, utc_now
    from spotguard.checkpoint import Checkpointer

    model, optim = _ddp_setup(seed=0, width=1024, depth=4)  # 16 MiB of weights, 48 MiB with Adam
    train(model, optim, range(1), rank)
    state = {"model": model, "optim": optim}
    with Checkpointer(ckpt, group=group) as ck:
        at_periodic = snapshot(model, optim)
        ck.save(5, state, reason="periodic", wait=False)
        periodic_in_flight = not (Path(ckpt) / "step-0000000005" / "spotguard.json").exists()
        train(model, optim, range(1, 2), rank)  # training goes on while the periodic save writes
        notice = Notice("aws", INTERRUPTION, "terminate", deadline_after(120), utc_now(), "test", "k1")
        report = ck.save(6, state, reason="emergency", notice=notice, deadline=notice.deadline)
    if rank == 0:
        torch.save(at_periodic, Path(out) / "step-5.pt")
        torch.save(snapshot(model, optim), Path(out) / "step-6.pt")
        (Path(out) / "report.json").write_text(
            json.dumps(
                {"periodic_in_flight": periodic_in_flight, "durable": report.durable, "margin_s": report.margin_s}
            )
        )


def big_save(group, rank: int, ckpt: str, out: str) -> None:
    """Save step 1 of a 128 MiB state, then step 2 (the test kills a rank during it)."""
    from spotguard.checkpoint import Checkpointer

    state = big_state(1)
    with Checkpointer(ckpt, group=group, write_threads=2) as ck:
        ck.save(1, state, reason="periodic")
        if rank == 0:
            (Path(out) / "step-1.done").touch()
        for tensor in state.values():
            tensor.add_(1.0)
        ck.save(2, state, reason="emergency")
        if rank == 0:
            (Path(out) / "step-2.done").touch()


def _wrapped(wrap: str, seed: int):
    """A small model wrapped in DDP or sharded with FSDP2 over all ranks, and its Adam."""
    if wrap == "ddp":
        return _ddp_setup(seed, width=32)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    model = make_model(seed, width=32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _local(snap: dict[str, Any]) -> dict[str, Any]:
    """This rank's shard of each DTensor (FSDP2), so ranks compare without collectives."""
    from torch.distributed.tensor import DTensor

    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in snap.items()}


def wrapped_round_trip(group, rank: int, ckpt: str, wrap: str) -> None:
    """Save a DDP/FSDP2 model, its Adam state and plain values, resume into fresh ones, compare on every rank."""
    from spotguard.checkpoint import Checkpointer

    model, optim = _wrapped(wrap, seed=0)
    train(model, optim, range(2), rank)
    values = {"epoch": 2, "name": "run-7", "losses": [0.5, 0.25], "config": {"lr": 0.01, "tags": ["a"]}, "raw": b"\x00"}
    with Checkpointer(ckpt, group=group) as ck:
        ck.save(2, {"model": model, "optim": optim, **values}, reason="periodic")
        fresh_model, fresh_optim = _wrapped(wrap, seed=123)
        placeholders = {"epoch": 0, "name": "", "losses": [], "config": {"lr": 0.0, "tags": []}, "raw": b""}
        state = {"model": fresh_model, "optim": fresh_optim, **placeholders}
        assert ck.resume(state) == 2
    assert {k: state[k] for k in values} == values, state
    assert_same(_local(snapshot(fresh_model, fresh_optim)), _local(snapshot(model, optim)))


def guarded_snapshots(group, rank: int, ckpt: str, snapshot_dirs: list[str], steps: int, out: str) -> None:
    """Train a DDP model under a Guard with snapshots every 2 steps, rank r's kept in `snapshot_dirs[r]`;
    resume first. Each rank writes how long its resume and its training took, and what its last
    snapshot came to (`guard.snapshots.wait()`)."""
    import dataclasses

    import spotguard

    model, optim = _ddp_setup(seed=0, width=32)
    state = {"model": model, "optim": optim}
    started = time.monotonic()
    with spotguard.Guard(
        ckpt, cloud="none", snapshot_every=2, snapshot_dir=snapshot_dirs[rank], exit_code=None
    ) as guard:
        start = guard.resume(state)
        resumed = time.monotonic()
        for step in range(start, steps):
            train(model, optim, range(step, step + 1), rank)
            guard.step(step, state)
        last = guard.snapshots.wait()
    done = {"start": start, "resume_s": resumed - started, "train_s": time.monotonic() - resumed,
            "last": last and {**dataclasses.asdict(last), "taken": last.taken}}  # fmt: skip
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(done))


def cached_plans(group, rank: int, ckpt: str, out: str) -> None:
    """Periodic saves, an emergency, then a save of a changed layout, of an FSDP2 model with Adam, each
    resumed into a fresh model and checked on every rank. Rank 0 writes which saves reused the cached
    plan, how many global plans DCP made and how many times `.metadata` was pickled."""
    from cloud_adapters.notice import INTERRUPTION, Notice, deadline_after, utc_now
    from spotguard.checkpoint import Checkpointer
    from spotguard.checkpoint.save.indexed_write import IndexedWriter
    from spotguard.checkpoint.save.plan_cache import CachedPlanner

    made, pickled = [], []
    global_plan, finish = CachedPlanner._create_global_plan, IndexedWriter.finish
    CachedPlanner._create_global_plan = lambda self, plans: made.append(1) or global_plan(self, plans)
    IndexedWriter.finish = lambda self, *args, **kwargs: pickled.append(1) or finish(self, *args, **kwargs)
    model, optim = _wrapped("fsdp2", seed=0)
    extra = torch.full((3,), float(rank))
    reused = []
    with Checkpointer(ckpt, group=group) as ck:
        for step in (1, 2, 3, 4):
            train(model, optim, range(step, step + 1), rank)
            keys = [f"extra_{rank}"] if step == 4 else []  # a layout the cached plan does not hold
            state = {"model": model, "optim": optim, **{k: extra for k in keys}}
            notice = Notice("aws", INTERRUPTION, "terminate", deadline_after(120), utc_now(), "test", "k1")
            if step == 3:
                ck.save(step, state, reason="emergency", notice=notice, deadline=notice.deadline)
            else:
                ck.save(step, state, reason="periodic")
            reused.append(ck._protocol._planner.reused)
            fresh_model, fresh_optim = _wrapped("fsdp2", seed=123)
            fresh = {"model": fresh_model, "optim": fresh_optim, **{k: torch.zeros(3) for k in keys}}
            assert ck.resume(fresh) == step
            assert_same(_local(snapshot(fresh_model, fresh_optim)), _local(snapshot(model, optim)))
            assert all(torch.equal(fresh[k], extra) for k in keys)
    if rank == 0:
        counts = {"reused": reused, "made": len(made), "pickled": len(pickled)}
        (Path(out) / "plans.json").write_text(json.dumps(counts))


def save_traffic(group, rank: int, ckpt: str, out: str, failing: int) -> None:
    """Three saves of a state with a replicated tensor and one of each rank's own: the first commits;
    in the second rank `failing`'s write fails; in the third rank 0's global plan fails. Each rank
    writes the types of what it gathered and broadcast in each save and the errors it got."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    from spotguard.checkpoint import Checkpointer
    from spotguard.checkpoint.comm import Comm
    from spotguard.checkpoint.save.plan_cache import CachedPlanner

    traffic: list[tuple[str, str]] = []

    def traced(name: str, collective: Callable[..., Any], payload: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            done = collective(*args, **kwargs)
            traffic.append((name, type(payload(*args, **kwargs)).__name__))
            return done

        return call

    Comm.gather = traced("gather", Comm.gather, lambda comm, obj: obj)  # type: ignore[method-assign]
    dist.broadcast_object_list = traced(
        "broadcast", dist.broadcast_object_list, lambda *a, **k: (a[0] if a else k["object_list"])[0]
    )
    state = {"shared": torch.arange(6.0), f"own_{rank}": torch.full((4,), float(rank))}
    saves: list[dict[str, Any]] = []
    with Checkpointer(ckpt, group=group) as ck:
        for step in (1, 2, 3):
            if step == 2 and rank == failing:
                FileSystemWriter.write_data = _raising(OSError("disk gone"))
            if step == 3 and rank == 0:
                CachedPlanner.create_global_plan = _raising(ValueError("bad plan"))
            traffic.clear()
            try:
                ck.save(step, state, reason="periodic")
                error = None
            except Exception as exc:
                error = str(exc)
            saves.append({"error": error, "traffic": list(traffic)})
    (Path(out) / f"saves-{rank}.json").write_text(json.dumps(saves))


def _raising(exc: Exception) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return call


def reshard_layout_fails(group, rank: int, snapshot_dir: str, out: str) -> None:
    """A reshard (a snapshot of 3 ranks, loaded by 2) in which rank 1 cannot lay its state out: every rank
    must come back from the exchange with the problem, none left waiting in its collectives."""
    from spotguard.checkpoint.comm import Comm
    from spotguard.snapshots.loading import PlanLoader
    from spotguard.snapshots.node_dir import NodeDir
    from spotguard.snapshots.recovery import Plan

    def live() -> dict[str, Any]:
        if rank == 1:
            raise RuntimeError("injected: no layout")
        return {"w": torch.zeros(4)}

    loader = PlanLoader(Comm(group), NodeDir(snapshot_dir, "run"), 1, lambda r: "", live, [])
    indexes, problems = loader._indexes(Plan(step=1, attempt="a", world_size=3, holders=((0,), (1,), (0,))))
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({"indexes": indexes, "problems": [p.why for p in problems]}))


def kept_load(group, rank: int, steps: list[int | None]) -> None:
    """In-process recovery's load from memory: rank r kept its state at steps[r] (None: nothing kept) and loads
    it into new objects; prints the step loaded and whether the weights are the kept ones."""
    from spotguard.checkpoint.comm import Comm
    from spotguard.wiring.kept import Kept, keep, load_kept

    old, new = make_model(seed=0, width=8), make_model(seed=1, width=8)
    kept = keep(steps[rank], {"model": old}) if steps[rank] is not None else Kept()
    loaded = load_kept(kept, {"model": new}, Comm(group))
    same = all(torch.equal(a, b) for a, b in zip(old.state_dict().values(), new.state_dict().values()))
    print(f"RESULT loaded={loaded} same={same}", flush=True)


def comm_gather(group, rank: int, sizes: list[int]) -> None:
    """Comm.gather of objects of `sizes` bytes, with any all-gather refused (torch's gather_object all-gathers
    the sizes in a ring through every rank), beside a message of the group's user from rank 1 to rank 0; rank 0
    prints what it got, each rank once its gather returned."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from spotguard.checkpoint.comm import Comm

    def no_ring(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("an all-gather in a gather")

    c10d.all_gather = no_ring
    mine = {"rank": rank, "blob": bytes([rank]) * sizes[rank]}
    theirs = torch.zeros(4)  # a user's own message on the same group, tag 0, posted before the gather
    pending = dist.irecv(theirs, src=1, group=group) if rank == 0 else None
    got = Comm(group).gather(mine)
    if rank == 1:
        dist.send(torch.arange(4.0), dst=0, group=group)
    if got is not None:
        pending.wait()
        described = [(g["rank"], len(g["blob"]), set(g["blob"]) <= {g["rank"]}) for g in got]
        print(f"RESULT {described} copy={got[0] is not mine} theirs={theirs.tolist()}", flush=True)
    print(f"RESULT rank {rank} gathered={got is not None}", flush=True)


def comm_scatter(group, rank: int, sizes: list[int]) -> None:
    """Comm.scatter from rank 0 of objects of `sizes` bytes, with any broadcast refused (torch's
    scatter_object_list broadcasts the largest size and pads every object to it), beside a message of the
    group's user from rank 0 to rank 2; each rank prints what it got."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from spotguard.checkpoint.comm import Comm

    def no_broadcast(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a broadcast in a scatter")

    c10d.broadcast = no_broadcast
    objs = [{"rank": r, "blob": bytes([r]) * n} for r, n in enumerate(sizes)]
    theirs = torch.zeros(4)  # a user's own message on the same group, tag 0, posted before the scatter
    pending = dist.irecv(theirs, src=0, group=group) if rank == 2 else None
    got = Comm(group).scatter(objs if rank == 0 else None)
    if rank == 0:
        dist.send(torch.arange(4.0), dst=2, group=group)
        print(f"RESULT copy={got is not objs[0] and got == objs[0]}", flush=True)
    if pending is not None:
        pending.wait()
    print(f"RESULT rank {rank} got {(got['rank'], len(got['blob']), set(got['blob']) <= {rank})} "
          f"theirs={theirs.tolist() if rank == 2 else None}", flush=True)  # fmt: skip


SCENARIOS = {
    f.__name__: f
    for f in (
        ddp_train_save,
        ddp_resume,
        emergency_during_periodic,
        big_save,
        wrapped_round_trip,
        guarded_snapshots,
        cached_plans,
        save_traffic,
        reshard_layout_fails,
        kept_load,
        comm_gather,
        comm_scatter,
    )
}


def main() -> None:
    import torch.distributed as dist

    scenario, args = sys.argv[1], json.loads(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))  # as the Guard does
    try:
        SCENARIOS[scenario](group, dist.get_rank(), **args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
