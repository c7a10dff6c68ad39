"""The nodes of the multi-node tests (spotguard.demo.localnodes) running examples/train_ddp.py from
this checkout."""

from __future__ import annotations

from pathlib import Path

from spotguard.demo import localnodes
from spotguard.demo.localnodes import LocalNode as Node
from spotguard.demo.localnodes import stop_all

__all__ = ["Node", "rendezvous", "run_nodes", "start_nodes", "stop_all"]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = [str(ROOT / "examples" / "train_ddp.py")]
CHECKOUT = {"PYTHONPATH": str(ROOT)}  # the workers import this checkout's spotguard


def start_nodes(nnodes: int, ckpt: str, tmp: Path, args: list[str], env: dict[str, str] | None = None) -> list[Node]:
    return localnodes.start_nodes(nnodes, EXAMPLE, ckpt, tmp, args, {**CHECKOUT, **(env or {})})


def run_nodes(nnodes: int, ckpt: str | Path, tmp: Path, args: list[str], out: Path | None = None) -> dict | None:
    return localnodes.run_nodes(nnodes, EXAMPLE, ckpt, tmp, args, out, CHECKOUT)


def rendezvous(nnodes: str, max_restarts: int) -> localnodes.Rendezvous:
    """An elastic job's rendezvous, hosted by the test, whose nodes run the example."""
    return localnodes.Rendezvous(nnodes, max_restarts, EXAMPLE, CHECKOUT)
