"""Hugging Face's Trainer (DDP, 2 CPU processes under torchrun, a tiny GPT-2 with dropout) with
SpotGuardTrainerCallback: an AWS notice at a random step, or SIGTERM to one rank only; every rank
stops at the agreed step, the checkpoint is committed, the next run resumes at the step after it
(through the Trainer's own skip and RNG restore) and ends bit-identical to a run that never stopped."""

import pytest

pytest.importorskip("transformers")

from tests.torchrun_examples import aws_notice, reference_run, sigterm_to_rank_1  # noqa: E402

SCRIPT = "hf_trainer_train.py"
STEPS = 12  # 3 epochs of 4 optimizer steps (8 batches per rank, 2 accumulated per step)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(SCRIPT, tmp_path_factory.mktemp("reference"))


def test_aws_notice_at_a_random_step_stops_every_rank_and_resumes_bit_identical(tmp_path, reference, request):
    aws_notice(SCRIPT, tmp_path, reference, request.node.nodeid, STEPS)


def test_sigterm_to_one_rank_only_takes_the_same_path(tmp_path, reference, request):
    sigterm_to_rank_1(SCRIPT, tmp_path, reference, request.node.nodeid, STEPS)


def test_misuse_fails_with_a_clear_error(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from spotguard.integrations.hf import SpotGuardTrainerCallback, train

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=1, n_embd=8, vocab_size=16, n_positions=8))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1)
    with pytest.raises(ValueError, match="one SpotGuardTrainerCallback"):
        train(Trainer(model=model, args=args, train_dataset=[]))
    callback = SpotGuardTrainerCallback(str(tmp_path / "ckpt"), cloud="none")
    with pytest.raises(ValueError, match="resume_from_checkpoint is spotguard's"):
        train(Trainer(model=model, args=args, callbacks=[callback]), resume_from_checkpoint=True)
    args.enable_jit_checkpoint = True
    with pytest.raises(ValueError, match="enable_jit_checkpoint must stay off"):
        train(Trainer(model=model, args=args, callbacks=[callback]))
