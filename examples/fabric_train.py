"""A Lightning Fabric loop (DDP on CPU processes; FSDP2 with --strategy fsdp2) that survives spot interruptions:

    torchrun --nproc-per-node 2 examples/fabric_train.py --checkpoint-dir s3://bucket/run-7

Run the same command again after an interruption and it resumes from the newest committed
checkpoint, mid-epoch, with the same data order and random state (the model has dropout). The
metadata service is read from $SPOTGUARD_METADATA_URL when set (the tests point it at an
emulator). Deterministic on CPU: an interrupted-and-resumed run ends with the same weights as
one that never stopped.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.nn.functional as F
from example_cli import (  # examples/example_cli.py
    arguments,
    end_process,
    log_spotguard,
    shard_with_fsdp2,
    wait_while_paused,
)
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, TensorDataset

from spotguard.checkpoint import state_digest
from spotguard.integrations.fabric import guarded


def shard(model: torch.nn.Sequential, mesh: DeviceMesh) -> torch.nn.Sequential:
    """ModelParallelStrategy's parallelize function: FSDP2 over the mesh's data-parallel dimension."""
    return shard_with_fsdp2(model, mesh["data_parallel"])


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp2"])
    args = parser.parse_args()
    log_spotguard()

    strategy: Any = args.strategy
    if strategy == "fsdp2":  # Lightning's FSDP2 (`fully_shard`): every device shards, none splits layers
        strategy = ModelParallelStrategy(shard, data_parallel_size=2, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)  # under torchrun: its 2 processes
    fabric.launch()
    fabric.seed_everything(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 1)
    )  # fmt: skip
    model = fabric.setup_module(model)  # FSDP2 shards here: the optimizer is made from the shards
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 5, gamma=0.9)
    optimizer = fabric.setup_optimizers(optimizer)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.pow(2).mean(dim=1, keepdim=True)), batch_size=4, shuffle=True)
    loader = fabric.setup_dataloaders(loader)  # a DistributedSampler, its epoch set by Fabric

    with guarded(
        fabric, args.checkpoint_dir, args.cloud, models=[model], optimizers=[optimizer], schedulers=[scheduler],
        dataloader=loader, metadata_url=os.environ.get("SPOTGUARD_METADATA_URL"),
    ) as run:  # fmt: skip
        step = run.resume()  # 0, or the step after the newest committed checkpoint's
        for _epoch, (inputs, targets) in run.batches(args.epochs):
            loss = F.mse_loss(model(inputs), targets)
            fabric.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            print(json.dumps({"rank": fabric.global_rank, "pid": os.getpid(), "step": step}), flush=True)
            wait_while_paused(args.pause_file, step)
            if run.step(step):  # True on every rank at the agreed step, once its checkpoint is committed
                break
            step += 1
    # after an emergency, leaving the block exits 143 (75 when nothing was committed)
    # Sharded strategies: gathered onto rank 0, a collective on every rank.
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if fabric.is_global_zero and args.out:
        with open(args.out, "w") as f:
            json.dump({"steps": step, "digest": state_digest(weights)}, f)
    end_process()


if __name__ == "__main__":
    main()
