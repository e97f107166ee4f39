"""The trajectory-wise baseline's plan-like packing (what the step loop reads of a step plan)."""

from __future__ import annotations

import numpy as np

from harts_runtime.step_inputs import StepInputs

__all__ = ["TrajectoryPlan"]


class TrajectoryPlan:
    """The trajectory-wise baseline as a plan-like object: first-fit-decreasing packs of expanded
    trajectories at the capacity, dealt to replicas round-robin by size."""

    def __init__(self, step: StepInputs, capacity: int, dp: int):
        from harts_runtime.layout.rows import pack_trajectories

        lengths = np.asarray(step.batch.lengths, dtype=np.int64)
        packs = sorted(pack_trajectories(lengths, capacity), key=lambda p: -int(lengths[p].sum()))
        self.microbatches = packs
        self.dp_size = dp
        self.replica = np.arange(len(packs)) % dp
        self.slot = np.arange(len(packs)) // dp
