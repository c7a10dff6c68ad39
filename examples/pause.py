"""`--pause-file` for the framework examples: stop at a chosen step, interrupt, go on.

Write a step number into the file: every rank waits after finishing that step (or a later one)
until the file is removed. The tests use it to interrupt each run at an exact, random step
however fast or slow the machine is; by hand: `echo 5 > pause`, then send SIGTERM or raise a
notice, then `rm pause`.
"""

from __future__ import annotations

import time
from pathlib import Path


def wait_while_paused(pause_file: str | None, step: int) -> None:
    """Return once `pause_file` does not name a step at or before `step` (at once without one)."""
    while pause_file:
        try:
            at = int(Path(pause_file).read_text())
        except (OSError, ValueError):  # no file, or one being written: no pause
            return
        if step < at:
            return
        time.sleep(0.05)
