"""A DDP job under torchrun for the silent-failure tests and bench: training that pauses where asked
(a long step, an evaluation declared or not, on every rank or on one while the others wait for it in
the next step's allreduce, one C call that keeps a rank's GIL), or one rank that hangs in its data
loading."""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import spotguard


def next_batch(step: int, rank: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """The data loader; on --hang-rank at --hang-at it never returns (a worker that died, a lock), or with
    --hang-in-store it waits on the job's store client for a key nobody sets (a store barrier, a process
    group made while a peer never comes): c10d's client then serves nobody else in this process."""
    if rank == args.hang_rank and step == args.hang_at:
        if args.hang_in_store:
            dist.distributed_c10d._get_default_store().wait(["a-peer-that-never-comes"], timedelta(hours=1))
        threading.Event().wait()
    g = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.randn(16, 32, generator=g)
    return x, x.pow(2).mean(dim=1, keepdim=True)


class SlowState:
    """State whose `state_dict()` takes --slow-state-s seconds at each save: a save in progress that long."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.saves = 0

    def state_dict(self) -> dict:
        time.sleep(self.seconds)
        return {"saves": self.saves}

    def load_state_dict(self, state: dict) -> None:
        self.saves = state["saves"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--local-dir")
    parser.add_argument("--cloud", default="none")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--save-every", type=int)
    parser.add_argument("--hang-rank", type=int, default=-1)
    parser.add_argument("--hang-at", type=int, default=-1)
    parser.add_argument("--hang-in-store", action="store_true", help="the hang is a wait on the job's store client")
    parser.add_argument("--long-step-at", type=int, default=-1, help="this step lasts --long-step-s on every rank")
    parser.add_argument("--long-step-s", type=float, default=0.0)
    parser.add_argument("--eval-at", type=int, default=-1, help="an evaluation of --eval-s after this step")
    parser.add_argument("--eval-s", type=float, default=0.0)
    parser.add_argument("--declare", action="store_true", help="the evaluation is declared with guard.long_phase")
    parser.add_argument("--eval-rank", type=int, default=-1, help="only this rank evaluates (the others wait)")
    parser.add_argument("--slow-state-s", type=float, default=0.0, help="each save takes this long on the loop")
    parser.add_argument("--hold-gil-rank", type=int, default=-1, help="this rank keeps its GIL in one C call ...")
    parser.add_argument("--hold-gil-at", type=int, default=-1, help="... after this step ...")
    parser.add_argument("--hold-gil-s", type=int, default=0, help="... for this many seconds")
    args = parser.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = DDP(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    state = {"model": net, "optim": optimizer}
    if args.slow_state_s:
        state["slow"] = SlowState(args.slow_state_s)
    with spotguard.Guard(
        args.checkpoint_dir, cloud=args.cloud, local_dir=args.local_dir, save_every=args.save_every
    ) as guard:
        for step in range(guard.resume(state), args.steps):
            x, y = next_batch(step, rank, args)
            loss = F.mse_loss(net(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            time.sleep(args.long_step_s if step == args.long_step_at else args.step_time)
            if rank == 0:
                print(json.dumps({"step": step, "pid": os.getpid()}), flush=True)
            if guard.step(step, state):
                break
            if step == args.hold_gil_at and rank == args.hold_gil_rank:
                ctypes.PyDLL(None).sleep(args.hold_gil_s)  # PyDLL keeps the GIL: no thread of this process runs
            if step == args.eval_at and args.eval_rank in (-1, rank):
                if args.declare:
                    with guard.long_phase(args.eval_s + 5, "evaluation"):
                        time.sleep(args.eval_s)
                else:
                    time.sleep(args.eval_s)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
