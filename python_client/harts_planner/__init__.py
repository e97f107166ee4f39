"""harts_planner: HARTS prefix-aware planning for rollout-tree training.

Public API::

    from harts_planner import Planner, RolloutBatch
    batch = RolloutBatch.from_token_lists([[1, 2, 3], [1, 2, 4]])
    batch.compact_tokens  # 4
    plan = Planner().plan_step(batch, dp_size=1, capacity=8)        # in-process
    # Planner("127.0.0.1:50051").plan_step(...) asks a `harts-planner serve` sidecar instead
"""

from harts_planner._native import MAX_SEMANTIC_TOKENS, MAX_TRAJECTORIES
from harts_planner.batch import PackedTokens, RolloutBatch, SegmentTree
from harts_planner.call_plan import (
    CallLayout,
    CallPlan,
    CallPlanDebug,
    max_plan_bytes,
    plan_calls,
    set_max_plan_bytes,
)
from harts_planner.cp_split import CpSplit, plan_cp
from harts_planner.errors import (
    CancelToken,
    HartsError,
    InfeasibleError,
    InvalidArgumentError,
    PlanCancelledError,
    ResourceLimitError,
)
from harts_planner.planner import Planner
from harts_planner.step_plan import (
    DEFAULT_CAPACITY,
    CostLimits,
    PlanCost,
    StepPlan,
    estimate_call_plans,
    estimate_cost,
    plan_step,
)

__version__ = "0.1.0"

__all__ = [
    "RolloutBatch",
    "PackedTokens",
    "SegmentTree",
    "Planner",
    "CallPlan",
    "CallLayout",
    "CallPlanDebug",
    "plan_calls",
    "StepPlan",
    "plan_step",
    "DEFAULT_CAPACITY",
    "CpSplit",
    "plan_cp",
    "CancelToken",
    "PlanCancelledError",
    "estimate_cost",
    "estimate_call_plans",
    "PlanCost",
    "CostLimits",
    "max_plan_bytes",
    "set_max_plan_bytes",
    "HartsError",
    "InvalidArgumentError",
    "ResourceLimitError",
    "InfeasibleError",
    "MAX_TRAJECTORIES",
    "MAX_SEMANTIC_TOKENS",
]
