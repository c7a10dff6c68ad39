"""The save plan made once per state layout and reused by every later save of that layout.

A DCP save plans before it writes: each rank lists its write items, rank 0 gathers the N lists,
de-duplicates the replicated tensors, builds the global metadata and scatters the N plans back.
At 1,024 ranks with hundreds of tensors each that is hundreds of thousands of items through one
process, inside an emergency's deadline. DCP can cache all of it (`enable_plan_caching`): a rank
whose items are unchanged sends an empty plan, rank 0 reuses its cached global plan and metadata,
and scatters empty plans back. The periodic saves make the plan, so the emergency save of the same
layout finds it made. A layout that changed (an optimizer's state appearing after its first step)
is planned anew, for the ranks whose items changed only.

DCP keeps its caches in class attributes under a key that is, by default, the planner's class name:
two checkpointers in one process would read each other's plans. Each planner here has a key of
its own, and drops its entries when its checkpointer closes (rank 0's hold every rank's plan).
"""

from __future__ import annotations

import itertools
import logging

from torch.distributed.checkpoint import DefaultSavePlanner, SavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

log = logging.getLogger(__name__)

_numbers = itertools.count()
# DCP's class-level caches, each keyed by a planner's key.
_CACHES = (
    "_cached_save_plan",
    "_cached_all_plans",
    "_cached_global_plan",
    "_cached_metadata",
    "_cached_final_save_plan",
)


class CachedPlanner(DefaultSavePlanner):
    """DCP's default save planner with plan caching, under a key of its own. One per group of ranks:
    every rank of the group uses its own in the same order of saves."""

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=True)
        self._cached_plans_key = f"spotguard-plan-{next(_numbers)}"
        self.reused: bool | None = None  # rank 0, after a global plan: whether it was the cached one

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        self.reused = self._cached_plans_key in SavePlanner._cached_all_plans and not any(p.usable for p in all_plans)
        return super().create_global_plan(all_plans)

    def forget(self) -> None:
        """Drop this planner's cached plans (rank 0's hold the whole job's)."""
        for name in _CACHES:
            getattr(SavePlanner, name).pop(self._cached_plans_key, None)
