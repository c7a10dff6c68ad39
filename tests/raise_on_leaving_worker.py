"""The example under torchrun with `spotguard.run(..., exit_code=None)`, whose training function raises on the
rank that leaves once its step returned True (tests/test_inprocess.py): `run` still returns to the caller, and
the survivors go on. Test code: the fault is injected here."""

import functools
import runpy
import sys
from pathlib import Path

import spotguard
from spotguard.inprocess.context import Context

step = Context.step


def raising_step(self: Context, at: int, state: dict) -> bool:
    stop = step(self, at, state)
    if stop and self.guard.leaving:
        raise RuntimeError("injected: the training function fails as its rank leaves")
    return stop


Context.step = raising_step
spotguard.run = functools.partial(spotguard.run, exit_code=None)
sys.argv[0] = str(Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py")
runpy.run_path(sys.argv[0], run_name="__main__")
