"""Hugging Face's Trainer (DDP, 2 CPU processes under torchrun, a tiny GPT-2 with dropout) with
SpotGuardTrainerCallback: an AWS notice at a random step, then SIGTERM to one rank only at a later
one; each time every rank stops at the agreed step, the checkpoint is committed and the next run
resumes at the step after it (through the Trainer's own `resume_from_checkpoint` skip and RNG
restore); a later save killed mid-write is ignored, and the run ends bit-identical to a run that
never stopped."""

import pytest

pytest.importorskip("transformers")

from tests.framework_runs import notice_then_sigterm_then_finish  # noqa: E402


def test_notice_then_sigterm_to_one_rank_each_stop_every_rank_and_the_run_ends_bit_identical(tmp_path, request):
    # global_step 1 to 12: 3 epochs of 4 optimizer steps (8 batches per rank, 2 accumulated per step)
    notice_then_sigterm_then_finish("hf_trainer_train.py", tmp_path, request.node.nodeid, 1, 12)


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


def test_a_resumed_checkpoint_goes_to_the_trainers_own_format_and_from_pretrained_reads_it(tmp_path):
    """Tools that read Hugging Face models get spotguard's newest committed step this way."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from spotguard.integrations.hf import SpotGuardTrainerCallback, train

    config = GPT2Config(n_layer=1, n_head=1, n_embd=8, vocab_size=16, n_positions=8)
    tokens = torch.randint(0, 16, (16, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": t, "labels": t} for t in tokens]

    def trainer(seed, **options):
        torch.manual_seed(seed)
        args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", max_steps=3,
                                 per_device_train_batch_size=4, save_strategy="no")  # fmt: skip
        callback = SpotGuardTrainerCallback(str(tmp_path / "ckpt"), cloud="none", **options)
        return Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=data, callbacks=[callback])

    first = trainer(0, save_every=3)
    train(first)  # a background save of step 3, finished when train() returns
    saved = {k: v.clone() for k, v in first.model.state_dict().items()}

    resumed = trainer(1)  # resumes step 3: nothing is left to train
    train(resumed)
    resumed.save_model(str(tmp_path / "exported"))
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "exported")).state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
