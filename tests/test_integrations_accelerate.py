"""A hand-written Accelerate loop (DDP, 2 CPU processes under torchrun, dropout on) guarded by
`spotguard.integrations.accelerate.guarded`: an AWS notice at a random step, then SIGTERM to one
rank only at a later one; each time every rank stops at the agreed step, the checkpoint is
committed and the next run resumes at the step after it (data position and per-rank RNG
restored); a later save killed mid-write is ignored, and the run ends bit-identical to a run
that never stopped."""

import pytest

pytest.importorskip("accelerate")

from tests.framework_runs import notice_then_sigterm_then_finish  # noqa: E402


def test_notice_then_sigterm_to_one_rank_each_stop_every_rank_and_the_run_ends_bit_identical(tmp_path, request):
    notice_then_sigterm_then_finish("accelerate_train.py", tmp_path, request.node.nodeid, 0, 23)  # 3 epochs of 8
