"""The loss side: :mod:`~harts_runtime.loss.logprobs` (mapped log-probs, on materialised logits
and fused with the LM head, each with an optional vocabulary-parallel group; the LM head's entropy),
:mod:`~harts_runtime.loss.objectives` (GRPO / PPO with the aggregation modes written once, the KL
term and entropy bonus), :mod:`~harts_runtime.loss.correction` (importance correction) and
:mod:`~harts_runtime.loss.statistics` (a step's objective statistics)."""

from harts_runtime.loss.functions import (
    LossFn,
    MicrobatchInputs,
    grpo_loss_fn,
    make_policy_loss_fn,
    policy_loss_fn,
    ppo_loss_fn,
)
from harts_runtime.loss.logprobs import (
    LogProbTargets,
    expanded_logprobs,
    lm_head_entropy,
    lm_head_logprobs,
    mapped_logprobs,
    targets_from_batch,
)
from harts_runtime.loss.objectives import (
    AGG_MODES,
    KL_ESTIMATORS,
    PolicyLossConfig,
    aggregate,
    aggregation_weights,
    gae,
    grpo_advantages,
    grpo_loss,
    kl_penalty,
    per_token,
    policy_loss,
    ppo_loss,
    value_loss,
)
from harts_runtime.loss.statistics import step_statistics

__all__ = [
    "AGG_MODES",
    "KL_ESTIMATORS",
    "LogProbTargets",
    "LossFn",
    "MicrobatchInputs",
    "PolicyLossConfig",
    "aggregate",
    "aggregation_weights",
    "expanded_logprobs",
    "gae",
    "grpo_advantages",
    "grpo_loss",
    "grpo_loss_fn",
    "kl_penalty",
    "lm_head_entropy",
    "lm_head_logprobs",
    "make_policy_loss_fn",
    "mapped_logprobs",
    "per_token",
    "policy_loss",
    "policy_loss_fn",
    "ppo_loss",
    "ppo_loss_fn",
    "step_statistics",
    "targets_from_batch",
    "value_loss",
]
