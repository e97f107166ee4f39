"""The one place the runtime asks the planner for a microbatch's minimum-call plan.

:meth:`HartsEngine.plan <harts_runtime.engine.HartsEngine.plan>` plans a step (its step plan, then the
call plan of each microbatch this rank runs) and passes every call plan down; the microbatch below
(:func:`harts_runtime.microbatch.make_microbatch`, :func:`~harts_runtime.microbatch.run_microbatch`)
never plans. A caller that runs one microbatch by hand (a test, a benchmark) gets its call plan from
:func:`microbatch_call_plan`, the same call the engine makes.
"""

from __future__ import annotations

import numpy as np

__all__ = ["microbatch_call_plan"]


def microbatch_call_plan(model, step, traj_indices, *, planner=None):
    """The minimum-call plan (``harts_planner.CallPlan``) of the microbatch of trajectories
    ``traj_indices`` of ``step`` (a :class:`~harts_runtime.step_inputs.StepInputs`) for ``model`` (a
    :class:`~harts_runtime.models.HybridModel`, or its :class:`~harts_runtime.models.ModelConfig`):
    its rounds at the model's ``chunk_size`` and convolution width. ``planner``: a
    :class:`harts_planner.Planner` (in-process or a sidecar; None: the in-process
    ``harts_planner.plan_calls``). No trajectories: None (the empty microbatch needs no plan). Bad
    trajectory ids raise the planner's error naming them."""
    if len(traj_indices) == 0:
        return None
    cfg = getattr(model, "config", model)
    if planner is None:
        from harts_planner import plan_calls
    else:
        plan_calls = planner.plan_calls
    traj = np.asarray(traj_indices, dtype=np.int64)
    return plan_calls(step.batch, cfg.chunk_size, microbatch=traj, conv_width=cfg.conv_size)
