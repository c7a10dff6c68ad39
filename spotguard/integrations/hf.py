"""Hugging Face `Trainer`: add `SpotGuardTrainerCallback(dir)` to its callbacks and call
`spotguard.integrations.hf.train(trainer)` instead of `trainer.train()`; the same script run
again resumes where the interrupted one stopped.

What is saved, through spotguard's DCP path (agreed step, atomic manifest-last commit): the
model, the optimizer, the LR scheduler, the `TrainerState` (with the stateful callbacks, as the
Trainer writes `trainer_state.json`) and each rank's RNG state (as the Trainer writes
`rng_state_{rank}.pth`, under a per-rank key).

Why a `train()` helper: the Trainer decides how many epochs and batches to skip, and when to
restore the RNG, from a `checkpoint-N` directory of its own layout, before any callback runs.
So `train()` enters the Guard, loads the newest committed checkpoint into the model and
optimizer, writes the bookkeeping the Trainer reads (`trainer_state.json`, the RNG file) into a
scratch `checkpoint-N` directory and passes it as `resume_from_checkpoint`: the Trainer's own
skip logic then resumes the data order exactly. The weights are already loaded, so the
Trainer's loading of them from that directory is skipped; scheduler state is applied in
`on_train_begin`, once the Trainer has created the scheduler.

Signals: the Guard owns SIGTERM. `enable_jit_checkpoint` (the Trainer's own SIGTERM handler,
which checkpoints a rank 3 s after its signal with no agreement between ranks) must stay off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput

from spotguard.checkpoint import IfSaved
from spotguard.guard import Guard
from spotguard.health.hangs import FRAMEWORK_PHASE_S
from spotguard.integrations.packed import Packed

TRAINER_STATE_NAME = "trainer_state.json"  # the names the Trainer reads in resume_from_checkpoint


class SpotGuardTrainerCallback(TrainerCallback):
    """Saves an agreed emergency checkpoint on a spot notice or SIGTERM, stops every rank, resumes.

    Takes the same arguments as `spotguard.Guard`. Use it with `train(trainer)`. After an
    emergency, `train` exits with `exit_code` (143; `lost_exit_code`, 75, when nothing was
    committed); with `exit_code=None` it returns and `emergency_saved` tells.
    """

    def __init__(self, checkpoint_dir: str, cloud: str | None = None, **options: Any) -> None:
        self.guard = Guard(checkpoint_dir, cloud, **options)  # bad arguments fail here, not mid-training
        self._state: dict[str, Any] | None = None
        self._restored: dict[str, Any] = {}  # what resume read that the Trainer has no place for yet

    @property
    def emergency_saved(self) -> bool:
        """True once an emergency checkpoint was committed (then training stopped)."""
        return self.guard.emergency_saved

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if self._state is None:
            raise RuntimeError("call spotguard.integrations.hf.train(trainer), not trainer.train()")
        optimizer, scheduler = kw["optimizer"], kw["lr_scheduler"]
        if "param_groups" in self._restored:
            # The scheduler the Trainer created after resume reset the learning rates: put back the
            # restored ones, as the Trainer's own resume does by loading the optimizer after it.
            for group, saved in zip(optimizer.param_groups, self._restored.pop("param_groups")):
                group.update(saved)
        if "scheduler" in self._restored:
            scheduler.load_state_dict(self._restored.pop("scheduler"))

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        # global_step counts optimizer steps: with gradient accumulation a save never splits one.
        if self.guard.step(state.global_step, self._state):  # type: ignore[arg-type]
            control.should_training_stop = True  # every rank gets True at the same step
        elif control.should_save and self.guard.started:  # the Trainer's own save (a push) comes before the next step
            self.guard.long_phase(FRAMEWORK_PHASE_S, "the Trainer's save")

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if self.guard.started:  # the final save, the best model's load
            self.guard.long_phase(FRAMEWORK_PHASE_S, "the end of training")

    def on_prediction_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.guard.heartbeat()  # a long evaluation between two training steps is no hang

    def resume(self, trainer: Trainer, scratch: Path) -> str | None:
        """Load the newest committed checkpoint; the Trainer-layout directory to resume from, or None."""
        if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
            raise ValueError("spotguard's Trainer integration supports DDP and single-process runs, not FSDP/DeepSpeed")
        trainer.create_optimizer()  # now rather than in train(), so that DCP can load its state
        rank = trainer.args.process_index
        self._state = {
            "model": trainer.model,
            "optimizer": trainer.optimizer,
            # The Trainer creates the scheduler in train(): None while resume lays out what to load.
            "scheduler": Packed(
                lambda: trainer.lr_scheduler and trainer.lr_scheduler.state_dict(), self._keep("scheduler")
            ),
            "trainer_state": Packed(lambda: _trainer_state_json(trainer), self._keep(TRAINER_STATE_NAME)),
            f"rng_state_{rank}": IfSaved(Packed(lambda: _rng_file(trainer), self._keep("rng"))),
        }
        if self.guard.resume(self._state) == 0:
            return None
        self._restored["param_groups"] = [
            {k: v for k, v in group.items() if k != "params"} for group in trainer.optimizer.param_groups
        ]
        trainer_state = self._restored.pop(TRAINER_STATE_NAME)
        checkpoint = scratch / f"{PREFIX_CHECKPOINT_DIR}-{json.loads(trainer_state)['global_step']}"
        checkpoint.mkdir()
        (checkpoint / TRAINER_STATE_NAME).write_text(trainer_state)
        if "rng" in self._restored:  # absent for a rank new at a larger world size: the Trainer says so and goes on
            _, data = self._restored.pop("rng")  # under the name this Trainer reads, whatever world size saved it
            args = trainer.args
            name = "rng_state.pth" if args.world_size == 1 else f"rng_state_{args.process_index}.pth"
            (checkpoint / name).write_bytes(data)
        return str(checkpoint)

    def _keep(self, key: str) -> Callable[[Any], None]:
        return lambda value: self._restored.__setitem__(key, value)


def train(trainer: Trainer, **kwargs: Any) -> TrainOutput:
    """`trainer.train(**kwargs)`, guarded: resumes from the newest committed checkpoint, exits after an emergency."""
    callbacks = [c for c in trainer.callback_handler.callbacks if isinstance(c, SpotGuardTrainerCallback)]
    if len(callbacks) != 1:
        raise ValueError("the trainer needs one SpotGuardTrainerCallback: Trainer(..., callbacks=[callback])")
    if "resume_from_checkpoint" in kwargs:
        raise ValueError("resume_from_checkpoint is spotguard's to choose: the newest committed checkpoint")
    if getattr(trainer.args, "enable_jit_checkpoint", False):  # a newer Trainer's option
        raise ValueError("enable_jit_checkpoint must stay off: the Guard handles SIGTERM, agreed between ranks")
    callback = callbacks[0]
    with callback.guard, _scratch() as scratch, _weights_already_loaded(trainer):
        return trainer.train(resume_from_checkpoint=callback.resume(trainer, scratch), **kwargs)


@contextlib.contextmanager
def _scratch() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="spotguard-hf-"))  # per rank: each writes its own RNG file
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _weights_already_loaded(trainer: Trainer) -> Iterator[None]:
    """Keep the Trainer from loading weights from the scratch directory (it holds none; DCP loaded them)."""
    trainer._load_from_checkpoint = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        del trainer._load_from_checkpoint


def _trainer_state_json(trainer: Trainer) -> str:
    """`trainer_state.json` as the Trainer's own checkpoint writes it (with its stateful callbacks' state)."""
    state = dataclasses.asdict(trainer.state)
    exportable: dict[str, list[Any]] = {}
    for cb in [*trainer.callback_handler.callbacks, trainer.control]:
        if isinstance(cb, ExportableState):
            exportable.setdefault(type(cb).__name__, []).append(cb.state())
    state["stateful_callbacks"] = {name: s if len(s) > 1 else s[0] for name, s in exportable.items()}
    return json.dumps(state)


def _rng_file(trainer: Trainer) -> tuple[str, bytes]:
    """This rank's RNG file as the Trainer writes it (every device kind it knows), name and bytes."""
    with tempfile.TemporaryDirectory(prefix="spotguard-rng-") as tmp:
        trainer._save_rng_state(tmp)
        (name,) = os.listdir(tmp)
        return name, Path(tmp, name).read_bytes()
