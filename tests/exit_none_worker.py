"""The example under torchrun with `spotguard.run(..., exit_code=None)`: the caller decides how each process
ends (tests/test_inprocess.py). Test code: the option is given here, as a user's script would."""

import functools
import runpy
import sys
from pathlib import Path

import spotguard

spotguard.run = functools.partial(spotguard.run, exit_code=None)
sys.argv[0] = str(Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py")
runpy.run_path(sys.argv[0], run_name="__main__")
