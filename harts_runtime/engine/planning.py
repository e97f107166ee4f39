"""The one place the runtime asks the planner for plans: a step's plan (:func:`plan_step`) and a
microbatch's minimum-call plan (:func:`microbatch_call_plan`).

:meth:`HartsEngine.plan <harts_runtime.engine.HartsEngine.plan>` plans a step (its step plan, then the
call plan of each microbatch this rank runs) and passes every call plan down; the microbatch below
(:func:`harts_runtime.microbatch.make_microbatch`, :func:`~harts_runtime.microbatch.run_microbatch`)
never plans. A caller that runs microbatches by hand (:func:`harts_runtime.train.plan_microbatches`,
a test, a benchmark) gets its plans from these functions, the same calls the engine makes. No other
runtime module imports the planner's planning entry points (the import-linter contract
``planning-in-engine``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["microbatch_call_plan", "plan_step"]


def plan_step(model, step, dp_size: int, capacity: int, *, planner=None, cp_size: int = 1, **options):
    """The step plan (``harts_planner.StepPlan``: microbatches of at most ``capacity`` compact rows
    each, ``cp_size`` x that with context parallelism, on ``dp_size`` DP replicas and their slots)
    of ``step`` (a :class:`~harts_runtime.step_inputs.StepInputs`) for ``model`` (a
    :class:`~harts_runtime.models.HybridModel` or its :class:`~harts_runtime.models.ModelConfig`: its
    ``chunk_size``). ``planner``: a :class:`harts_planner.Planner` (in-process or a sidecar; None:
    the in-process one). ``options``: the planner's (``microbatch_cost``, ...). Bad arguments raise
    the planner's error naming them."""
    cfg = getattr(model, "config", model)
    if planner is not None:
        return planner.plan_step(step.batch, dp_size, capacity, cfg.chunk_size, cp_size=cp_size, **options)
    from harts_planner.step_plan import plan_step as plan

    if cp_size != 1:
        options["cp_size"] = cp_size
    return plan(step.batch, dp_size, capacity, cfg.chunk_size, **options)


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
        from harts_planner.call_plan import plan_calls
    else:
        plan_calls = planner.plan_calls
    traj = np.asarray(traj_indices, dtype=np.int64)
    return plan_calls(step.batch, cfg.chunk_size, microbatch=traj, conv_width=cfg.conv_size)
