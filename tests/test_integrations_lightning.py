"""Lightning's Trainer (DDP, 2 CPU processes started by Lightning itself) with SpotGuardCallback:
an AWS notice at a random step, then SIGTERM to one rank only at a later one; each time every rank
stops at the agreed step, the checkpoint is committed and the next run resumes at the step after
it; a later save killed mid-write is ignored, and the run ends bit-identical to a run that never
stopped."""

import sys

import pytest

pytest.importorskip("lightning")

from tests.framework_runs import notice_then_sigterm_then_finish  # noqa: E402


def test_notice_then_sigterm_to_one_rank_each_stop_every_rank_and_the_run_ends_bit_identical(tmp_path, request):
    # global_step 1 to 24: 3 epochs of 8 batches per rank; `python script.py` (Lightning starts rank 1)
    notice_then_sigterm_then_finish("lightning_train.py", tmp_path, request.node.nodeid, 1, 24, (sys.executable,))
