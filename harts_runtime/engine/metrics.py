"""The metrics of a training step (:func:`step_metrics`): what
:meth:`HartsEngine.forward_backward <harts_runtime.engine.HartsEngine.forward_backward>` returns
beside the loss and the log-probs, from the step's sums over its microbatches (summed over DP
already), the objective's statistics (:mod:`harts_runtime.loss.statistics`), the train / rollout
mismatch (:mod:`harts_runtime.loss.correction`) and the routing-replay counts."""

from __future__ import annotations

import torch

from harts_runtime.step_inputs import StepInputs

__all__ = ["rollout_metrics", "step_metrics"]


def step_metrics(
    step: StepInputs,
    sums: dict,
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    version: int,
    plan_seconds: float,
    fbg_seconds: float,
    result,
) -> dict:
    """The metrics of a step (:meth:`~harts_runtime.engine.HartsEngine.forward_backward`'s): its
    ``sums`` over microbatches (policy and router loss, rows, replay tokens, calls, microbatches,
    trajectory fallbacks, ``loss_fn/*`` and ``cp_states/*``), the planner's and the F/B/Grad
    seconds, each slot's seconds (``result``: :func:`harts_runtime.parallel.run_replica_step`'s), and
    :func:`rollout_metrics` of every target's ``logprobs`` (and ``entropy``) at optimizer step
    ``version``."""
    rows, replay = sums["rows"], sums["replay_tokens"]
    semantic = step.batch.semantic_tokens
    metrics = {
        "loss": result.loss,
        "policy_loss": sums["policy_loss"],
        "router_loss": sums["router_loss"],
        "semantic_tokens": semantic,
        "rows": int(rows),
        "compression": semantic / max(1, rows),
        "replay_tokens": int(replay),
        # the rows KDA executes: compact rows plus the replay rows its forks re-read
        "compression_with_replay": semantic / max(1, rows + replay),
        "kda_calls": int(sums["num_calls"]),
        "microbatches": int(sums["microbatches"]),
        "trajectory_fallbacks": int(sums["trajectory_fallbacks"]),
        "plan_seconds": plan_seconds,
        "fbg_seconds": fbg_seconds,
        "slot_seconds": list(result.slot_seconds),
    }
    metrics.update({k: v for k, v in sums.items() if k.startswith("loss_fn/")})
    metrics.update({k: int(v) for k, v in sums.items() if k.startswith("cp_states/")})
    metrics.update(rollout_metrics(step, logprobs, version, entropy))
    return metrics


def rollout_metrics(step: StepInputs, logprobs: torch.Tensor, version: int, entropy=None) -> dict:
    """The objective's statistics (``objective/*``: :mod:`harts_runtime.loss.statistics`), the
    train / rollout mismatch (with behaviour log-probs; version lags against ``version``, the
    optimizer steps taken) and the routing-replay counts of a step."""
    from harts_runtime.loss.correction import mismatch_metrics
    from harts_runtime.loss.statistics import step_statistics
    from harts_runtime.ops.router import replay_metrics

    out = replay_metrics(step)
    out.update(
        step_statistics(
            logprobs,
            step.old_logprobs,
            step.advantages,
            step.loss_mask,
            step.cu_seqlens,
            step.config,
            ref_logprobs=step.ref_logprobs,
            entropy=entropy,
        )
    )
    if step.behaviour_logprobs is not None:
        out.update(
            mismatch_metrics(
                logprobs,
                step.behaviour_logprobs,
                step.loss_mask,
                step.cu_seqlens,
                step.config,
                old_logprobs=step.old_logprobs,
                weight_versions=step.weight_versions,
                version=version,
            )
        )
    return out
