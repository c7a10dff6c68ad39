"""Lightning: `Trainer(callbacks=[SpotGuardCallback("s3://bucket/run")])`, and the same script run
again resumes where the interrupted one stopped.

What is saved, through spotguard's DCP path (atomic, manifest-last commit and the agreement):
the model (`trainer.strategy.model`: DDP, FSDP or plain), every optimizer and LR scheduler, the
fit loop's progress (epoch, batch index, global step) and the other callbacks' state. Resume
loads it in `on_fit_start` and fast-forwards the train dataloader past the batches of the
interrupted epoch that were already trained on, so the data order goes on exactly.

Signals: the Guard owns SIGTERM. Lightning's own handler would set `trainer.received_sigterm`,
run a collective inside the signal handler and stop the job on the next batch with a
`SIGTERMException` (exit 1, nothing saved), before the ranks have agreed on a step; so this
callback keeps Lightning from installing its handlers for the fit it guards.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.callbacks import Callback

from spotguard.guard import Guard
from spotguard.health.hangs import FRAMEWORK_PHASE_S
from spotguard.integrations.packed import Packed


class SpotGuardCallback(Callback):
    """Saves an agreed emergency checkpoint on a spot notice or SIGTERM, stops every rank, resumes.

    Takes the same arguments as `spotguard.Guard`. After an emergency, `trainer.fit` ends and the
    process exits with `exit_code` (143; `lost_exit_code`, 75, when nothing was committed); with
    `exit_code=None`, `fit` returns normally and `emergency_saved` tells.
    """

    def __init__(self, checkpoint_dir: str, cloud: str | None = None, **options: Any) -> None:
        self.guard = Guard(checkpoint_dir, cloud, **options)  # bad arguments fail here, not mid-fit
        self._state: dict[str, Any] = {}
        self._resumed = False

    @property
    def emergency_saved(self) -> bool:
        """True once an emergency checkpoint was committed (then the loop stopped)."""
        return self.guard.emergency_saved

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # One owner for SIGTERM (see the module docstring). Lightning registers its handlers
        # after `on_fit_start` and restores what was there before at teardown.
        trainer._signal_connector.register_signal_handlers = _leave_signals_to_the_guard
        self.guard.start()  # the process group exists by now

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Here the strategy has wrapped the model and made the optimizers.
        self._state = _training_state(trainer, skip=self)
        self._resumed = self.guard.resume(self._state) > 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._resumed:
            _skip_trained_batches(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # global_step counts optimizer steps: with gradient accumulation a save never splits one.
        if self.guard.step(trainer.global_step, self._state):
            trainer.should_stop = True  # every rank gets True at the same step

    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self.guard.heartbeat()  # a long validation between two training steps is no hang

    # Lightning's own work between two steps, or after the last (a checkpoint of a large model, the loggers'
    # end): not a hang, until the next step or the guard's close.
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if self.guard.started:  # a checkpoint saved after fit has no guard to tell
            self.guard.long_phase(FRAMEWORK_PHASE_S, "Lightning's checkpoint")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.guard.started:
            self.guard.long_phase(FRAMEWORK_PHASE_S, "the end of training")

    # After an emergency, close() exits with the Guard's code (unless exit_code=None); once closed, or
    # never started (another stage), it does nothing: on_exception and teardown may both call it.
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.guard.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.guard.close(exception)


def _leave_signals_to_the_guard() -> None:
    """Stands in for Lightning's `_SignalConnector.register_signal_handlers` while a Guard runs."""


def _training_state(trainer: pl.Trainer, skip: Callback) -> dict[str, Any]:
    state: dict[str, Any] = {"model": trainer.strategy.model}
    for i, optimizer in enumerate(trainer.optimizers):
        state[f"optim{i}"] = optimizer
    for i, config in enumerate(trainer.lr_scheduler_configs):
        state[f"scheduler{i}"] = config.scheduler
    state["fit_loop"] = Packed(trainer.fit_loop.state_dict, trainer.fit_loop.load_state_dict)
    callbacks = {c.state_key: c for c in trainer.callbacks if c is not skip}
    state["callbacks"] = Packed(
        lambda: {key: c.state_dict() for key, c in callbacks.items()},
        lambda saved: [c.load_state_dict(saved[key]) for key, c in callbacks.items() if key in saved],
    )
    return state


def _skip_trained_batches(trainer: pl.Trainer) -> None:
    """Fast-forward the train dataloader past the interrupted epoch's trained batches.

    Lightning restores the batch counters but restarts a plain DataLoader from its first batch
    (it warns "your dataloader is not resumable"); dataloaders with their own `state_dict` are
    restored by Lightning itself and left alone.
    """
    loop = trainer.fit_loop
    loaders = loop._combined_loader.flattened if loop._combined_loader is not None else []
    if not loaders or all(isinstance(dl, _Stateful) for dl in loaders):
        return
    # Saved at on_train_batch_end: `processed` batches of this epoch are trained; all of them
    # means the epoch had ended and Lightning starts the next one.
    trained = loop.epoch_loop.batch_progress.current.processed
    if trained >= trainer.num_training_batches:
        return
    for dl in loaders:  # the sampler's shuffle for this epoch, before the first batch is drawn
        _set_sampler_epoch(dl, loop.epoch_progress.current.processed)
    batches = loop._data_fetcher.iterator  # past the fetcher: Lightning adds `trained` to its count itself
    for _ in range(trained):
        next(batches)
