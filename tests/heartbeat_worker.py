"""One process, hang_timeout_s=2: a loop that evaluates for 5 s between two steps, beating per batch
through the API under test (`guard`: guard.heartbeat(); `lightning`: a Trainer's validation with
SpotGuardCallback; `hf`: a Hugging Face Trainer's evaluation with SpotGuardTrainerCallback), or not at
all (`none`: the hang watch must end it); a guard entered twice (`reenter`); a hang after another rank
left its guard (`left`)."""

from __future__ import annotations

import logging
import sys
import time

import torch

import spotguard

EVAL_BATCHES, BATCH_S = 10, 0.5  # 5 s of evaluation, more than twice the hang timeout


def plain(ckpt: str, beat: bool) -> None:
    with spotguard.Guard(ckpt, cloud="none", hang_timeout_s=2) as guard:
        state = {"w": torch.zeros(2)}
        for step in range(guard.resume(state), 6):
            time.sleep(0.05)
            guard.step(step, state)
            if step == 2:
                for _ in range(EVAL_BATCHES):
                    time.sleep(BATCH_S)
                    if beat:
                        guard.heartbeat()


def reenter(ckpt: str) -> None:
    """A guard entered again (a second fit): its resume and its first step are not timed again."""
    guard = spotguard.Guard(ckpt, cloud="none", hang_timeout_s=2)
    state = {"w": torch.zeros(2)}
    for _ in range(2):
        with guard:
            time.sleep(5)  # a slow resume, a first step that compiles
            for step in range(guard.resume(state), guard.resume(state) + 3):
                time.sleep(0.05)
                guard.step(step, state)


def left(ckpt: str) -> None:
    """Two ranks (threads, one store): rank 0's guard closes (a crash), so no listener reads the job's events
    any more; rank 1 stops stepping: its hang must end the process on its own (exit 75)."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    guards = [
        spotguard.Guard(ckpt, cloud="none", hang_timeout_s=2, store=server.clone(), rank=r, world_size=2,
                        local_rank=0, node=f"node-{r}")
        for r in range(2)
    ]  # fmt: skip
    entering = threading.Thread(target=lambda: [g.__enter__() for g in guards])  # off the main thread: no signals
    entering.start()
    entering.join()
    state = {"w": torch.zeros(2)}
    for step in range(3):
        for guard in guards:
            guard.step(step, state)
    guards[0].__exit__(RuntimeError, RuntimeError("rank 0 crashed"), None)
    time.sleep(60)  # rank 1 waits for rank 0 forever


def lightning(ckpt: str) -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from spotguard.integrations.lightning import SpotGuardCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            time.sleep(BATCH_S)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(EVAL_BATCHES, 4)), batch_size=1)
    saves = pl.callbacks.ModelCheckpoint(dirpath=f"{ckpt}-lightning", every_n_train_steps=2, save_top_k=-1)
    trainer = pl.Trainer(
        max_steps=4, val_check_interval=2, num_sanity_val_steps=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", devices=1,
        callbacks=[SpotGuardCallback(ckpt, cloud="none", hang_timeout_s=2), saves],
    )  # fmt: skip
    trainer.fit(Module(), data, data)


def hf(ckpt: str, out: str) -> None:
    from transformers import Trainer, TrainingArguments

    from spotguard.integrations.hf import SpotGuardTrainerCallback, train

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def forward(self, x, labels=None):
            loss = (self.layer(x).squeeze(-1) - labels).pow(2).mean()
            return {"loss": loss}

    class Samples(torch.utils.data.Dataset):
        def __init__(self, slow: bool) -> None:
            self.slow = slow

        def __len__(self) -> int:
            return EVAL_BATCHES

        def __getitem__(self, i: int) -> dict:
            if self.slow:
                time.sleep(BATCH_S)
            return {"x": torch.randn(4), "labels": torch.tensor(0.0)}

    args = TrainingArguments(
        out, max_steps=4, eval_strategy="steps", eval_steps=2, per_device_train_batch_size=1,
        per_device_eval_batch_size=1, report_to=[], save_strategy="steps", save_steps=2, use_cpu=True,
        logging_strategy="no", dataloader_num_workers=0,
    )  # fmt: skip
    callback = SpotGuardTrainerCallback(ckpt, cloud="none", hang_timeout_s=2)
    trainer = Trainer(model=Model(), args=args, train_dataset=Samples(False), eval_dataset=Samples(True),
                      callbacks=[callback])  # fmt: skip
    train(trainer)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)  # the timeline's lines: the long phases the frameworks declared
    kind, ckpt = sys.argv[1], sys.argv[2]
    if kind in ("guard", "none"):
        plain(ckpt, beat=kind == "guard")
    elif kind == "reenter":
        reenter(ckpt)
    elif kind == "left":
        left(ckpt)
    elif kind == "lightning":
        lightning(ckpt)
    else:
        hf(ckpt, sys.argv[3])
    print("finished", flush=True)
