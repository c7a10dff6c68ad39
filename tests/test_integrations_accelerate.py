"""A hand-written Accelerate loop (DDP, 2 CPU processes under torchrun, dropout on) guarded by
`spotguard.integrations.accelerate.guarded`: an AWS notice at a random step, then SIGTERM to one
rank only at a later one; each time every rank stops at the agreed step, the checkpoint is
committed and the next run resumes at the step after it (data position and per-rank RNG
restored); a later save SIGKILLed mid-write (every process, for real) is ignored, and the run
ends bit-identical to a run that never stopped."""

import json
import os
import signal

import pytest

pytest.importorskip("accelerate")

from tests.framework_runs import TORCHRUN, Run, notice_then_sigterm_then_finish, steps_by_rank  # noqa: E402


def test_notice_then_sigterm_to_one_rank_each_stop_every_rank_and_the_run_ends_bit_identical(tmp_path, request):
    # 3 epochs of 8 steps; a 57 MB state (--hidden): its save (~0.2 s) is long enough for a real SIGKILL to cut.
    wide = ("--hidden", str(2**18))
    notice_then_sigterm_then_finish("accelerate_train.py", tmp_path, request.node.nodeid, 0, 23, args=wide, kill=True)


def test_a_one_process_checkpoint_resumes_on_two_where_the_new_rank_keeps_its_own_rng(tmp_path):
    """The new rank finds no RNG of its own in the step (its per-rank key was never written) and keeps its own."""
    one_process = tuple(arg.replace("--nproc-per-node=2", "--nproc-per-node=1") for arg in TORCHRUN)
    (tmp_path / "pause").write_text("3")
    run = Run("accelerate_train.py", tmp_path, launcher=one_process)
    run.wait_for(lambda out: steps_by_rank(out).get(0, [{}])[-1].get("step") == 3, "rank 0 at step 3")
    os.kill(steps_by_rank(run.out)[0][-1]["pid"], signal.SIGTERM)
    run.wait_for(lambda out: "all 1 ranks agreed on step 3 (emergency)" in out, "agreement")
    (tmp_path / "pause").unlink()
    code, out = run.finish()
    assert json.loads((tmp_path / "exit.json").read_text())["exit_code"] == 143, out[-3000:]

    code, out = Run("accelerate_train.py", tmp_path).finish()
    assert code == 0, out[-3000:]
    assert "rank 1: step-0000000003 has no 'rng_1' (saved by 1 ranks): left as it is" in out, out[-3000:]
    assert {r: s[0]["step"] for r, s in steps_by_rank(out).items()} == {0: 4, 1: 4}, out[-3000:]


def test_a_resumed_checkpoint_goes_to_accelerates_own_format_and_load_state_reads_it(tmp_path):
    """Tools that read Accelerate's `save_state` layout get spotguard's newest committed step this way."""
    import torch
    from accelerate import Accelerator

    from spotguard.integrations.accelerate import guarded

    def prepared(seed):  # what a new process starts with (an Accelerator remembers what it prepared)
        accelerator = Accelerator(cpu=True)
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return (accelerator, *accelerator.prepare(model, optimizer))

    ckpt = str(tmp_path / "ckpt")
    accelerator, model, optimizer = prepared(0)
    with guarded(accelerator, ckpt, "none", models=[model], optimizers=[optimizer], save_every=3) as run:
        for step in range(1, 4):
            accelerator.backward(model(torch.randn(4, 8)).square().mean())
            optimizer.step()
            optimizer.zero_grad()
            run.step(step)  # a background save of step 3, finished when the block ends
    saved = [p.detach().clone() for p in model.parameters()]

    accelerator, model, optimizer = prepared(1)
    with guarded(accelerator, ckpt, "none", models=[model], optimizers=[optimizer]) as run:
        assert run.resume() == 4
        accelerator.save_state(str(tmp_path / "accelerate"))
    accelerator, model, optimizer = prepared(2)
    accelerator.load_state(str(tmp_path / "accelerate"))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), saved))
    assert optimizer.state_dict()["state"]  # the momentum came along
