"""One optimizer step on a model you hold (:func:`train_step`), and the current log-probs of a step
(:func:`step_logprobs`): thin wrappers of :class:`harts_runtime.engine.HartsEngine`'s step loop
for scripts, tests and benchmarks that keep their own model and optimizer. They run exactly what
the engine runs (:meth:`HartsEngine.forward_backward <harts_runtime.engine.HartsEngine.forward_backward>`);
the microbatch beneath is :mod:`harts_runtime.microbatch`.

Timing (Section 5.3): ``plan_seconds`` is planner time (``plan_step`` and every microbatch's
``plan_calls``; with a given ``step_plan``, the call plans alone); ``fbg_seconds`` is the F/B/Grad
interval once plans exist (layout materialisation, forward, log-probs, loss, backward; no optimizer
update); ``core_seconds = plan_seconds + fbg_seconds``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from harts_runtime.engine import EngineConfig, HartsEngine, microbatch_call_plan
from harts_runtime.engine.planning import plan_step
from harts_runtime.errors import InvalidInputError
from harts_runtime.layout.rows import MODES, pack_trajectories
from harts_runtime.options import DEFAULT_CAPACITY
from harts_runtime.recompute import recompute_enabled
from harts_runtime.step_inputs import StepInputs

__all__ = ["StepResult", "plan_microbatches", "step_logprobs", "train_step"]


@dataclass
class StepResult:
    """What one :func:`train_step` did and how long it took."""

    loss: float
    policy_loss: float
    router_loss: float
    mode: str
    recompute: bool
    num_microbatches: int
    semantic_tokens: int
    rows: int
    """Non-replay rows executed (compact rows summed over microbatches; S for the baseline)."""
    replay_tokens: int
    num_calls: int
    """KDA packed calls per KDA layer, summed over microbatches."""
    plan_seconds: float
    fbg_seconds: float
    optimizer_seconds: float

    @property
    def compression(self) -> float:
        """Non-replay row compression ``S / rows``."""
        return self.semantic_tokens / max(self.rows, 1)

    @property
    def core_seconds(self) -> float:
        return self.plan_seconds + self.fbg_seconds

    @classmethod
    def of(cls, out, mode: str, recompute: bool, optimizer_seconds: float = 0.0) -> StepResult:
        """The result of an engine step (:class:`~harts_runtime.engine.EngineOutput`)."""
        m = out.metrics
        return cls(
            float(out.loss),
            float(m["policy_loss"]),
            float(m["router_loss"]),
            mode,
            recompute,
            int(m["microbatches"]),
            int(m["semantic_tokens"]),
            int(m["rows"]),
            int(m["replay_tokens"]),
            int(m["kda_calls"]),
            float(m["plan_seconds"]),
            float(m["fbg_seconds"]),
            optimizer_seconds,
        )

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(compression=self.compression, core_seconds=self.core_seconds)
        return d


def _engine(model, optimizer, mode: str, capacity: int, no_replay: bool) -> HartsEngine:
    """An engine over ``model`` that leaves its train / eval mode, its recomputation and the
    optimizer's learning rate as they are (no clipping, no schedule)."""
    if mode not in MODES:
        raise InvalidInputError("mode", f"unknown {mode!r}; choose one of {MODES}")
    training = model.training
    cfg = EngineConfig(
        mode=mode,
        capacity=capacity,
        no_replay=no_replay,
        compact_always=True,  # the mode asked for, on every microbatch
        max_grad_norm=None,
        lr_schedule="external",
    )
    engine = HartsEngine(model, cfg, optimizer=optimizer if optimizer is not None else _NoOptimizer())
    model.train(training)
    return engine


class _NoOptimizer:
    """No optimizer: :func:`train_step` then only accumulates gradients."""

    param_groups = ({"lr": 0.0},)


def train_step(
    model,
    optimizer,
    step: StepInputs,
    step_plan=None,
    mode: str = "compact",
    *,
    capacity: int = DEFAULT_CAPACITY,
    no_replay: bool = False,
    progress=None,
) -> StepResult:
    """One optimizer step over the whole batch through the engine's step loop.

    ``zero_grad`` -> plan (compact: ``step_plan`` or ``plan_step(batch, 1, capacity)``, then
    ``plan_calls`` per microbatch; trajectory: first-fit-decreasing packing at ``capacity``) ->
    each microbatch forward and backward -> ``optimizer.step()`` (with the engine's non-finite
    guard; skipped, gradients kept, when ``optimizer`` is None) -> MoE expert-bias update.
    ``progress(done, total)`` is called after each microbatch."""
    engine = _engine(model, optimizer, mode, capacity, no_replay)
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    out = engine.forward_backward(step, progress=progress, plan=step_plan)
    t1 = time.perf_counter()
    if optimizer is not None:
        engine.optimizer_step()
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return StepResult.of(out, mode, recompute_enabled(model), time.perf_counter() - t1)


def step_logprobs(
    model,
    step: StepInputs,
    mode: str = "compact",
    capacity: int = DEFAULT_CAPACITY,
    no_replay: bool = False,
) -> torch.Tensor:
    """Current log-probs of every target of the step in original batch order (no grad), on the
    model's device: float32 [P] (float64 for a float64 model)."""
    engine = _engine(model, None, mode, capacity, no_replay)
    with torch.no_grad():
        return engine.forward_backward(step, forward_only=True).logprobs.to(model.device)


def plan_microbatches(step: StepInputs, mode: str, capacity: int, cfg, step_plan=None):
    """The step's microbatches for benchmarks that time microbatches one by one: ``(list of
    trajectory-id arrays, list of CallPlan or None, seconds)``. Compact: the step plan (D = 1) and
    every microbatch's call plan (:func:`harts_runtime.engine.planning.plan_step` and
    :func:`~harts_runtime.engine.planning.microbatch_call_plan`, the engine's calls; timed: planner
    time). Trajectory: :func:`pack_trajectories` (not planner
    time; seconds reported as 0)."""
    if mode not in MODES:
        raise InvalidInputError("mode", f"unknown {mode!r}; choose one of {MODES}")
    if mode == "trajectory":
        lengths = np.asarray(step.batch.lengths, dtype=np.int64)
        return pack_trajectories(lengths, capacity), [], 0.0
    t0 = time.perf_counter()
    if step_plan is None:
        step_plan = plan_step(cfg, step, 1, capacity)  # the engine's calls
    mbs = [np.asarray(m, dtype=np.int64) for m in step_plan.microbatches]
    plans = [microbatch_call_plan(cfg, step, m) for m in mbs]
    return mbs, plans, time.perf_counter() - t0
