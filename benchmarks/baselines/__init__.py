"""Peer planning baselines for `benchmarks/planner_quality.py` (comparison only, not product code).

Every baseline maps a :class:`harts_planner.RolloutBatch`, a DP degree ``D`` and a capacity ``T``
(compact tokens per microbatch) to a :class:`~baselines.common.BaselinePlan` that satisfies the same
guarantees as :func:`harts_planner.plan_step` (exact coverage, non-empty microbatches of at most ``T``
compact tokens, ``K mod D = 0``, ``K / D`` microbatches per replica, one per slot), so the
benchmark can score them all with the same metrics (``harts_planner.step_plan.schedule_metrics``).

* :mod:`baselines.ortools_baseline`  -- Section 5.2's OR-Tools planning baseline (our reconstruction
  of Tree Training's partitioner: shard-level FFD to replicas, a CP-SAT partition per replica,
  equalizing splits).
* :mod:`baselines.dta_balancer`      -- AReaL-DTA's DP load balancer (binary-searched contiguous cuts
  of the DFS-ordered leaves), extended to capacity-bounded microbatches.
* :mod:`baselines.prefix_unaware`    -- a conventional packer that sees only raw trajectory lengths.
"""
