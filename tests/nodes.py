"""The nodes of the multi-node tests (spotguard.demo.localnodes) running examples/train_ddp.py (or
`script`) from this checkout."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from spotguard.demo import localnodes
from spotguard.demo.localnodes import LocalNode as Node
from spotguard.demo.localnodes import stop_all

__all__ = [
    "Node",
    "join_node",
    "json_lines",
    "rendezvous",
    "run_nodes",
    "start_nodes",
    "stop_all",
    "worker_exit_code",
    "worker_pids",
]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = [str(ROOT / "examples" / "train_ddp.py")]
CHECKOUT = {"PYTHONPATH": str(ROOT)}  # the workers import this checkout's spotguard
# torchrun's report of a worker that ended with a non-zero status (a signal: a negative one)
WORKER_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")


def start_nodes(
    nnodes: int,
    ckpt: str,
    tmp: Path,
    args: list[str],
    env: dict[str, str] | None = None,
    *,
    script: list[str] = EXAMPLE,
    nproc_per_node: int | Sequence[int] = 1,
) -> list[Node]:
    return localnodes.start_nodes(nnodes, script, ckpt, tmp, args, {**CHECKOUT, **(env or {})}, nproc_per_node)


def join_node(
    job: Node, rank: int, ckpt: str, tmp: Path, args: list[str], env: dict[str, str] | None = None,
    *, script: list[str] = EXAMPLE,
) -> Node:  # fmt: skip
    """A node that joins the running job of `job` (its node 0) in-process, running the example (or `script`)."""
    return localnodes.joining_node(job, rank, script, ckpt, tmp, args, {**CHECKOUT, **(env or {})})


def run_nodes(
    nnodes: int,
    ckpt: str | Path,
    tmp: Path,
    args: list[str],
    out: Path | None = None,
    *,
    script: list[str] = EXAMPLE,
    nproc_per_node: int | Sequence[int] = 1,
) -> dict | None:
    return localnodes.run_nodes(nnodes, script, ckpt, tmp, args, out, CHECKOUT, nproc_per_node)


def rendezvous(nnodes: str, max_restarts: int) -> localnodes.Rendezvous:
    """An elastic job's rendezvous, hosted by the test, whose nodes run the example."""
    return localnodes.Rendezvous(nnodes, max_restarts, EXAMPLE, CHECKOUT)


def worker_exit_code(node: Node, local_rank: int = 0) -> int:
    """The exit status of the node's worker `local_rank` (the agent itself exits 1 for any failure):
    0 when torchrun reported no failure of it, the node having ended."""
    found = [int(code) for code, rank in WORKER_FAILED.findall(node.output()) if int(rank) == local_rank]
    return found[0] if found else 0


def worker_pids(node: Node) -> set[int]:
    """The pids of every process the node's agent runs now (its workers)."""
    return set(localnodes._descendants(node.proc.pid))


def json_lines(node: Node, key: str) -> list[dict]:
    """The JSON records the node's workers printed whose first key is `key`, once the node has ended."""
    return [json.loads(line) for line in node.output().splitlines() if line.startswith(f'{{"{key}"')]
