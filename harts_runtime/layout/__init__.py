"""Plan arrays -> device index tensors: the one place where a microbatch's rows are laid out.

* :mod:`~harts_runtime.layout.contract`: what the runtime reads from a call plan
  (:class:`CallLayoutArrays`, 8 scalars and 27 arrays; any object with them will do);
* :mod:`~harts_runtime.layout.rows`: :class:`RowLayout` (what every layer reads),
  :class:`Microbatch` (plus what the loss reads), the compact and trajectory microbatches, the
  baseline's packing, the LM-head chunks;
* :mod:`~harts_runtime.layout.kda_plan`: KDA rounds, schedules and the execution plan;
* :mod:`~harts_runtime.layout.views`: packed Q / ancestor-KV views for full attention;
* :mod:`~harts_runtime.layout.conv`: the short convolution's window tables.
"""

from harts_runtime.layout.contract import LAYOUT_ARRAYS, LAYOUT_SCALARS, CallLayoutArrays, check_call_layout
from harts_runtime.layout.kda_plan import KDAExecutionPlan, KDARound, KDASchedule, segment_schedule
from harts_runtime.layout.rows import (
    MODES,
    Microbatch,
    RowLayout,
    compact_layout,
    compact_microbatch,
    lm_chunks,
    microbatch_targets,
    pack_trajectories,
    trajectory_layout,
    trajectory_microbatch,
)
from harts_runtime.layout.views import AttentionViews, Branches, TreeOrder, build_views, expand_ranges

__all__ = [
    "LAYOUT_ARRAYS",
    "LAYOUT_SCALARS",
    "MODES",
    "AttentionViews",
    "Branches",
    "CallLayoutArrays",
    "KDAExecutionPlan",
    "KDARound",
    "KDASchedule",
    "Microbatch",
    "RowLayout",
    "TreeOrder",
    "build_views",
    "check_call_layout",
    "compact_layout",
    "compact_microbatch",
    "expand_ranges",
    "lm_chunks",
    "microbatch_targets",
    "pack_trajectories",
    "segment_schedule",
    "trajectory_layout",
    "trajectory_microbatch",
]
