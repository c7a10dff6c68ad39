"""Whether a job that loses some of its ranks goes on in the survivors' processes (in-process recovery,
`spotguard.run`), or ends as it would without it. The answer is the same on every rank: it depends only on
what every rank knows alike (the ranks lost, the world size, `min_nodes`)."""

from __future__ import annotations

import logging
from collections.abc import Collection

from spotguard.job.topology import ranks_per_node

log = logging.getLogger("spotguard.guard")


def survivors(lost: Collection[int], world_size: int, min_nodes: int) -> tuple[int, ...]:
    """The ranks the job goes on with once the ranks `lost` are gone, in order; () when it must end as without
    in-process recovery (said in the log): rank 0's node is among them (torchrun keeps the workers' store
    there: node 0's agent, or rank 0 itself), or fewer than `min_nodes` nodes would stay."""
    if 0 in lost:
        log.warning("in-process recovery: the node of rank 0 is gone, and the job's store may be gone with it: the "
                    "job ends as without it")  # fmt: skip
        return ()
    staying = tuple(r for r in range(world_size) if r not in lost)
    nodes = len(staying) // ranks_per_node()
    if nodes < min_nodes:
        log.warning("in-process recovery: %d node(s) would stay, fewer than min_nodes=%d: the job ends as without it",
                    nodes, min_nodes)  # fmt: skip
        return ()
    return staying
