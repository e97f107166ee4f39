"""Importance correction for the train / rollout mismatch, and its metrics.

The rollout engine samples a target with its own log-prob ``mu_t`` (the *behaviour* log-prob,
:attr:`~harts_runtime.rollouts.Rollouts.behaviour_logprobs`); the trainer scores the same target
with ``lambda_t``. They differ (kernels, bf16, MoE routing, and under asynchronous RL the weights
themselves), so the policy gradient is reweighted by a detached importance weight ``w_t`` built from
the log-ratio ``d_t = nu_t - mu_t`` whose numerator ``nu_t`` is ``PolicyLossConfig.is_numerator``:
``current`` (``lambda_t``, detached) or ``old`` (the step's ``old_logprobs``: verl's decoupled
``pi_old / pi_rollout``, for several optimizer steps per batch). With ``rho = exp(clamp(d, -20, 20))``:

=============  ==========================================================================
``none``       ``w_t = 1``
``token-tis``  ``w_t = min(rho_t, C)``                               (``C = is_cap``)
``token-mis``  ``w_t = rho_t`` if ``lo <= rho_t <= hi`` else 0        (``is_low``, ``is_high``)
``seq-tis``    ``w_t = min(rho_i, C)`` for every target of trajectory ``i``
``seq-mis``    ``w_t = rho_i`` if ``lo <= rho_i <= hi`` else 0, for every target of ``i``
=============  ==========================================================================

``rho_i = exp(sum_t m_t d_t / sum_t m_t)`` is the geometric mean of the per-token ratios over the
loss-masked targets of trajectory ``i`` (1 for a trajectory without any). Every quantity is per
trajectory: a token a rollout tree shares between trajectories is one target *per trajectory* in
the per-target layout (the paper's objective, Eq. 18, is over semantic positions), so it gets each
trajectory's own weight, exactly as trajectory-wise training computes it. The weight multiplies the
clipped surrogate only (not the KL penalty); masked tokens keep their place in the aggregation
denominators (``loss_mask`` decides those, once per step).

Metrics (:func:`mismatch_metrics`, over loss-masked targets, float64): ``k3`` =
``mean(rho - 1 - log rho)`` with the per-token ``rho`` (the k3 estimate of ``KL(behaviour ||
trainer)`` on behaviour samples), ``ratio_max`` / ``ratio_min`` (per token), ``clipped`` (TIS) or
``masked`` (MIS): the share of targets whose weight was truncated or dropped; with
``weight_versions``, the same per version lag ``version - weight_versions[t]``.
"""

from __future__ import annotations

import torch

from harts_runtime.errors import InvalidInputError

__all__ = ["IS_CORRECTIONS", "IS_NUMERATORS", "importance_weights", "mismatch_metrics"]

IS_CORRECTIONS = ("none", "token-tis", "token-mis", "seq-tis", "seq-mis")
"""The importance corrections (module docstring)."""
IS_NUMERATORS = ("current", "old")
"""The numerator of the ratio: the current (detached) or the step's old log-probs."""
_CLAMP = 20.0


def _numerator(logprobs, old_logprobs, config) -> torch.Tensor:
    if config.is_numerator == "old":
        if old_logprobs is None:
            raise InvalidInputError("old_logprobs", "required by is_numerator='old'")
        return old_logprobs.detach()
    return logprobs.detach()


def _seq_mean(values: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-token broadcast of each trajectory's mean of ``values`` over its masked tokens (0 where a
    trajectory has none)."""
    cu = cu_seqlens.long().to(values.device)
    n = cu.numel() - 1
    seq = torch.repeat_interleave(torch.arange(n, device=values.device), cu.diff())
    m = (mask != 0).to(values.dtype)
    num = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, seq, values * m)
    den = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, seq, m)
    return (num / den.clamp_min(1.0))[seq]


def importance_weights(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config,
    old_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The detached weights of ``config.is_correction`` (module docstring).

    Returns ``(w [T], log_ratio [T], cut bool [T])``: the weights (``logprobs``' dtype), the
    per-token log-ratio ``d_t`` (clamped to [-20, 20]) and where the weight was truncated (TIS) or
    dropped (MIS). ``w`` is all ones under ``none``."""
    kind = config.is_correction
    d = (_numerator(logprobs, old_logprobs, config) - behaviour_logprobs.to(logprobs.dtype)).clamp(
        -_CLAMP, _CLAMP
    )
    if kind == "none":
        return torch.ones_like(d), d, torch.zeros_like(d, dtype=torch.bool)
    lr = _seq_mean(d, mask, cu_seqlens) if kind.startswith("seq-") else d
    rho = torch.exp(lr)
    if kind.endswith("-tis"):
        cut = rho > config.is_cap
        return rho.clamp(max=config.is_cap), d, cut
    cut = (rho < config.is_low) | (rho > config.is_high)
    return torch.where(cut, torch.zeros_like(rho), rho), d, cut


def _summary(d: torch.Tensor, cut: torch.Tensor, keep: torch.Tensor, prefix: str, kind: str) -> dict:
    n = int(keep.sum())
    out = {f"{prefix}tokens": n}
    if n == 0:
        return out
    dk = d[keep]
    rho = torch.exp(dk)
    out[f"{prefix}k3"] = float((rho - 1.0 - dk).mean())
    out[f"{prefix}ratio_max"] = float(rho.max())
    out[f"{prefix}ratio_min"] = float(rho.min())
    if kind != "none":
        out[f"{prefix}{'clipped' if kind.endswith('-tis') else 'masked'}"] = float(cut[keep].double().mean())
    return out


@torch.no_grad()
def mismatch_metrics(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config,
    *,
    old_logprobs: torch.Tensor | None = None,
    weight_versions: torch.Tensor | None = None,
    version: int | None = None,
) -> dict:
    """Step-level mismatch metrics (module docstring), in float64 over the loss-masked targets:
    ``mismatch/{tokens,k3,ratio_max,ratio_min,clipped|masked}`` and, with ``weight_versions``
    [T] (entries < 0: no version, left out), the same under ``mismatch/lag<d>/`` for each version
    lag ``d = V - weight_versions[t]``, ``V`` the larger of ``version`` (the trainer's: the engine
    passes its optimizer steps) and the step's newest version."""
    dt = torch.float64
    lp, mu, m = logprobs.detach().to(dt).cpu(), behaviour_logprobs.to(dt).cpu(), mask.cpu().bool()
    old = None if old_logprobs is None else old_logprobs.to(dt).cpu()
    _, d, cut = importance_weights(lp, mu, m, cu_seqlens.cpu(), config, old)
    kind = config.is_correction
    out = _summary(d, cut, m, "mismatch/", kind)
    if weight_versions is not None:
        v = weight_versions.cpu().long()
        known = m & (v >= 0)
        if bool(known.any()):
            top = max(int(v[known].max()), -1 if version is None else int(version))
            lag = top - v
            for g in sorted(set(lag[known].tolist())):
                out.update(_summary(d, cut, known & (lag == g), f"mismatch/lag{g}/", kind))
    return out
