"""A hand-written Accelerate loop (DDP on CPU processes) that survives spot interruptions:

    accelerate launch --num_processes 2 examples/accelerate_train.py --checkpoint-dir s3://bucket/run-7
    (or: torchrun --nproc-per-node 2 examples/accelerate_train.py --checkpoint-dir ...)

Run the same command again after an interruption and it resumes from the newest committed
checkpoint, mid-epoch, with the same data order and random state (the model has dropout). The
metadata service is read from $SPOTGUARD_METADATA_URL when set (the tests point it at an
emulator). Deterministic on CPU: an interrupted-and-resumed run ends with the same weights as
one that never stopped.
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from example_cli import arguments, log_spotguard, wait_while_paused  # examples/example_cli.py
from torch.utils.data import DataLoader, TensorDataset

from spotguard.checkpoint import state_digest
from spotguard.integrations.accelerate import guarded


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--hidden", type=int, default=64, help="hidden width (a larger state takes longer to save)")
    args = parser.parse_args()
    log_spotguard()

    # A seedable sampler: each epoch's shuffle depends on the seed and the epoch only.
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, args.hidden), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(args.hidden, 1)
    )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 5, gamma=0.9)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.pow(2).mean(dim=1, keepdim=True)), batch_size=4, shuffle=True)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)

    with guarded(
        accelerator, args.checkpoint_dir, args.cloud, models=[model], optimizers=[optimizer], schedulers=[scheduler],
        dataloader=loader, metadata_url=os.environ.get("SPOTGUARD_METADATA_URL"),
    ) as run:  # fmt: skip
        step = run.resume()  # 0, or the step after the newest committed checkpoint's
        for _epoch, (inputs, targets) in run.batches(args.epochs):
            loss = F.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            print(json.dumps({"rank": accelerator.process_index, "pid": os.getpid(), "step": step}), flush=True)
            wait_while_paused(args.pause_file, step)
            if run.step(step):  # True on every rank at the agreed step, once its checkpoint is committed
                break
            step += 1
    # after an emergency, leaving the block exits 143 (75 when nothing was committed)
    if accelerator.is_main_process and args.out:
        with open(args.out, "w") as f:
            json.dump({"steps": step, "digest": state_digest(accelerator.unwrap_model(model).state_dict())}, f)


if __name__ == "__main__":
    main()
