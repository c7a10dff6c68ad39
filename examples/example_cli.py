"""What the framework examples share: their common options, their logging, `--pause-file`, FSDP2 sharding, the exit.

`--pause-file` stops a run at a chosen step, to interrupt it, then lets it go on. Write a step
number into the file: every rank waits after finishing that step (or a later one)
until the file is removed. The tests use it to interrupt each run at an exact, random step
however fast or slow the machine is; by hand: `echo 5 > pause`, then send SIGTERM or raise a
notice, then `rm pause`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def arguments(doc: str) -> argparse.ArgumentParser:
    """The options every framework example takes (add its own, then parse)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--cloud", default="auto", choices=["auto", "aws", "gcp", "azure", "none"])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--pause-file", help="wait after the step this file names, until it is removed")
    parser.add_argument("--out", help="write the final weights' digest here as JSON (rank 0)")
    return parser


def log_spotguard() -> None:
    """Warnings from everything, and spotguard's own steps: the agreed step, the save, the commit."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("spotguard").setLevel(logging.INFO)


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


def shard_with_fsdp2(model: torch.nn.Sequential, mesh: DeviceMesh) -> torch.nn.Sequential:
    """FSDP2 (`fully_shard`, torch >= 2.6) over a 1-D `mesh`: each rank keeps its shard of every Linear."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(model, FSDPModule):  # Lightning may call configure_model again (validate, test)
        return model
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def end_process() -> NoReturn:
    """Leave the process group and exit 0 without the interpreter's teardown, once everything is written.

    With gloo that teardown can abort ("terminate called without an active exception": work its threads
    still hold is destroyed without the interpreter), even after `destroy_process_group()`: seen in about
    one in twenty FSDP2 runs on CPU, in runs never interrupted too.
    """
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
