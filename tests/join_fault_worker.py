"""The example under torchrun, with faults injected for the join tests (tests/test_inprocess.py): test code,
not spotguard's. SPOTGUARD_TEST_FORM_TIMEOUT shortens the wait for a generation's members (s); with
SPOTGUARD_TEST_VANISH set, a joining process dies as soon as the job has taken it in, before it forms the
generation it was given (its VM reclaimed at that moment)."""

import os
import runpy
import sys
from pathlib import Path

from spotguard.inprocess import generation, runner

if "SPOTGUARD_TEST_FORM_TIMEOUT" in os.environ:
    generation.FORM_TIMEOUT_S = float(os.environ["SPOTGUARD_TEST_FORM_TIMEOUT"])
if "SPOTGUARD_TEST_VANISH" in os.environ:

    def vanish(*args, **kwargs):
        print("joining process: taken in, vanishing before the generation forms", flush=True)
        os._exit(1)

    runner.form = vanish

sys.argv[0] = str(Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py")
runpy.run_path(sys.argv[0], run_name="__main__")
