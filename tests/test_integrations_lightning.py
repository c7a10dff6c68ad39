"""Lightning's Trainer (DDP, 2 CPU processes started by Lightning itself) with SpotGuardCallback:
an AWS notice at a random step, then SIGTERM to one rank only at a later one; each time every rank
stops at the agreed step, the checkpoint is committed and the next run resumes at the step after
it; a later save killed mid-write is ignored, and the run ends bit-identical to a run that never
stopped. On Slurm, its SIGUSR1 warning is the Guard's notice, not Lightning's requeue."""

import os
import signal
import sys
import time

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.plugins.environments import SLURMEnvironment  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from cloud_adapters.signals import SignalSource  # noqa: E402
from spotguard.checkpoint import list_checkpoints  # noqa: E402
from spotguard.integrations.lightning import SpotGuardCallback  # noqa: E402
from tests.framework_runs import (  # noqa: E402
    notice_then_sigterm_then_finish,
    saved_shards,
    sigterm_then_finish,
)


class Tiny(pl.LightningModule):
    """For the tests that train in this process: one linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def quiet_trainer(max_steps, callbacks, **kwargs):
    """One CPU process; no logger, progress bar, summary or Lightning checkpoints."""
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **kwargs)  # fmt: skip


def test_notice_then_sigterm_to_one_rank_each_stop_every_rank_and_the_run_ends_bit_identical(tmp_path, request):
    # global_step 1 to 12: 3 epochs of 8 batches per rank, 2 per optimizer step; `python script.py` (Lightning
    # starts rank 1)
    notice_then_sigterm_then_finish("lightning_train.py", tmp_path, request.node.nodeid, 1, 12, (sys.executable,))


def test_a_resumed_checkpoint_goes_to_lightnings_own_format_and_ckpt_path_reads_it(tmp_path):
    """Tools that read Lightning checkpoints get spotguard's newest committed step this way."""
    data = DataLoader(TensorDataset(torch.randn(32, 8)), batch_size=4)
    ckpt = str(tmp_path / "ckpt")
    torch.manual_seed(0)
    model = Tiny()
    quiet_trainer(3, [SpotGuardCallback(ckpt, "none", save_every=3)]).fit(model, data)  # a background save of step 3
    saved = [p.detach().clone() for p in model.parameters()]

    torch.manual_seed(1)
    resumed = quiet_trainer(3, [SpotGuardCallback(ckpt, "none")])  # resumes step 3: nothing is left to train
    resumed.fit(Tiny(), data)
    resumed.save_checkpoint(tmp_path / "lightning.ckpt")
    loaded = Tiny.load_from_checkpoint(tmp_path / "lightning.ckpt")
    assert all(torch.equal(p, q) for p, q in zip(loaded.parameters(), saved))

    class FirstWeights(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            self.weights = [p.detach().clone() for p in pl_module.parameters()]

    torch.manual_seed(2)
    first = FirstWeights()
    on = quiet_trainer(4, [first])  # Lightning's own resume: ckpt_path=, from step 3 to 4
    on.fit(Tiny(), data, ckpt_path=tmp_path / "lightning.ckpt")
    assert all(torch.equal(p, q) for p, q in zip(first.weights, saved)) and on.global_step == 4


def test_fsdp2_on_cpu_saves_each_ranks_shard_and_resumes_bit_identical(tmp_path):
    """Lightning's FSDP2 (`ModelParallelStrategy`, `fully_shard`) runs on CPU: a sharded strategy stays sharded."""
    fsdp2 = ("--strategy", "fsdp2")
    sigterm_then_finish("lightning_train.py", tmp_path, (sys.executable,), fsdp2, ranks=2, first_step=1, at=11)
    # The 64x16 first layer: rank 0's rows 0-31 and rank 1's rows 32-63, each in its own rank's file.
    shards = saved_shards(tmp_path / "interrupted" / "ckpt", "model.net.0.weight")
    assert [sizes for sizes, _ in shards] == [(32, 16), (32, 16)] and shards[0][1] != shards[1][1], shards


def test_on_slurm_the_guard_owns_sigusr1_and_lightning_neither_handles_nor_requeues(tmp_path, monkeypatch):
    """Slurm's `--signal=USR1@90` warning: with `signals=("SIGTERM", "SIGUSR1")` it is a notice like any other."""
    for name, value in {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "7", "SLURM_PROCID": "0",
                        "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)

    class SignalAtStep3(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 3:
                self.handlers = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)]
                os.kill(os.getpid(), signal.SIGUSR1)  # as Slurm warns the job step
                # A real step outlasts the notice's way through the store; this tiny one may not (a loaded host).
                until = time.monotonic() + 10
                while not any(e.event == "agreed" for e in guard.guard.timeline.entries) and time.monotonic() < until:
                    time.sleep(0.01)

    def sentinel(*_):  # were nothing else to handle SIGUSR1, its default action would end this test's process
        pass

    before = [signal.getsignal(signal.SIGTERM), sentinel]
    previous = signal.signal(signal.SIGUSR1, sentinel)
    guard = SpotGuardCallback(str(tmp_path / "ckpt"), "none", signals=("SIGTERM", "SIGUSR1"), exit_code=None)
    probe = SignalAtStep3()
    trainer = quiet_trainer(10, [probe, guard], plugins=[SLURMEnvironment(auto_requeue=True)])
    assert isinstance(trainer._accelerator_connector.cluster_environment, SLURMEnvironment)
    try:
        trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=4))
    finally:
        after = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)]
        signal.signal(signal.SIGUSR1, previous)

    # Lightning's handlers would have requeued the job (`scontrol requeue`) and saved nothing agreed.
    assert all(isinstance(getattr(h, "__self__", None), SignalSource) for h in probe.handlers), probe.handlers
    # It stopped at the step agreed (the notice reaches the loop through the store, a few steps later).
    assert guard.emergency_saved and 3 <= trainer.global_step < 10
    committed = [(c.step, c.reason) for c in list_checkpoints(str(tmp_path / "ckpt")) if c.committed]
    assert committed == [(trainer.global_step, "emergency")]
    assert after == before  # the handlers from before the fit are back
