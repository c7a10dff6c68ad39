"""A hand-written Accelerate loop (DDP, 2 CPU processes under torchrun, dropout on) guarded by
`spotguard.integrations.accelerate.guarded`: an AWS notice at a random step, or SIGTERM to one
rank only; every rank stops at the agreed step, the checkpoint is committed, the next run resumes
at the step after it (data position and per-rank RNG restored) and ends bit-identical to a run
that never stopped."""

import pytest

pytest.importorskip("accelerate")

from tests.torchrun_examples import aws_notice, reference_run, sigterm_to_rank_1  # noqa: E402

SCRIPT = "accelerate_train.py"
STEPS = 24  # 3 epochs of 8 batches per rank


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(SCRIPT, tmp_path_factory.mktemp("reference"))


def test_aws_notice_at_a_random_step_stops_every_rank_and_resumes_bit_identical(tmp_path, reference, request):
    aws_notice(SCRIPT, tmp_path, reference, request.node.nodeid, STEPS)


def test_sigterm_to_one_rank_only_takes_the_same_path(tmp_path, reference, request):
    sigterm_to_rank_1(SCRIPT, tmp_path, reference, request.node.nodeid, STEPS)
