"""Elastic runs under torchrun's agent (`--nnodes=MIN:MAX --rdzv-backend=c10d --max-restarts=K`).

What the agent does (torch.distributed.elastic.agent.server.api, `_invoke_run`): when a worker
exits non-zero and restarts remain, it stops its other workers and re-rendezvouses (one restart
used); when another node's agent waits at the rendezvous, it stops its workers (SIGTERM, SIGKILL 30 s
later) and re-rendezvouses (no restart used); a round closes with whichever agents are alive, at
least MIN of them. spotguard rides on that: after an emergency the survivors exit 143 / 75 as
always, their agents form a smaller round, and the new workers resume the committed step at the
smaller world size. A joining node's SIGTERM is a signal notice like any other: the workers commit
the current step within `grace_s` and exit, and the larger round resumes it.

Two kinds of node must not rejoin, so their node leader takes its agent out of the job (SIGTERM to
the agent: a signalled agent leaves the rendezvous open for the others, and its heartbeat stops):
- a node reclaimed by its cloud: for the seconds before its VM vanishes it would join the next
  round, which would then fail with it;
- survivors fewer than `min_nodes`: their round could not close before the agent's join timeout;
  stopping now leaves the "restart me" exit code in SPOTGUARD_EXIT_FILE for the scheduler.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from spotguard.job.topology import ranks_per_node

log = logging.getLogger(__name__)

MIN_NODES_ENV = "SPOTGUARD_MIN_NODES"  # torchrun's MIN (--nnodes=MIN:MAX); workers are not told it


def agent_restarts() -> bool:
    """Whether a torchrun agent would start new workers after this one exits non-zero."""
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0


def min_nodes(value: int | None) -> int:
    """`value`, else $SPOTGUARD_MIN_NODES, else 1; a one-line error when it is not a positive int."""
    raw = value if value is not None else os.environ.get(MIN_NODES_ENV, "1")
    try:
        nodes = int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"min_nodes (or ${MIN_NODES_ENV}) must be a positive int, not {raw!r}") from None
    if nodes < 1:
        raise ValueError(f"min_nodes (or ${MIN_NODES_ENV}) must be a positive int, not {raw!r}")
    return nodes


def withdrawal(*, reclaimed: bool, leaving: bool, ranks_left: int, at_least: int) -> str | None:
    """Why this node's agent must leave the job after the emergency, or None to let it restart.

    reclaimed: the notice came from the cloud (not a signal, whose sender stops the agent itself);
    leaving: this node is the one going; ranks_left: ranks staying in the job.
    """
    if not agent_restarts():
        return None
    if leaving and reclaimed:
        return "this node is reclaimed"
    nodes_left = ranks_left // ranks_per_node()
    if not leaving and nodes_left < at_least:
        return f"{nodes_left} node(s) would stay, fewer than min_nodes={at_least}"
    return None


def withdraw_agent(reason: str, *, quiet: bool = False) -> None:
    """SIGTERM this worker's torchrun agent so that it does not rejoin (at exit), then say so unless `quiet`."""
    if threading.current_thread() is threading.main_thread():  # only it may; a silent end's thread exits at once
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the agent passes the signal on to us: we are exiting anyway
    agent = os.getppid()
    os.kill(agent, signal.SIGTERM)
    if not quiet:
        log.warning("leaving the elastic job: %s; stopped this node's torchrun agent (pid %d)", reason, agent)
