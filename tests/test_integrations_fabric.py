"""A Lightning Fabric loop (DDP, 2 CPU processes under torchrun, dropout on) guarded by
`spotguard.integrations.fabric.guarded`: an AWS notice at a random step, then SIGTERM to one rank
only at a later one; each time every rank stops at the agreed step, the checkpoint is committed
and the next run resumes at the step after it (data position and per-rank RNG restored); a later
save killed mid-write is ignored, and the run ends bit-identical to a run that never stopped."""

import pytest

pytest.importorskip("lightning")

from tests.framework_runs import (  # noqa: E402
    TORCHRUN,
    notice_then_sigterm_then_finish,
    saved_shards,
    sigterm_then_finish,
)


def test_notice_then_sigterm_to_one_rank_each_stop_every_rank_and_the_run_ends_bit_identical(tmp_path, request):
    notice_then_sigterm_then_finish("fabric_train.py", tmp_path, request.node.nodeid, 0, 23)  # 3 epochs of 8


def test_fsdp2_on_cpu_saves_each_ranks_shard_and_resumes_bit_identical(tmp_path):
    """Fabric's FSDP2 (`ModelParallelStrategy`, `fully_shard`) runs on CPU: a sharded strategy stays sharded."""
    sigterm_then_finish("fabric_train.py", tmp_path, TORCHRUN, ("--strategy", "fsdp2"), ranks=2, first_step=0, at=13)
    # The 64x16 first layer: rank 0's rows 0-31 and rank 1's rows 32-63, each in its own rank's file.
    shards = saved_shards(tmp_path / "interrupted" / "ckpt", "model0.0.weight")
    assert [sizes for sizes, _ in shards] == [(32, 16), (32, 16)] and shards[0][1] != shards[1][1], shards


def test_dataloader_not_set_up_by_fabric_is_refused(tmp_path):
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader

    from spotguard.integrations.fabric import guarded

    with pytest.raises(ValueError, match="fabric.setup_dataloaders"):
        guarded(Fabric(accelerator="cpu", devices=1), str(tmp_path), "none", models=[], dataloader=DataLoader([1]))


def test_a_lightning_whose_dataloader_keeps_no_iteration_count_is_refused_at_the_call(tmp_path):
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader

    from spotguard.integrations.fabric import guarded

    loader = Fabric(accelerator="cpu", devices=1).setup_dataloaders(DataLoader([1, 2]))
    del loader._num_iter_calls  # what a Lightning that renamed it would hand over
    with pytest.raises(RuntimeError, match="_num_iter_calls"):
        guarded(Fabric(accelerator="cpu", devices=1), str(tmp_path), "none", models=[], dataloader=loader)


def test_a_resumed_checkpoint_goes_to_fabrics_own_format_and_fabric_load_reads_it(tmp_path):
    """Tools that read `fabric.save` checkpoints get spotguard's newest committed step this way."""
    import torch
    from lightning.fabric import Fabric

    from spotguard.integrations.fabric import guarded

    fabric = Fabric(accelerator="cpu", devices=1)

    def set_up(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        return fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    model, optimizer = set_up(0)
    with guarded(fabric, str(tmp_path / "ckpt"), "none", models=[model], optimizers=[optimizer], save_every=3) as run:
        for step in range(1, 4):
            fabric.backward(model(torch.randn(4, 8)).square().mean())
            optimizer.step()
            optimizer.zero_grad()
            run.step(step)  # a background save of step 3, finished when the block ends
    saved = [p.detach().clone() for p in model.parameters()]

    model, optimizer = set_up(1)  # a new process would start like this
    with guarded(fabric, str(tmp_path / "ckpt"), "none", models=[model], optimizers=[optimizer]) as run:
        assert run.resume() == 4
        fabric.save(tmp_path / "fabric.ckpt", {"model": model, "optimizer": optimizer})
    model, optimizer = set_up(2)
    fabric.load(tmp_path / "fabric.ckpt", {"model": model, "optimizer": optimizer})
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), saved))
    assert optimizer.state_dict()["state"]  # the momentum came along
