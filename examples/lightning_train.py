"""A Lightning `Trainer` (DDP on 2 CPU processes; FSDP2 with --strategy fsdp2, on CPU too; FSDP with
--strategy fsdp --accelerator cuda) that survives spot interruptions:

    python examples/lightning_train.py --checkpoint-dir s3://bucket/run-7

Run the same command again after an interruption and it resumes from the newest committed
checkpoint, mid-epoch, with the same data order. The metadata service is read from
$SPOTGUARD_METADATA_URL when set (the tests point it at an emulator). Deterministic on CPU:
an interrupted-and-resumed run ends with the same weights as one that never stopped.
"""

from __future__ import annotations

import json
import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from example_cli import (  # examples/example_cli.py
    arguments,
    end_process,
    log_spotguard,
    shard_with_fsdp2,
    wait_while_paused,
)
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader, TensorDataset

from spotguard.checkpoint import state_digest
from spotguard.integrations.lightning import SpotGuardCallback


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def configure_model(self) -> None:
        if isinstance(self.trainer.strategy, ModelParallelStrategy):
            shard_with_fsdp2(self.net, self.device_mesh["data_parallel"])

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 5, gamma=0.9)}


class Progress(Callback):
    """Prints each finished optimizer step, then waits while the pause file names it (to interrupt it at a
    chosen step). Batches that only accumulate gradients finish no step."""

    def __init__(self, pause_file: str | None) -> None:
        self.pause_file = pause_file
        self.step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step = trainer.global_step  # resumed: the steps up to here are done

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            return
        self.step = trainer.global_step
        print(json.dumps({"rank": trainer.global_rank, "pid": os.getpid(), "step": self.step}), flush=True)
        wait_while_paused(self.pause_file, self.step)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    return DataLoader(TensorDataset(x, x.pow(2).mean(dim=1, keepdim=True)), batch_size=4, shuffle=True)


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--root", default="lightning_logs", help="Lightning's own output (ModelCheckpoint)")
    parser.add_argument("--accelerator", default="cpu", help="cuda for strategy fsdp (Lightning's FSDP1 needs GPUs)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp", "fsdp2"])
    args = parser.parse_args()
    log_spotguard()

    pl.seed_everything(0)
    model = Regressor()
    strategy: Any = args.strategy
    if strategy == "fsdp2":  # Lightning's FSDP2 (`fully_shard`): every device shards, none splits layers
        strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    spotguard = SpotGuardCallback(
        args.checkpoint_dir, cloud=args.cloud, metadata_url=os.environ.get("SPOTGUARD_METADATA_URL")
    )
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        deterministic="warn",  # the interrupted run must end with the uninterrupted one's weights (GPU too)
        max_epochs=args.epochs,
        accumulate_grad_batches=2,  # an optimizer step every 2 batches: a save never splits one
        default_root_dir=args.root,
        callbacks=[
            Progress(args.pause_file),
            spotguard,
            ModelCheckpoint(dirpath=os.path.join(args.root, "best"), monitor="loss"),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data())  # after an emergency, exits 143 here (exit_code=None: returns)
    # Sharded strategies: gathered onto rank 0, a collective on every rank.
    gathered = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(trainer.strategy.model, options=gathered)
    if trainer.is_global_zero and args.out:
        with open(args.out, "w") as f:
            json.dump({"steps": trainer.global_step, "digest": state_digest(weights)}, f)
    end_process()  # Lightning leaves the process group alive


if __name__ == "__main__":
    main()
