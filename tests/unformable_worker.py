"""The example under torchrun, in a job whose next generation can never be formed: a stand-in for a survivor
that never arrives (tests/test_inprocess.py). Test code: the fault is injected here, not in spotguard."""

import runpy
import sys
from pathlib import Path

from spotguard.inprocess import generation, runner


def never_formed(following, *args, **kwargs):
    if following.number == 0:
        return generation.form(following, *args, **kwargs)
    raise generation.FormError(f"generation {following.number}: a member never came (injected)")


runner.form = never_formed
sys.argv[0] = str(Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py")
runpy.run_path(sys.argv[0], run_name="__main__")
