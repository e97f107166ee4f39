"""The loss-function contract of a microbatch, and the built-in GRPO / PPO objectives as two such
functions.

A loss function is ``loss_fn(logprobs, inputs) -> loss`` (or ``(loss, metrics)``; the metrics
are step shares too: the engine sums them over the step's microbatches and replicas): ``logprobs``
[P_mb] are the current log-probs of the microbatch's targets, attached to the graph, in the order of
``inputs.target_index`` (entries of the step's per-target tensors, i.e. the caller's order);
``inputs`` (:class:`MicrobatchInputs`) carries the matching per-target fields. The loss must be the
microbatch's share of the step loss, normalised by *step-level* denominators, so that the sum over
the step's microbatches, in any grouping over processes, is the step loss:
``inputs.weights`` are the step's aggregation weights under its ``loss_agg_mode`` (token mean,
sequence mean, ...), so ``sum(inputs.weights * per_token_loss)`` is always right. Anything that
knows nothing about prefix sharing plugs in (verl's ``ppo_loss``, a value loss, an SFT term):
HARTS only decides which microbatch each target lands in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from harts_runtime.loss.objectives import PolicyLossConfig, policy_loss

__all__ = [
    "LossFn",
    "MicrobatchInputs",
    "grpo_loss_fn",
    "make_policy_loss_fn",
    "policy_loss_fn",
    "ppo_loss_fn",
    "zero_loss_fn",
]


@dataclass
class MicrobatchInputs:
    """The per-target fields of one microbatch (all on the model's device, in ``target_index``
    order)."""

    target_index: torch.Tensor
    """int64 [P_mb]: entries of the step's per-target tensors (the caller's order)."""
    advantages: torch.Tensor
    """float32 [P_mb]."""
    old_logprobs: torch.Tensor
    """float32 [P_mb]."""
    ref_logprobs: torch.Tensor | None
    """float32 [P_mb] or None."""
    loss_mask: torch.Tensor
    """bool [P_mb]."""
    weights: torch.Tensor
    """float32 [P_mb]: the step-level aggregation weights (zero where the mask is off)."""
    cu_seqlens: torch.Tensor
    """int64 [k + 1]: the microbatch's trajectories' target ranges (in its own order)."""
    trajectories: torch.Tensor
    """int64 [k]: the microbatch's trajectory ids (indices into the step's trajectories)."""
    config: PolicyLossConfig
    """The step's policy-loss configuration."""
    semantic_tokens: int
    """The microbatch's semantic tokens (its share of the step's router-loss normalisation)."""
    weight_total: float = 1.0
    """The sum of the step's aggregation weights (over every microbatch): ``sum(inputs.weights) /
    weight_total`` is this microbatch's share of the step, for turning a per-microbatch mean
    metric into a step share."""
    behaviour_logprobs: torch.Tensor | None = None
    """float32 [P_mb]: the rollout engine's log-probs (importance correction), or None."""
    weight_versions: torch.Tensor | None = None
    """int64 [P_mb]: the weight version that sampled each target (< 0: none), or None."""
    entropy: torch.Tensor | None = None
    """float32 [P_mb]: the current policy's full-vocabulary entropy at each target, attached to the
    graph (computed only when the step's config asks: ``entropy_coef`` or ``entropy_metric``), or
    None."""
    mask_total: float = 0.0
    """The step's loss-masked targets (over every microbatch): a microbatch's mean over its masked
    targets times ``(its masked targets) / mask_total`` is its share of the step's token mean (0:
    not given, the microbatch is taken as the whole step)."""


LossFn = Callable[[torch.Tensor, MicrobatchInputs], "torch.Tensor | tuple[torch.Tensor, dict]"]
"""``loss_fn(logprobs [P_mb], inputs) -> loss`` or ``(loss, metrics)``."""


def make_policy_loss_fn(config: PolicyLossConfig | None = None) -> LossFn:
    """The clipped policy-gradient objective (:func:`~harts_runtime.loss.objectives.policy_loss`) with
    ``config`` (None: the step's own, GRPO or PPO by its ``objective``), reduced by the step-level
    weights: the function :func:`harts_runtime.run_microbatch` uses by default."""

    def loss_fn(logprobs: torch.Tensor, inputs: MicrobatchInputs):
        cfg = dataclasses.replace(config or inputs.config, loss_agg_mode="sum", loss_norm=None)
        loss, metrics = policy_loss(
            logprobs,
            inputs.old_logprobs,
            inputs.advantages,
            inputs.weights,
            inputs.cu_seqlens,
            cfg,
            inputs.ref_logprobs,
            inputs.behaviour_logprobs,
            inputs.entropy,
            token_mask=inputs.loss_mask,
        )
        # pg_loss, kl_loss and entropy_loss are already shares of the step loss; the token means
        # become shares of the step's token means (a maximum is no share: the step's is in the
        # engine's mismatch/ratio_max)
        metrics.pop("is_ratio_max", None)
        n = inputs.loss_mask.sum().to(logprobs.dtype)
        share = n / inputs.mask_total if inputs.mask_total else torch.ones_like(n)
        for name in ("clipfrac", "approx_kl", "kl", "entropy", "is_k3", "is_clipped", "is_masked"):
            if name in metrics:
                metrics[name] = metrics[name] * share
        return loss, metrics

    return loss_fn


policy_loss_fn: LossFn = make_policy_loss_fn()
"""The step's own objective (GRPO or PPO with their defaults, or ``StepInputs.loss_config``)."""


def zero_loss_fn(logprobs, inputs):
    """No objective: a zero loss that keeps the graph (forward-only scoring, where the log-probs are
    what is wanted)."""
    return logprobs.sum() * 0.0


grpo_loss_fn: LossFn = make_policy_loss_fn(PolicyLossConfig(kl_coef=0.001))
"""GRPO: the clipped surrogate (0.2) plus a k3 KL-to-reference penalty of 0.001 (needs
``ref_logprobs``), aggregated by the step's ``loss_agg_mode`` (its weights)."""

ppo_loss_fn: LossFn = make_policy_loss_fn(PolicyLossConfig(clip_ratio_c=3.0))
"""PPO: the clipped surrogate (0.2) with dual clip 3, aggregated by the step's ``loss_agg_mode``."""
