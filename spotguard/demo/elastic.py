"""`spotguard demo --elastic`: two nodes on this host train under torchrun's elastic agent
(`--nnodes 1:2 --rdzv-backend c10d`, spotguard.demo.localnodes); node 1 is reclaimed through its AWS
metadata emulator, node 0 trains on alone from the committed step, then a replacement node joins and
the job grows back. The check (exit 0 only when it holds): every step trained once, by every rank
of one world; every sample of an epoch consumed once, in the epoch's global order
(spotguard.data); the final weights equal those of uninterrupted static runs that follow the same
world-size schedule.

Each node's worker is this module (`torchrun --module spotguard.demo.elastic`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path

STEPS = 50
STEP_S = 0.2  # long enough that the replacement's agent starts while node 0 trains alone
DATASET, BATCH = 100, 4
WORKER = ["--module", "spotguard.demo.elastic"]


class CheckFailed(RuntimeError):
    pass


# ---- the checks (also used by tests/test_elastic.py) --------------------------------
def step_lines(lines: list[str]) -> list[dict]:
    """Every rank's per-step records among a node's output lines."""
    return [json.loads(line) for line in lines if line.startswith('{"step"')]


def check_steps(records: list[dict], steps: int) -> list[int]:
    """Each step trained exactly once, by every rank of one world; the world size of each step."""
    by_step = defaultdict(list)
    for r in records:
        by_step[r["step"]].append((r["rank"], r["world"]))
    if sorted(by_step) != list(range(steps)):
        missing = sorted(set(range(steps)) - set(by_step))
        raise CheckFailed(f"steps lost: {missing}, or beyond the last: {sorted(set(by_step) - set(range(steps)))}")
    worlds = []
    for step, seen in sorted(by_step.items()):
        world = seen[0][1]
        if sorted(seen) != [(r, world) for r in range(world)]:
            raise CheckFailed(f"step {step} repeated or trained by part of a world: (rank, world) {sorted(seen)}")
        worlds.append(world)
    return worlds


def check_samples(records: list[dict], size: int, batch: int, seed: int = 0) -> None:
    """The job's samples, in step and rank order, are each epoch's global order: none repeated or
    skipped, but a finished epoch's tail shorter than one global batch."""
    from spotguard.data import ResumableSampler

    by_epoch = defaultdict(list)
    for r in sorted(records, key=lambda r: (r["step"], r["rank"])):
        by_epoch[r["epoch"]].extend(r["samples"])
    for epoch, got in by_epoch.items():
        order = ResumableSampler(size, batch, seed=seed, world_size=1)
        order.set_epoch(epoch)
        if got != order.order()[: len(got)]:
            raise CheckFailed(f"epoch {epoch}: a sample repeated, skipped or out of order")
        worlds = {r["world"] for r in records if r["epoch"] == epoch}
        if epoch < max(by_epoch) and size - len(got) >= max(worlds) * batch:
            raise CheckFailed(f"epoch {epoch} ended with {size - len(got)} samples unused")


def spans(worlds: list[int]) -> list[tuple[int, int]]:
    """(world size, last step) of each run of steps at one world size."""
    out: list[tuple[int, int]] = []
    for step, world in enumerate(worlds):
        if out and out[-1][0] == world:
            out[-1] = (world, step)
        else:
            out.append((world, step))
    return out


# ---- the demo -------------------------------------------------------------------------
def run_elastic_demo(directory: str | None = None) -> int:
    """Run the demo in `directory` (kept), or in a temporary directory removed at the end; 0 when
    its check passed, else 1 with what failed."""
    from spotguard.demo.localnodes import LocalNodeError

    try:
        if directory is not None:
            return _demo(Path(directory))
        with tempfile.TemporaryDirectory(prefix="spotguard-elastic-demo-", ignore_cleanup_errors=True) as scratch:
            return _demo(Path(scratch))
    except (CheckFailed, LocalNodeError) as exc:
        _say(f"CHECK FAILED: {exc}")
        return 1


def _say(text: str) -> None:
    print(text, flush=True)


def _demo(work: Path) -> int:
    from spotguard.demo.localnodes import Rendezvous, run_nodes, stop_all

    started = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    ckpt, out = work / "ckpt", work / "out.json"
    args = ["--steps", str(STEPS), "--out", str(out)]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH")]))}  # fmt: skip
    _say(f"spotguard demo --elastic: torchrun --nnodes 1:2 --rdzv-backend c10d, {STEPS} steps, in {work}")
    rdzv = Rendezvous("1:2", max_restarts=3, script=WORKER, env=env)
    nodes = [rdzv.join(0, str(ckpt), work, args), rdzv.join(1, str(ckpt), work, args)]
    try:
        nodes[0].wait_for(r'"step": 3, "rank": 0, "world": 2', timeout=180)
        _say("  2 nodes training; node 1's emulator raises a spot interruption")
        nodes[1].emulator.raise_notice()
        nodes[1].finish(90)
        nodes[1].kill()  # its agent has left the job; now its VM vanishes
        nodes[0].wait_for(r'"rank": 0, "world": 1,', timeout=120)
        _say("  node 0 trains on alone; a replacement node joins")
        time.sleep(1)
        nodes.append(rdzv.join(2, str(ckpt), work, args))
        codes = [nodes[0].finish(300), nodes[2].finish(120)]
    finally:
        stop_all(nodes)
    _say("  timeline of node 0 (rank 0 of every round):")
    for line in nodes[0].lines:
        if re.search(r"timeline: .*(notice|agreed|committed|resumed|fresh-start) ", line):
            _say("    " + line.split("timeline: ", 1)[1])
    records = [r for node in nodes for r in step_lines(node.lines)]
    if codes != [0, 0]:
        raise CheckFailed(f"nodes 0 and 2 ended with {codes}:\n{nodes[0].tail()}\n{nodes[2].tail()}")
    schedule = spans(check_steps(records, STEPS))
    check_samples(records, DATASET, BATCH)
    _say("  world size by step: " + ", ".join(f"{w} up to step {last}" for w, last in schedule))
    if [w for w, _ in schedule] != [2, 1, 2]:
        raise CheckFailed(f"expected 2 nodes, then 1, then 2; got {schedule}")
    _say("  every step trained once by every rank of its world; every sample of an epoch used once, in order")
    _say("reference: static runs with the same world-size schedule, each saved at its last step")
    ref = work / "reference"
    for world, last in schedule[:-1]:
        run_nodes(world, WORKER, ref / "ckpt", ref, ["--steps", str(last + 1), "--save-final"], env=env)
    expected = run_nodes(schedule[-1][0], WORKER, ref / "ckpt", ref, ["--steps", str(STEPS)], ref / "out.json", env)
    got = json.loads(out.read_text())["digest"]
    same = got == expected["digest"]
    verdict = "YES" if same else "NO"
    _say(f"final weights identical to the reference: {verdict} ({got[:16]}... vs {expected['digest'][:16]}...)")
    _say(f"demo finished in {time.monotonic() - started:.1f} s")
    return 0 if same else 1


# ---- one rank ---------------------------------------------------------------------------
def _worker() -> None:
    import logging

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import spotguard
    from spotguard.checkpoint import state_digest
    from spotguard.data import ResumableBatchSampler

    parser = argparse.ArgumentParser()
    for flag in ("--checkpoint-dir", "--local-dir", "--cloud", "--out"):
        parser.add_argument(flag)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-final", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    ddp = DDP(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    inputs = torch.randn(DATASET, 16, generator=torch.Generator().manual_seed(1))  # sample i: row i
    sampler = ResumableBatchSampler(DATASET, BATCH)
    state = {"model": ddp, "optim": optimizer, "data": sampler}
    with spotguard.Guard(args.checkpoint_dir, cloud=args.cloud, local_dir=args.local_dir) as guard:
        step = start = guard.resume(state)
        while step < args.steps:
            for index in sampler:
                x = inputs[index]
                loss = F.mse_loss(ddp(x), x.sum(dim=1, keepdim=True))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                sampler.advance()
                line = {"step": step, "rank": rank, "world": world, "epoch": sampler.epoch, "samples": index}
                print(json.dumps(line), flush=True)
                time.sleep(STEP_S)
                if guard.step(step, state):
                    return
                step += 1
                if step == args.steps:
                    break
            else:
                sampler.set_epoch(sampler.epoch + 1)
        if args.save_final and start < args.steps:
            guard.save(args.steps - 1, state)
        weights = state_digest(model.state_dict())
        if rank == 0 and args.out:
            Path(args.out).write_text(json.dumps({"start": start, "digest": weights}))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker()
