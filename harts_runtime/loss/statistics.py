"""A step's objective statistics from its per-target log-probs and fields (what an RL run plots
beside its reward): token shares and means over the step's loss-masked targets, in float64.

With ``m`` the loss mask, ``n_i`` the masked targets of trajectory ``i`` and ``N`` the step's
trajectories (every per-target entry is one trajectory's token, so a prefix a rollout tree shares is
counted once per trajectory, as trajectory-wise training counts it):

========================  ==========================================================================
``tokens``                ``sum(m)``
``response_length_mean``  ``sum_i n_i / N``; ``response_length_max``: ``max_i n_i``
``advantage_mean``        ``sum(m A) / sum(m)``; ``advantage_std``: ``sqrt(sum(m (A - mean)^2) / sum(m))``
``clipfrac``              the share of masked targets whose clipped surrogate is the larger (the PPO
                          clip acts on them): ``-A clip(r) > -A r``, ``r = exp(lp - old)``
``approx_kl``             the mean k3 of the old policy against the current one
``kl``                    the mean ``kl_penalty(lp, ref, kl_estimator)`` (with reference log-probs)
``entropy``               the mean full-vocabulary entropy (when the step computed it)
========================  ==========================================================================

All are computed by :meth:`harts_runtime.engine.HartsEngine.forward_backward` over the whole step
(``objective/<name>``), from the log-probs the step's microbatches produced, whatever their
grouping; the loss function's own per-microbatch shares (``loss_fn/<name>``) add up to the same
token means.
"""

from __future__ import annotations

import torch

from harts_runtime.loss.objectives import kl_penalty

__all__ = ["step_statistics"]


@torch.no_grad()
def step_statistics(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config,
    *,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    prefix: str = "objective/",
) -> dict:
    """The module docstring's statistics as floats (``prefix + name``); per-target tensors [P],
    ``cu_seqlens`` [N + 1], ``config`` a :class:`~harts_runtime.loss.objectives.PolicyLossConfig`.
    An empty mask gives ``tokens`` 0 and no means."""
    dt = torch.float64
    m = (loss_mask.cpu() != 0).to(dt)
    cu = cu_seqlens.cpu().long()
    n_traj = cu.numel() - 1
    seq = torch.repeat_interleave(torch.arange(n_traj), cu.diff())
    per_traj = torch.zeros(n_traj, dtype=dt).index_add(0, seq, m)
    total = float(m.sum())
    out = {
        f"{prefix}tokens": int(total),
        f"{prefix}response_length_mean": float(per_traj.mean()) if n_traj else 0.0,
        f"{prefix}response_length_max": int(per_traj.max()) if n_traj else 0,
    }
    if total == 0:
        return out
    mean = lambda x: float((x.cpu().to(dt) * m).sum() / total)
    lp, old, adv = logprobs.cpu().to(dt), old_logprobs.cpu().to(dt), advantages.cpu().to(dt)
    a_mean = mean(adv)
    out[f"{prefix}advantage_mean"] = a_mean
    out[f"{prefix}advantage_std"] = mean((adv - a_mean).square()) ** 0.5
    high = config.clip_ratio_low if config.clip_ratio_high is None else config.clip_ratio_high
    ratio = torch.exp((lp - old).clamp(-20.0, 20.0))
    clipped = -adv * ratio.clamp(1.0 - config.clip_ratio_low, 1.0 + high) > -adv * ratio
    out[f"{prefix}clipfrac"] = mean(clipped.to(dt))
    out[f"{prefix}approx_kl"] = mean(kl_penalty(lp, old, "k3"))
    if ref_logprobs is not None:
        out[f"{prefix}kl"] = mean(kl_penalty(lp, ref_logprobs.cpu().to(dt), config.kl_estimator))
    if entropy is not None:
        out[f"{prefix}entropy"] = mean(entropy)
    return out
