"""A DDP (or FSDP2) training script that survives spot interruptions, launched with torchrun:

    torchrun --nproc-per-node=2 examples/train_ddp.py --checkpoint-dir s3://bucket/run-7 --steps 1000

On several nodes, each node runs the same command with its own node rank, e.g.
`torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr HOST --master-port 29500 ...`;
when one node is reclaimed, the others commit the checkpoint without it. Elastic (see the README's
"Elastic training"): `torchrun --nnodes 1:2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT --max-restarts 8 ...`
with `--dataset N`, and the survivors train on at the smaller world size with the same data order.

Start it again after an interruption (same command) and it resumes from the newest
committed checkpoint. With --in-process the survivors of a departure do not even restart: they go on in
their processes at the smaller world size (spotguard.run), and a replacement node joins them without a
restart: run the same command with `torchrun --standalone` and SPOTGUARD_JOIN=HOST:PORT (the job's
--master-addr and --master-port). Deterministic on CPU: the data of a step depends only on
the step and the rank (with --dataset: on the global position of a ResumableSampler, whatever the
world size), so an interrupted-and-resumed run ends with the same weights as one that never stopped.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import spotguard
from spotguard.checkpoint import state_digest
from spotguard.data import ResumableBatchSampler


def build_model(hidden: int = 256, *, empty: bool = False) -> torch.nn.Module:
    """The model, initialised from seed 0; with `empty`, its memory only (made on `meta`, then allocated), for
    a state that is loaded over it: no time spent on values that are overwritten."""
    torch.manual_seed(0)
    with torch.device("meta" if empty else "cpu"):
        model = torch.nn.Sequential(
            torch.nn.Linear(64, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, 64),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 1),
        )
    return model.to_empty(device="cpu") if empty else model


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2: every Linear's parameters (and so its optimizer state) sharded over all ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.randn(32, 64, generator=g)
    return x, x.pow(2).mean(dim=1, keepdim=True)


class Samples(torch.utils.data.Dataset):
    """A map-style dataset: sample i depends only on i."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x = torch.randn(64, generator=torch.Generator().manual_seed(i))
        return x, x.pow(2).mean(dim=0, keepdim=True), i


def batches(args: argparse.Namespace, start: int, rank: int, sampler: ResumableBatchSampler | None):
    """(step, x, y, sample indices) from `start` to the last step: synthetic per step, or the
    dataset's epochs through a DataLoader (the sampler's saved position says where to go on)."""
    if sampler is None:
        for step in range(start, args.steps):
            yield (step, *batch(step, rank), [])
        return
    loader = torch.utils.data.DataLoader(Samples(args.dataset), batch_sampler=sampler, num_workers=args.workers)
    step = start
    while step < args.steps:
        for x, y, index in loader:
            yield step, x, y, index.tolist()
            step += 1
            if step == args.steps:
                return
        sampler.set_epoch(sampler.epoch + 1)


def say(record: dict) -> None:
    """One JSON line on stdout in one write: with stdout unbuffered, print() writes the text and the
    newline apart, and a log line (stderr, often the same pipe) could land between them."""
    print(json.dumps(record) + "\n", end="", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--checkpoint-dir",
        default=os.environ.get("SPOTGUARD_CHECKPOINT_DIR"),
        help="where checkpoints go (default: $SPOTGUARD_CHECKPOINT_DIR)",
    )
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--cloud", default="auto", choices=["auto", "aws", "gcp", "azure", "none"])
    parser.add_argument("--local-dir", help="fast local staging disk (for bucket checkpoint dirs)")
    parser.add_argument("--save-every", type=int, help="also save every N steps in the background")
    parser.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 instead of DDP")
    parser.add_argument("--hidden", type=int, default=256, help="hidden width (the state grows with its square)")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (to watch it)")
    parser.add_argument("--out", help="write the final weights' digest here as JSON (rank 0)")
    parser.add_argument("--dataset", type=int, help="train on a map-style dataset of this many samples (epochs)")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per rank per step (--dataset)")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes (--dataset)")
    parser.add_argument("--log-samples", action="store_true", help="every rank prints its steps and sample indices")
    parser.add_argument("--save-final", action="store_true", help="commit a checkpoint of the last step at the end")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="after a node's departure the survivors go on in their processes (spotguard.run), not restarted",
    )
    args = parser.parse_args()
    if not args.checkpoint_dir:
        parser.error("--checkpoint-dir or SPOTGUARD_CHECKPOINT_DIR is required")

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    joining = args.in_process and os.environ.get("SPOTGUARD_JOIN")  # a node joining a running job (spotguard.run)
    if args.fsdp and int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not joining:
        parser.error("--fsdp needs several processes (torchrun)")
    options = {"cloud": args.cloud, "local_dir": args.local_dir, "save_every": args.save_every}
    if args.in_process:  # spotguard forms the process group, and again in this process after a departure
        spotguard.run(lambda ctx: train(args, ctx), args.checkpoint_dir, **options)
        return
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    with spotguard.Guard(args.checkpoint_dir, **options) as guard:
        train(args, guard)
    if distributed:
        dist.destroy_process_group()


def train(args: argparse.Namespace, guard: spotguard.Guard | spotguard.Context) -> None:
    """The training: the same loop under a Guard, or run by spotguard.run (`--in-process`), which runs it
    again after a departure, in this process, at the new world size (so the model is built in here)."""
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    # After an in-process recovery (spotguard.run) resume loads the whole state from the nodes' memory on every
    # rank: the model need not be initialised, nor DDP's first broadcast of rank 0's parameters made.
    recovered = getattr(guard, "recovered", None) is not None
    model = build_model(args.hidden, empty=recovered)
    net = shard(model) if args.fsdp else DDP(model, init_sync=not recovered) if distributed else model
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3)
    state = {"model": net, "optim": optimizer}
    sampler = ResumableBatchSampler(args.dataset, args.batch_size) if args.dataset else None
    if sampler is not None:
        state["data"] = sampler  # the global position: exactly-once data over restarts at any world size

    start = guard.resume(state)
    if recovered and start == 0:  # nothing was loaded after all (no snapshot, no checkpoint): initialise it
        initial = build_model(args.hidden).state_dict()
        set_model_state_dict(model, initial, options=StateDictOptions(full_state_dict=True))
    for step, x, y, samples in batches(args, start, rank, sampler):
        loss = F.mse_loss(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if sampler is not None:
            sampler.advance()  # before guard.step(): a checkpoint of this step includes its batch
        if args.log_samples:
            line = {
                "step": step,
                "rank": rank,
                "world": world,
                "epoch": sampler.epoch if sampler is not None else 0,
                "samples": samples,
            }
            say(line)
        elif rank == 0:
            say({"step": step, "loss": round(loss.item(), 6)})
        if args.step_time:
            time.sleep(args.step_time)
        if guard.step(step, state):
            return
    if args.save_final and start < args.steps:
        guard.save(args.steps - 1, state)
    # The whole model on rank 0 (FSDP2 gathers the shards: every rank takes part).
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"start": start, "digest": state_digest(weights)}, f)


if __name__ == "__main__":
    main()
