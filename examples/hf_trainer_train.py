"""A Hugging Face `Trainer` (a tiny GPT-2, DDP on CPU processes) that survives spot interruptions:

    torchrun --nproc-per-node 2 examples/hf_trainer_train.py --checkpoint-dir s3://bucket/run-7

Run the same command again after an interruption and it resumes from the newest committed
checkpoint, mid-epoch, with the same data order and random state (dropout is on). The model is
built from a config and the data is generated: nothing is downloaded. The metadata service is
read from $SPOTGUARD_METADATA_URL when set (the tests point it at an emulator). Deterministic on
CPU: an interrupted-and-resumed run ends with the same weights as one that never stopped.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from example_cli import arguments, log_spotguard, wait_while_paused  # examples/example_cli.py
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from spotguard.checkpoint import state_digest
from spotguard.integrations.hf import SpotGuardTrainerCallback, train


class Progress(TrainerCallback):
    """Prints each finished step, then waits while the pause file names it (to interrupt it at a chosen step)."""

    def __init__(self, pause_file: str | None) -> None:
        self.pause_file = pause_file

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        print(json.dumps({"rank": args.process_index, "pid": os.getpid(), "step": state.global_step}), flush=True)
        wait_while_paused(self.pause_file, state.global_step)


def data(n: int = 64, length: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (n, length), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--output-dir", default="hf_output", help="the Trainer's own output")
    args = parser.parse_args()
    log_spotguard()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0)
    )
    training = TrainingArguments(
        output_dir=args.output_dir,
        use_cpu=True,
        num_train_epochs=args.epochs,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=3,
        save_strategy="no",  # spotguard saves (add save_every= for periodic saves)
        report_to="none",
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
        seed=0,
    )
    spotguard = SpotGuardTrainerCallback(
        args.checkpoint_dir, cloud=args.cloud, metadata_url=os.environ.get("SPOTGUARD_METADATA_URL")
    )
    callbacks = [Progress(args.pause_file), spotguard]
    trainer = Trainer(model=model, args=training, train_dataset=data(), callbacks=callbacks)
    result = train(trainer)  # after an emergency, exits 143 here (exit_code=None: returns)
    if training.process_index == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"steps": result.global_step, "digest": state_digest(model.state_dict())}, f)


if __name__ == "__main__":
    main()
