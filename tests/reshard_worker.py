"""A torchrun worker for the reshard tests: examples/train_ddp.py's FSDP2 model and data, with the
whole state's digest (the model's and the optimizer's full tensors) printed by rank 0 after the
resume and at the end, and, with --mirror DIR, a plain DCP checkpoint of every step kept in
DIR/step-N (outside spotguard: what a durable checkpoint of that step holds). With --load DIR it
only loads that DCP checkpoint at the present world size, prints the digest and exits."""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_ddp import batch, build_model, say, shard  # noqa: E402

import spotguard  # noqa: E402
from spotguard.checkpoint.state import to_dcp  # noqa: E402


def digest(model: torch.nn.Module, optim: torch.optim.Optimizer) -> str:
    """SHA-256 of every full tensor of the model and of the optimizer's state (a collective)."""
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    tensors = dict(get_model_state_dict(model, options=full))
    for name, values in get_optimizer_state_dict(model, optim, options=full).get("state", {}).items():
        tensors.update({f"optim.{name}.{key}": v for key, v in values.items() if isinstance(v, torch.Tensor)})
    h = hashlib.sha256()
    for name, tensor in sorted(tensors.items()):
        h.update(name.encode() + tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--local-dir")
    parser.add_argument("--cloud", default="none")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", type=int)
    parser.add_argument("--step-time", type=float, default=0.0)
    parser.add_argument("--mirror", help="keep a plain DCP checkpoint of every step here")
    parser.add_argument("--load", help="load this plain DCP checkpoint, print the digest, exit")
    parser.add_argument("--snapshot-replicas", type=int, default=1, help="other nodes that keep each snapshot")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard(build_model(64))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    state = {"model": model, "optim": optim}
    if args.load:
        live = to_dcp(state)
        dcp.load(live, checkpoint_id=args.load)
        from spotguard.checkpoint.state import load_from_dcp

        load_from_dcp(state, live)
        value = digest(model, optim)
        if rank == 0:
            say({"loaded": args.load, "world": world, "digest": value})
        dist.barrier()  # no rank tears gloo down while another still reads from it (a SIGABRT at exit)
        dist.destroy_process_group()
        return
    with spotguard.Guard(
        args.checkpoint_dir,
        cloud=args.cloud,
        local_dir=args.local_dir,
        save_every=args.save_every,
        snapshot_replicas=args.snapshot_replicas,
    ) as guard:
        start = guard.resume(state)
        value = digest(model, optim)
        if rank == 0:
            say({"resumed": start - 1, "world": world, "digest": value})
        for step in range(start, args.steps):
            x, y = batch(step, rank)
            loss = F.mse_loss(model(x), y)
            optim.zero_grad()
            loss.backward()
            optim.step()
            if args.mirror:
                dcp.save(to_dcp(state), checkpoint_id=f"{args.mirror}/step-{step}")
            if rank == 0:
                say({"step": step, "world": world, "loss": round(loss.item(), 6)})
            time.sleep(args.step_time)
            if guard.step(step, state):
                break
        else:
            value = digest(model, optim)
            if rank == 0:
                say({"final": args.steps - 1, "world": world, "digest": value})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
