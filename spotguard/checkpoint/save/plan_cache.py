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

import inspect
import itertools
import logging
from typing import Any

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


def _defers_local_cache() -> bool:
    """Whether this torch's DCP caches a rank's local plan only once the global plan succeeded: one that
    caches it at once leaves the ranks' caches apart for good after a failed plan (then: no caching)."""
    try:
        return "_pending_local_plan" in inspect.getsource(DefaultSavePlanner.create_local_plan)
    except (OSError, TypeError):
        return False


_CACHING = _defers_local_cache()


class CachedPlanner(DefaultSavePlanner):
    """DCP's default save planner with plan caching, under a key of its own. One per group of ranks:
    every rank of the group uses its own in the same order of saves.

    DCP judges a rank's plan unchanged by its items' names, sizes and places, not their dtypes: a
    tensor cast to another dtype of the same shape would keep the old dtype in the metadata. So a
    rank whose items' dtypes (or layouts) changed sends its plan in full, and it is cached anew."""

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=_CACHING)
        self._cached_plans_key = f"spotguard-plan-{next(_numbers)}"
        self.reused: bool | None = None  # rank 0, after a global plan: whether it was the cached one
        self._kinds: list[Any] | None = None  # of the items of this rank's cached plan: `_kind`
        self._pending_kinds: list[Any] | None = None

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()  # `self.plan`: the whole plan, also when it sends an empty one
        self._pending_kinds = [_kind(item) for item in self.plan.items]
        if not plan.usable and self._pending_kinds != self._kinds:  # unchanged to DCP, not in its dtypes
            self._pending_local_plan = self.plan  # cached once the global plan succeeds, as DCP does
            return self.plan
        return plan

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self._kinds = self._pending_kinds  # what the cached local plan now holds
        return super().finish_plan(new_plan)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        self.reused = self._cached_plans_key in SavePlanner._cached_all_plans and not any(p.usable for p in all_plans)
        return super().create_global_plan(all_plans)

    def forget(self) -> None:
        """Drop this planner's cached plans (rank 0's hold the whole job's)."""
        for name in _CACHES:
            getattr(SavePlanner, name).pop(self._cached_plans_key, None)


def _kind(item: Any) -> tuple[Any, ...]:
    """What of an item DCP's comparison leaves out and its metadata keeps: its dtype and layout (not
    whether it is pinned or needs grad: staged copies differ from the live tensors in both)."""
    data = item.tensor_data
    return (item.index, None) if data is None else (item.index, data.properties.dtype, data.properties.layout)
