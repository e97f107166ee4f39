"""One microbatch of a step, compact (HARTS) or trajectory-wise (baseline): its rows, forward,
log-probs, loss share and backward. The step loop above it is
:meth:`harts_runtime.engine.HartsEngine.forward_backward` (over
:func:`harts_runtime.parallel.data.run_replica_step`).

Both executions run the same model, the same per-token objective and the same step metadata:

* ``mode="compact"`` (HARTS): ``harts_planner.plan_step`` -> per microbatch ``plan_calls`` (both
  by the engine, :meth:`harts_runtime.engine.HartsEngine.plan`; nothing here plans) ->
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
  ``l_t`` is the per-token clipped surrogate plus ``kl_coef`` times the KL estimate (minus
  ``entropy_coef`` times the entropy) and
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

import numpy as np
import torch
import torch.profiler

from harts_runtime.errors import InvalidInputError
from harts_runtime.layout.rows import (
    MODES,
    Microbatch,
    compact_microbatch,
    trajectory_microbatch,
)
from harts_runtime.loss.functions import LossFn, MicrobatchInputs, policy_loss_fn
from harts_runtime.models import HybridModel
from harts_runtime.step_inputs import StepInputs

__all__ = [
    "forward_microbatch",
    "make_microbatch",
    "microbatch_entropy",
    "microbatch_inputs",
    "run_microbatch",
]


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise InvalidInputError("mode", f"unknown {mode!r}; choose one of {MODES}")


def make_microbatch(
    model: HybridModel, step: StepInputs, traj_indices, mode: str, call_plan=None
) -> Microbatch:
    """The microbatch of trajectories ``traj_indices`` on the model's device (compact: from
    ``call_plan``, which the caller planned: :meth:`harts_runtime.engine.HartsEngine.plan`, or
    :func:`harts_runtime.engine.microbatch_call_plan` for one microbatch by hand; nothing here
    plans). No trajectories give the empty microbatch (zero rows, zero loss; data parallelism pads
    a short replica's slots with it). The step's tokens and values are not checked here: the
    engine checks them once per step (:meth:`~harts_runtime.engine.HartsEngine.step_inputs`).
    Raises :class:`InvalidInputError` naming ``mode`` (unknown) or ``call_plan`` (compact mode,
    trajectories but no call plan)."""
    _check_mode(mode)
    cfg = model.config
    with torch.profiler.record_function("harts.layout"):
        if mode == "trajectory" or (call_plan is None and len(traj_indices) == 0):
            mb, call_plan = trajectory_microbatch(step, traj_indices, cfg, model.device), None
        else:
            if call_plan is None:
                raise InvalidInputError(
                    "call_plan",
                    "a compact microbatch needs its call plan, planned by the caller: "
                    "harts_runtime.engine.microbatch_call_plan(model, step, traj_indices)",
                )
            mb = compact_microbatch(step, call_plan, cfg, model.device)
        replay = getattr(model, "_harts_routing_replay", None)  # the MoE layers, routing replay on
        if replay:
            from harts_runtime.ops.router import microbatch_routes

            mb.layout.info["routes"] = microbatch_routes(step, mb, call_plan, replay).to(model.device)
        hook = getattr(model, "_harts_cp_layout", None)  # CP by state passing: the microbatch's split
        if hook is not None:
            hook(step, mb, call_plan)
    return mb


def forward_microbatch(model: HybridModel, mb: Microbatch, *, no_replay: bool = False):
    """Forward of one microbatch: ``(hidden [N, D], logprobs float32 [P_mb], router_loss)``;
    ``no_replay`` runs KDA's Section 5.4 ablation schedule."""
    layout = mb.layout.replace(no_replay=True) if no_replay else mb.layout
    return model(layout, mb.row_index, mb.labels, (mb.lm_order, mb.lm_bounds))


def microbatch_entropy(
    model: HybridModel, mb: Microbatch, hidden: torch.Tensor, grad: bool = True
) -> torch.Tensor:
    """The full-vocabulary entropy at each of ``mb``'s targets from its final normed ``hidden``
    rows (:func:`~harts_runtime.loss.logprobs.lm_head_entropy`: once per row; attached to the
    graph when ``grad``, else a metric only). One process only: :class:`InvalidInputError` naming ``entropy_coef`` for a
    parallelized model (its head and rows are split over ranks)."""
    from harts_runtime.loss.logprobs import lm_head_entropy

    if getattr(model, "_harts_parallel", None) is not None:
        raise InvalidInputError(
            "entropy_coef", "the entropy (bonus or entropy_metric) runs in one process only (no mesh)"
        )
    with (
        torch.profiler.record_function("harts.entropy"),
        torch.set_grad_enabled(grad and torch.is_grad_enabled()),
    ):
        return lm_head_entropy(hidden, model.lm_head.weight, mb.row_index, model.config.lm_head_rows)


def microbatch_inputs(
    step: StepInputs, mb: Microbatch, device, entropy: torch.Tensor | None = None
) -> MicrobatchInputs:
    """The per-target fields of microbatch ``mb`` on ``device`` (what a loss function receives);
    ``entropy``: its targets' entropy (:func:`microbatch_entropy`), when the objective asks."""
    meta = step.device_metadata(device)
    ti = mb.target_index
    ref, beh, ver = meta["ref_logprobs"], meta["behaviour_logprobs"], meta["weight_versions"]
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
        behaviour_logprobs=None if beh is None else beh[ti],
        weight_versions=None if ver is None else ver[ti],
        entropy=entropy,
        mask_total=step.mask_total,
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
    entropy: bool | None = None,
):
    """Forward and backward of one microbatch; returns ``(loss_contribution, stats)``.

    ``traj_indices``: the microbatch's trajectory ids (ignored when ``microbatch``, from
    :func:`make_microbatch`, is given; empty: the empty microbatch); ``call_plan``: its call plan
    (compact mode: needed unless ``microbatch`` is given or no trajectories; the caller plans it,
    :func:`harts_runtime.engine.microbatch_call_plan`); ``backward``: backpropagate the
    contribution (gradients accumulate into ``.grad``); ``return_hidden``: also return the final
    normed hidden rows (detached) as ``stats["hidden"]`` with ``stats["row_index"]`` and
    ``stats["labels"]`` (evaluation); ``loss_fn``: the objective, ``loss_fn(logprobs, inputs) ->
    loss`` or ``(loss, metrics)`` (:mod:`harts_runtime.loss.functions`; None: the step's GRPO /
    PPO, :data:`~harts_runtime.loss.functions.policy_loss_fn`), normalised by step-level
    denominators; ``entropy``: compute the targets' entropy for the loss function
    (:func:`microbatch_entropy`; None: when the step's config asks for it, ``entropy_coef`` or
    ``entropy_metric``).
    The MoE router loss is added to it (its share ``S_mb / S``).

    Returns ``loss_contribution`` (float32 scalar, detached: this microbatch's share of the step
    loss under the module docstring's normalisation) and ``stats``: ``policy_loss``,
    ``router_loss`` (contributions), ``rows``, ``semantic_tokens``, ``replay_tokens``,
    ``num_calls``, ``logprobs`` (detached [P_mb]; ``entropy`` likewise when computed),
    ``target_index`` ([P_mb], into the step's per-token tensors) and ``metrics`` (the loss
    function's). Raises :class:`InvalidInputError` naming ``mode`` (unknown) or ``call_plan``
    (:func:`make_microbatch`). The step's token ids and per-token values are checked once per step
    by the step loop above (:meth:`harts_runtime.engine.HartsEngine.forward_backward`), not per
    microbatch: a caller that runs microbatches by hand checks its step first
    (``step.check_tokens(vocab_size)``, ``step.check_values()``).
    """
    _check_mode(mode)
    mb = microbatch if microbatch is not None else make_microbatch(model, step, traj_indices, mode, call_plan)
    hidden, lp, router = forward_microbatch(model, mb, no_replay=no_replay)
    want = step.config.wants_entropy if entropy is None else entropy
    ent = microbatch_entropy(model, mb, hidden, grad=bool(step.config.entropy_coef)) if want else None
    inputs = microbatch_inputs(step, mb, lp.device, ent)
    out = (loss_fn or policy_loss_fn)(lp, inputs)
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
    if ent is not None:
        stats["entropy"] = ent.detach()
    if return_hidden:
        stats.update(hidden=hidden.detach(), row_index=mb.row_index, labels=mb.labels)
    return loss.detach(), stats
