"""One RL train step over a rollout batch, compact (HARTS) or trajectory-wise (baseline).

Both executions run the same model, the same per-token objective and the same step metadata:

* ``mode="compact"`` (HARTS): ``harts_planner.plan_step`` -> per microbatch ``plan_calls`` ->
  :func:`~harts_runtime.layout.rows.compact_microbatch` (physical rows, KDA rounds, ancestor-KV
  views, multiplicities) -> model forward on compact rows -> mapped log-probs in original batch
  order -> unchanged GRPO/PPO loss -> backward;
* ``mode="trajectory"`` (baseline): every root-to-leaf trajectory expanded and packed as ordinary
  varlen sequences into microbatches of at most ``capacity`` rows
  (:func:`~harts_runtime.layout.rows.pack_trajectories`), the same modules with trivial plans
  (:func:`~harts_runtime.layout.rows.trajectory_microbatch`), the same loss.

Loss-normalisation contract (what data parallelism builds on)
-------------------------------------------------------------
The step loss is ``L = L_policy + L_router``. Every denominator is a *step-level* constant,
computed once from the whole step's metadata in :class:`~harts_runtime.step_inputs.StepInputs`
(``weights``, :func:`~harts_runtime.loss.objectives.aggregation_weights`):

* ``L_policy = sum_t w_t * l_t`` over all non-terminal semantic positions ``t`` of the step, where
  ``l_t`` is the per-token clipped surrogate plus ``kl_coef`` times the KL estimate and
  ``w_t`` the aggregation weight of ``loss_agg_mode`` (``token-mean``: ``m_t / sum(m)``;
  ``seq-mean-token-mean``: ``m_t / (n_i * #active trajectories)``; ``seq-mean-token-sum``:
  ``m_t / N``; ``seq-mean-token-sum-norm``: ``m_t / norm``; ``sum``: ``m_t``). This equals the
  unchanged :func:`harts_runtime.loss.objectives.policy_loss` on the whole step (tested).
* ``L_router = sum over microbatches (S_mb / S) * router_mb``, ``router_mb`` the MoE layers'
  multiplicity-weighted ``aux_coef * aux + z_coef * z`` of the microbatch, ``S_mb`` its semantic
  tokens and ``S`` the step's. The z-loss part is then exactly the step-level token mean; the
  load-balancing part, as in Megatron, is per microbatch and depends on microbatch membership.

:func:`run_microbatch` returns the microbatch's share of ``L`` and backpropagates it, so summing
contributions (and gradients) over the step's microbatches, in any order and any grouping over
processes, gives exactly the single-process step loss and gradients (up to float summation order).

Recomputation is a property of the model (:func:`harts_runtime.recompute.apply_recompute`), not
of the step. Timing (Section 5.3): ``plan_seconds`` is planner time (``plan_step`` and every
``plan_calls``); ``fbg_seconds`` is the F/B/Grad interval once plans exist (layout
materialisation, forward, log-probs, loss, backward; no optimizer update);
``core_seconds = plan_seconds + fbg_seconds``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.profiler

from harts_planner import plan_calls, plan_step
from harts_runtime.errors import InvalidInputError
from harts_runtime.layout.rows import (
    MODES,
    Microbatch,
    compact_microbatch,
    pack_trajectories,
    trajectory_microbatch,
)
from harts_runtime.loss.functions import LossFn, MicrobatchInputs, policy_loss_fn
from harts_runtime.models import HybridModel, ModelConfig
from harts_runtime.recompute import recompute_enabled
from harts_runtime.step_inputs import StepInputs

__all__ = [
    "StepResult",
    "forward_microbatch",
    "make_microbatch",
    "microbatch_inputs",
    "plan_microbatches",
    "run_microbatch",
    "step_logprobs",
    "train_step",
]


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise InvalidInputError("mode", f"unknown {mode!r}; choose one of {MODES}")


def make_microbatch(
    model: HybridModel, step: StepInputs, traj_indices, mode: str, call_plan=None
) -> Microbatch:
    """The microbatch of trajectories ``traj_indices`` on the model's device (compact: from
    ``call_plan``, planned here when None). No trajectories give the empty microbatch (zero rows,
    zero loss; data parallelism pads a short replica's slots with it)."""
    _check_mode(mode)
    cfg = model.config
    step.check_tokens(cfg.vocab_size)
    with torch.profiler.record_function("harts.layout"):
        if mode == "trajectory" or (call_plan is None and len(traj_indices) == 0):
            return trajectory_microbatch(step, traj_indices, cfg, model.device)
        if call_plan is None:
            call_plan = plan_calls(
                step.batch, cfg.chunk_size, microbatch=np.asarray(traj_indices), conv_width=cfg.conv_size
            )
        return compact_microbatch(step, call_plan, cfg, model.device)


def forward_microbatch(model: HybridModel, mb: Microbatch, *, no_replay: bool = False):
    """Forward of one microbatch: ``(hidden [N, D], logprobs float32 [P_mb], router_loss)``;
    ``no_replay`` runs KDA's Section 5.4 ablation schedule."""
    layout = mb.layout.replace(no_replay=True) if no_replay else mb.layout
    return model(layout, mb.row_index, mb.labels, (mb.lm_order, mb.lm_bounds))


def microbatch_inputs(step: StepInputs, mb: Microbatch, device) -> MicrobatchInputs:
    """The per-target fields of microbatch ``mb`` on ``device`` (what a loss function receives)."""
    meta = step.device_metadata(device)
    ti = mb.target_index
    ref = meta["ref_logprobs"]
    mask = step.device_mask(device)
    return MicrobatchInputs(
        target_index=ti,
        advantages=meta["advantages"][ti],
        old_logprobs=meta["old_logprobs"][ti],
        ref_logprobs=None if ref is None else ref[ti],
        loss_mask=mask[ti],
        weights=meta["weights"][ti],
        cu_seqlens=mb.cu_local.to(device),
        trajectories=torch.as_tensor(np.asarray(mb.trajectories, dtype=np.int64)),
        config=step.config,
        semantic_tokens=mb.semantic_tokens,
        weight_total=step.weight_total,
    )


def run_microbatch(
    model: HybridModel,
    step: StepInputs,
    traj_indices=None,
    mode: str = "compact",
    *,
    call_plan=None,
    microbatch: Microbatch | None = None,
    no_replay: bool = False,
    backward: bool = True,
    return_hidden: bool = False,
    loss_fn: LossFn | None = None,
):
    """Forward and backward of one microbatch; returns ``(loss_contribution, stats)``.

    ``traj_indices``: the microbatch's trajectory ids (ignored when ``microbatch``, from
    :func:`make_microbatch`, is given; empty: the empty microbatch); ``call_plan``: its
    precomputed plan (compact mode); ``backward``: backpropagate the contribution (gradients
    accumulate into ``.grad``); ``return_hidden``: also return the final normed hidden rows
    (detached) as ``stats["hidden"]`` with ``stats["row_index"]`` and ``stats["labels"]``
    (evaluation); ``loss_fn``: the objective, ``loss_fn(logprobs, inputs) -> loss`` or ``(loss,
    metrics)`` (:mod:`harts_runtime.loss.functions`; None: the step's GRPO / PPO,
    :data:`~harts_runtime.loss.functions.policy_loss_fn`), normalised by step-level denominators.
    The MoE router loss is added to it (its share ``S_mb / S``).

    Returns ``loss_contribution`` (float32 scalar, detached: this microbatch's share of the step
    loss under the module docstring's normalisation) and ``stats``: ``policy_loss``,
    ``router_loss`` (contributions), ``rows``, ``semantic_tokens``, ``replay_tokens``,
    ``num_calls``, ``logprobs`` (detached [P_mb]), ``target_index`` ([P_mb], into the step's
    per-token tensors) and ``metrics`` (the loss function's). Raises :class:`InvalidInputError`
    (``field="mode"``) for an unknown mode.
    """
    _check_mode(mode)
    mb = microbatch if microbatch is not None else make_microbatch(model, step, traj_indices, mode, call_plan)
    hidden, lp, router = forward_microbatch(model, mb, no_replay=no_replay)
    out = (loss_fn or policy_loss_fn)(lp, microbatch_inputs(step, mb, lp.device))
    pol, metrics = out if isinstance(out, tuple) else (out, {})
    rl = router * (mb.semantic_tokens / step.batch.semantic_tokens)
    loss = pol + rl
    if backward:
        loss.backward()
    stats = dict(
        mb.stats,
        policy_loss=pol.detach(),
        router_loss=rl.detach(),
        logprobs=lp.detach(),
        target_index=mb.target_index,
        metrics=metrics,
    )
    if return_hidden:
        stats.update(hidden=hidden.detach(), row_index=mb.row_index, labels=mb.labels)
    return loss.detach(), stats


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

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(compression=self.compression, core_seconds=self.core_seconds)
        return d


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plan_microbatches(step: StepInputs, mode: str, capacity: int, cfg: ModelConfig, step_plan=None):
    """The step's microbatches: ``(list of trajectory-id arrays, list of CallPlan or None, seconds)``.
    Compact: ``plan_step`` (D = 1) and every ``plan_calls`` (timed: planner time). Trajectory:
    :func:`pack_trajectories` (not planner time; seconds reported as 0)."""
    _check_mode(mode)
    if mode == "trajectory":
        lengths = np.asarray(step.batch.lengths, dtype=np.int64)
        return pack_trajectories(lengths, capacity), [], 0.0
    t0 = time.perf_counter()
    if step_plan is None:
        step_plan = plan_step(step.batch, 1, capacity, cfg.chunk_size)
    mbs = [np.asarray(m, dtype=np.int64) for m in step_plan.microbatches]
    plans = [plan_calls(step.batch, cfg.chunk_size, microbatch=m, conv_width=cfg.conv_size) for m in mbs]
    return mbs, plans, time.perf_counter() - t0


def train_step(
    model: HybridModel,
    optimizer,
    step: StepInputs,
    step_plan=None,
    mode: str = "compact",
    *,
    capacity: int = 65_536,
    no_replay: bool = False,
    progress=None,
) -> StepResult:
    """One optimizer step over the whole batch.

    ``zero_grad`` -> plan (compact: ``step_plan`` or ``plan_step(batch, 1, capacity)``, then
    ``plan_calls`` per microbatch; trajectory: first-fit-decreasing packing at ``capacity``) ->
    for each microbatch :func:`run_microbatch` -> ``optimizer.step()`` (skipped when ``optimizer``
    is None) -> MoE expert-bias update. ``progress(done, total)`` is called after each microbatch.
    """
    dev = model.device
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    mbs, plans, plan_s = plan_microbatches(step, mode, capacity, model.config, step_plan)
    _sync(dev)
    t0 = time.perf_counter()
    total = torch.zeros((), device=dev)
    pol = torch.zeros((), device=dev)
    rl = torch.zeros((), device=dev)
    rows = replay = calls = 0
    for i, traj in enumerate(mbs):
        mb = make_microbatch(model, step, traj, mode, plans[i] if plans else None)
        loss, st = run_microbatch(model, step, mode=mode, microbatch=mb, no_replay=no_replay)
        total += loss
        pol += st["policy_loss"]
        rl += st["router_loss"]
        rows += st["rows"]
        replay += st["replay_tokens"]
        calls += st["num_calls"]
        if progress is not None:
            progress(i + 1, len(mbs))
    _sync(dev)
    fbg = time.perf_counter() - t0
    t1 = time.perf_counter()
    if optimizer is not None:
        optimizer.step()
        model.update_expert_bias()
    _sync(dev)
    return StepResult(
        float(total),
        float(pol),
        float(rl),
        mode,
        recompute_enabled(model),
        len(mbs),
        step.batch.semantic_tokens,
        rows,
        replay,
        calls,
        plan_s,
        fbg,
        time.perf_counter() - t1,
    )


@torch.no_grad()
def step_logprobs(
    model: HybridModel,
    step: StepInputs,
    mode: str = "compact",
    capacity: int = 65_536,
    no_replay: bool = False,
) -> torch.Tensor:
    """Current log-probs of every target of the step, float32 [P] in original batch order (no grad)."""
    mbs, plans, _ = plan_microbatches(step, mode, capacity, model.config)
    out = torch.empty(
        step.num_targets,
        device=model.device,
        dtype=torch.float64 if model.config.dtype == "float64" else torch.float32,
    )
    for i, traj in enumerate(mbs):
        mb = make_microbatch(model, step, traj, mode, plans[i] if plans else None)
        _, lp, _ = forward_microbatch(model, mb, no_replay=no_replay)
        out[mb.target_index] = lp
    return out
