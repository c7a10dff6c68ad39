"""Where a stuck rank stands: every thread's stack in its log, one line for the job's report, and the
ranks that hold the others up.

In a hang every rank stops stepping: the one stuck in user code, and all the others waiting for it in
the next collective. The step each last reported tells them apart when the culprit is behind; when all
report the same step (the culprit hangs before its next collective), the main thread's stack does: the
others wait inside torch (a collective, DDP's backward), the culprit does not.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import threading
import traceback
from types import FrameType

log = logging.getLogger(__name__)

# Where a main thread waits for the other ranks: torch's collectives and the backward pass that runs them.
IN_TORCH = ("/torch/distributed/", "/torch/autograd/", "/torch/nn/parallel/", "/torch/_tensor.py", "/torch/cuda/")


@dataclasses.dataclass(frozen=True)
class RankReport:
    """One rank's line in a hang's report (crosses ranks through the store, as JSON)."""

    rank: int
    last_step: int | None
    in_torch: bool  # its main thread waits inside torch (a collective, the backward pass)
    where: str  # the main thread's innermost frame: file:line in function

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, line: str) -> RankReport:
        return cls(**json.loads(line))


def log_all_stacks(why: str) -> None:
    """Every thread's stack of this process, in the log (one record: nothing interleaves with it)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = [f"stacks of every thread ({why}):"]
    for ident, frame in sys._current_frames().items():
        parts.append(f'--- thread "{names.get(ident, ident)}"')
        parts.append("".join(traceback.format_stack(frame)).rstrip())
    log.error("%s", "\n".join(parts))


def report(rank: int, last_step: int | None) -> RankReport:
    """This rank's line: where its main thread is now."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    return RankReport(rank=rank, last_step=last_step, in_torch=_in_torch(frame), where=_innermost(frame))


def culprits(reports: list[RankReport], world_size: int) -> tuple[tuple[int, ...], str]:
    """The ranks that hold the others up, and why those: what the lines that came say first, then the ranks
    whose line never came (a line can be late for reasons of its own, a slow connection; a rank stuck in its
    own code while every other that answered waits in torch is the culprit either way)."""
    if world_size == 1:
        return (0,), "the only rank"
    steps = [r.last_step if r.last_step is not None else -1 for r in reports]
    behind = [r.rank for r, s in zip(reports, steps) if s < max(steps, default=-1)]
    if behind:
        return tuple(sorted(behind)), "behind the others"
    outside = [r.rank for r in reports if not r.in_torch]
    if 0 < len(outside) < len(reports):
        return tuple(sorted(outside)), "outside torch while the others wait in it"
    missing = sorted(set(range(world_size)) - {r.rank for r in reports})
    if missing:
        return tuple(missing), "did not answer (every thread stuck)"
    return (), "every rank at the same step and the same kind of place"


def _in_torch(frame: FrameType | None) -> bool:
    while frame is not None:
        if any(part in frame.f_code.co_filename.replace("\\", "/") for part in IN_TORCH):
            return True
        frame = frame.f_back
    return False


def _innermost(frame: FrameType | None) -> str:
    """The innermost frame, and the innermost of the training's own code when that is further out."""
    if frame is None:
        return "?"
    where = _frame(frame)
    own = frame
    while own is not None and _library(own.f_code.co_filename):
        own = own.f_back
    return where if own is None or own is frame else f"{where}, from {_frame(own)}"


def _frame(frame: FrameType) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def _library(filename: str) -> bool:
    """Python's own modules and installed packages (torch), not the training script's code."""
    path = filename.replace("\\", "/")
    return "/lib/python" in path or "site-packages" in path or path.startswith("<")
