"""GRPO and PPO objectives over per-token log-probs and metadata, as a trajectory-wise trainer has them.

Paper Section 3.5, Equation 18: ``L_policy = F(lambda, xi)``. These functions see only the current
log-probs ``lambda`` (from :func:`harts_runtime.loss.logprobs.mapped_logprobs`, original batch order)
and per-token metadata ``xi`` (advantages, masks, old/reference log-probs, trajectory boundaries);
nothing in them knows about prefix sharing, so they are the objectives an ordinary trainer runs.

Layout: tokens are flat, trajectory by trajectory; trajectory ``i`` owns ``[cu[i], cu[i + 1])``
(``cu_seqlens``, int64 [N + 1]). Per-token tensors are [T]; masks select the action tokens.

Reductions (``loss_agg_mode``, as in verl's ``agg_loss``), for a per-token loss ``l`` and mask ``m``:

* ``token-mean``: ``sum(l m) / sum(m)`` over the whole batch;
* ``seq-mean-token-mean``: the mean over trajectories with a masked token of
  ``sum_i(l m) / sum_i(m)``;
* ``seq-mean-token-sum``: the mean over trajectories of ``sum_i(l m)``;
* ``seq-mean-token-sum-norm``: ``sum(l m) / norm`` (Dr. GRPO; ``norm`` defaults to the longest
  trajectory, the padded width of a [N, L] batch);
* ``sum``: ``sum(l m)``.

The per-token loss is ``l_t = w^IS_t pg_t + kl_coef KL_t - entropy_coef H_t``
(:func:`policy_loss`): the clipped surrogate ``pg`` (times the importance weight of
:mod:`harts_runtime.loss.correction`), the KL estimate against the reference policy's log-probs
(:func:`kl_penalty`, :data:`KL_ESTIMATORS`) and the full-vocabulary entropy ``H`` (an entropy
bonus: :func:`harts_runtime.loss.logprobs.lm_head_entropy`), all aggregated alike.

Each mode is written once, as per-token weights ``w`` (:func:`aggregation_weights`) with
``aggregate(l, m, cu, mode) == sum(w * l)``: the train step computes the weights once for the
whole step and sums ``w_t * l_t`` microbatch by microbatch (``harts_runtime.train``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.loss.correction import IS_CORRECTIONS, IS_NUMERATORS, importance_weights

__all__ = [
    "AGG_MODES",
    "KL_ESTIMATORS",
    "PolicyLossConfig",
    "aggregate",
    "aggregation_weights",
    "gae",
    "grpo_advantages",
    "grpo_loss",
    "kl_penalty",
    "per_token",
    "policy_loss",
    "ppo_loss",
    "value_loss",
]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "sum")
KL_ESTIMATORS = ("k1", "k2", "k3", "low-var-kl")
"""The per-token estimators of ``KL(current || reference)`` (:func:`kl_penalty`)."""


def _seq_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """int64 [T]: trajectory of every token."""
    cu = cu_seqlens.long()
    return torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device), cu.diff())


def per_token(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Broadcast per-trajectory values [N] to their tokens [T]."""
    return values[_seq_ids(cu_seqlens)]


def aggregation_weights(
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mode: str = "token-mean",
    norm: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Per-token weights ``w`` [T] (``dtype``) of a reduction: ``aggregate(l, mask, cu, mode) == sum(w * l)``.

    ``token-mean``: ``m / sum(m)``; ``seq-mean-token-mean``: ``m_t / (n_i * #active trajectories)``
    (``n_i`` the masked tokens of ``t``'s trajectory, 0 for a trajectory without any);
    ``seq-mean-token-sum``: ``m / N``; ``seq-mean-token-sum-norm``: ``m / norm`` (default: the
    longest trajectory); ``sum``: ``m``. Raises :class:`~harts_runtime.errors.InvalidInputError`
    (``field="loss_agg_mode"``) for an unknown mode. O(T).
    """
    m = mask.to(dtype)
    cu = cu_seqlens.long()
    if mode == "token-mean":
        return m / m.sum().clamp_min(1.0)
    if mode == "sum":
        return m
    if mode == "seq-mean-token-sum-norm":
        return m / (float(cu.diff().max()) if norm is None else float(norm))
    n = cu.numel() - 1
    if mode == "seq-mean-token-sum":
        return m / max(n, 1)
    if mode == "seq-mean-token-mean":
        seq = torch.repeat_interleave(torch.arange(n, device=cu.device), cu.diff())
        count = torch.zeros(n, dtype=dtype, device=m.device).index_add(0, seq, m)
        active = int((count > 0).sum())
        return torch.where(count[seq] > 0, m / count[seq].clamp_min(1.0) / max(active, 1), 0.0)
    raise InvalidInputError("loss_agg_mode", f"unknown {mode!r}; choose one of {AGG_MODES}")


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mode: str = "token-mean",
    norm: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [T] under ``mask`` [T] (bool or 0/1 float) to a scalar (module
    docstring): ``sum(aggregation_weights(mask, cu_seqlens, mode, norm) * loss)``."""
    return (loss * aggregation_weights(mask, cu_seqlens, mode, norm, dtype=loss.dtype)).sum()


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(current || reference) estimate [T] on the current policy's samples.

    With ``d = lp - ref``: ``k1``: ``d``; ``k2``: ``d^2 / 2``; ``k3`` (low-variance, as GRPO;
    ``low-var-kl`` is verl's name for the same estimator): ``exp(-d) + d - 1``, ``-d`` clamped to
    [-20, 20] and the result to [-10, 10].
    """
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator in ("k3", "low-var-kl"):
        r = (-d).clamp(-20.0, 20.0)
        return (torch.exp(r) - r - 1.0).clamp(-10.0, 10.0)
    raise InvalidInputError("kl_estimator", f"unknown {estimator!r}; choose one of {KL_ESTIMATORS}")


@dataclass(kw_only=True)
class PolicyLossConfig:
    """Clipped policy-gradient loss (PPO / GRPO / DAPO variants)."""

    clip_ratio_low: float = 0.2
    """Lower clip: ratio >= 1 - clip_ratio_low."""
    clip_ratio_high: float | None = None
    """Upper clip: ratio <= 1 + clip_ratio_high (None: same as low; DAPO uses a larger one)."""
    clip_ratio_c: float | None = None
    """Dual-clip bound c > 1 for negative advantages (None: off)."""
    kl_coef: float = field(
        default=0.0,
        metadata={
            "help": "weight of the KL-to-reference term added to every loss token (0: off; needs "
            "ref_logprobs, e.g. from harts_runtime.engine.reference.ReferencePolicy)"
        },
    )
    """Weight of the KL-to-reference penalty in the loss (``>= 0``; 0: off); needs ``ref_logprobs``."""
    kl_estimator: str = field(
        default="k3",
        metadata={
            "help": "per-token KL estimator: k1 (lp - ref), k2 ((lp - ref)^2 / 2), k3 or low-var-kl "
            "(exp(ref - lp) - (ref - lp) - 1, clamped to [-10, 10])",
            "choices": KL_ESTIMATORS,
        },
    )
    """:data:`KL_ESTIMATORS` (:func:`kl_penalty`)."""
    entropy_coef: float = field(
        default=0.0,
        metadata={
            "help": "weight of the entropy bonus subtracted on every loss token (0: off; on costs one "
            "more pass over the vocabulary per compact row, forward and backward; one process)"
        },
    )
    """Entropy bonus ``>= 0``: ``- entropy_coef * H`` per token (``H`` the full-vocabulary entropy)."""
    entropy_metric: bool = field(
        default=False,
        metadata={
            "help": "report the policy's entropy over the loss tokens even without a bonus (one more "
            "forward pass over the vocabulary per compact row; one process)"
        },
    )
    """Compute the per-token entropy for the ``objective/entropy`` metric when ``entropy_coef`` is 0."""
    loss_agg_mode: str = "token-mean"
    """One of :data:`AGG_MODES`."""
    loss_norm: float | None = None
    """Constant for ``seq-mean-token-sum-norm``."""
    is_correction: str = field(
        default="none",
        metadata={
            "help": "importance correction of the rollout engine's mismatch (needs behaviour_logprobs): "
            "none, token-tis / seq-tis (weight min(ratio, is_cap); seq: the trajectory's geometric mean "
            "ratio) or token-mis / seq-mis (weight ratio inside [is_low, is_high], else the token or "
            "trajectory dropped)",
            "choices": IS_CORRECTIONS,
        },
    )
    """:data:`~harts_runtime.loss.correction.IS_CORRECTIONS` (:mod:`harts_runtime.loss.correction`)."""
    is_cap: float = field(
        default=2.0,
        metadata={"help": "TIS truncation C: the weight is min(ratio, C), C >= 1", "metavar": "C"},
    )
    """TIS truncation ``C >= 1``."""
    is_low: float = field(
        default=0.5, metadata={"help": "MIS band's lower end: a ratio below it drops the token (> 0)"}
    )
    """MIS lower bound (``0 < is_low <= 1``)."""
    is_high: float = field(
        default=2.0, metadata={"help": "MIS band's upper end: a ratio above it drops the token (>= 1)"}
    )
    """MIS upper bound (``>= 1``)."""
    is_numerator: str = field(
        default="current",
        metadata={
            "help": "numerator of the importance ratio over the behaviour log-prob: current (the "
            "trainer's log-probs, detached) or old (the step's old_logprobs: verl's old / rollout)",
            "choices": IS_NUMERATORS,
        },
    )
    """:data:`~harts_runtime.loss.correction.IS_NUMERATORS`."""

    @property
    def wants_entropy(self) -> bool:
        """Whether a step computes the per-token entropy (a bonus or the metric)."""
        return bool(self.entropy_coef) or bool(self.entropy_metric)

    def __post_init__(self):
        if self.kl_estimator not in KL_ESTIMATORS:
            raise InvalidInputError(
                "kl_estimator", f"unknown {self.kl_estimator!r}; choose one of {KL_ESTIMATORS}"
            )
        for name in ("kl_coef", "entropy_coef"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise InvalidInputError(name, f"must be a finite number >= 0, got {v!r}")
        if self.is_correction not in IS_CORRECTIONS:
            raise InvalidInputError(
                "is_correction", f"unknown {self.is_correction!r}; choose one of {IS_CORRECTIONS}"
            )
        if self.is_numerator not in IS_NUMERATORS:
            raise InvalidInputError(
                "is_numerator", f"unknown {self.is_numerator!r}; choose one of {IS_NUMERATORS}"
            )
        for name, lo, hi in (("is_cap", 1.0, None), ("is_low", None, 1.0), ("is_high", 1.0, None)):
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
            ok = ok and (lo is None or v >= lo) and (hi is None or v <= hi)
            if not ok:
                bound = f">= {lo}" if lo is not None else f"in (0, {hi}]"
                raise InvalidInputError(name, f"must be a finite number {bound}, got {v!r}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: PolicyLossConfig | None = None,
    ref_logprobs: torch.Tensor | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    token_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate (times the importance weight of ``config.is_correction``) plus an optional
    KL penalty and entropy bonus, every per-token term reduced by ``config.loss_agg_mode``::

        l_t = w_t * pg_t + kl_coef * KL_t - entropy_coef * H_t,   loss = aggregate(l, mask)

    Parameters
    ----------
    logprobs : Tensor, float, [T]
        Current log-probs of the taken tokens (attached to the graph).
    old_logprobs, advantages : Tensor, [T]
        From the rollout policy and the advantage estimator (no gradient).
    mask : Tensor, bool or float, [T]
        Action/loss mask (or, under ``loss_agg_mode="sum"``, the step's aggregation weights).
    cu_seqlens : Tensor, int, [N + 1]
        Trajectory boundaries.
    ref_logprobs : Tensor, [T], optional
        Reference-policy log-probs, for ``config.kl_coef > 0`` (with them ``kl`` is reported).
    behaviour_logprobs : Tensor, [T], optional
        The rollout engine's log-probs, for ``config.is_correction != "none"``
        (:mod:`harts_runtime.loss.correction`); with them the mismatch metrics are reported.
    entropy : Tensor, [T], optional
        The current policy's full-vocabulary entropy at each token (attached to the graph;
        :func:`harts_runtime.loss.logprobs.lm_head_entropy`), for ``config.entropy_coef > 0``.
    token_mask : Tensor, bool, [T], optional
        The tokens the metrics' means run over (default: ``mask != 0``).

    Returns
    -------
    (loss, metrics) : scalar Tensor, dict of detached scalars
        ``pg_loss``; ``kl_loss`` (the aggregated KL term) when ``kl_coef > 0``; ``entropy_loss``
        (the aggregated entropy) when ``entropy_coef > 0``; means over the masked tokens:
        ``clipfrac`` (the share of tokens whose clipped term is the larger), ``approx_kl`` (k3 of
        old vs current), ``kl`` (the KL estimate, with ``ref_logprobs``), ``entropy`` (with
        ``entropy``); with behaviour log-probs ``is_k3`` (the mismatch's k3 mean), ``is_ratio_max``
        and ``is_clipped`` (TIS) or ``is_masked`` (MIS).
    """
    cfg = config or PolicyLossConfig()
    if cfg.is_correction != "none" and behaviour_logprobs is None:
        raise InvalidInputError("behaviour_logprobs", f"required by is_correction={cfg.is_correction!r}")
    if cfg.kl_coef and ref_logprobs is None:
        raise InvalidInputError("ref_logprobs", "required when kl_coef != 0")
    if cfg.entropy_coef and entropy is None:
        raise InvalidInputError("entropy", "required when entropy_coef != 0")
    high = cfg.clip_ratio_low if cfg.clip_ratio_high is None else cfg.clip_ratio_high
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + high)
    pg = torch.maximum(pg1, pg2)
    if cfg.clip_ratio_c is not None:
        pg = torch.where(advantages < 0, torch.minimum(pg, -advantages * cfg.clip_ratio_c), pg)
    if behaviour_logprobs is not None:
        w, d, cut = importance_weights(logprobs, behaviour_logprobs, mask, cu_seqlens, cfg, old_logprobs)
        if cfg.is_correction != "none":
            pg = pg * w
    agg = lambda x: aggregate(x, mask, cu_seqlens, cfg.loss_agg_mode, cfg.loss_norm)
    pg_loss = agg(pg)
    loss = pg_loss
    m = ((mask != 0) if token_mask is None else token_mask.bool()).to(logprobs.dtype)
    total = m.sum()
    count = torch.where(total > 0, total, torch.ones_like(total))  # an empty mask: means of 0
    mean = lambda x: ((x.detach().to(m.dtype) * m).sum() / count).detach()
    metrics = {
        "pg_loss": pg_loss.detach(),
        "clipfrac": mean((pg2 > pg1).to(m.dtype)),
        "approx_kl": mean(kl_penalty(logprobs, old_logprobs, "k3")),
    }
    if behaviour_logprobs is not None:
        metrics["is_k3"] = mean(torch.exp(d) - 1.0 - d)
        metrics["is_ratio_max"] = torch.exp(d.masked_fill(m == 0, -torch.inf).max()) if d.numel() else d.sum()
        if cfg.is_correction != "none":
            key = "is_clipped" if cfg.is_correction.endswith("-tis") else "is_masked"
            metrics[key] = mean(cut.to(m.dtype))
    if ref_logprobs is not None:
        kl_t = kl_penalty(logprobs, ref_logprobs, cfg.kl_estimator)
        metrics["kl"] = mean(kl_t)
        if cfg.kl_coef:
            kl = agg(kl_t)
            loss = loss + cfg.kl_coef * kl
            metrics["kl_loss"] = kl.detach()
    if entropy is not None:
        metrics["entropy"] = mean(entropy)
        if cfg.entropy_coef:
            ent = agg(entropy.to(logprobs.dtype))
            loss = loss - cfg.entropy_coef * ent
            metrics["entropy_loss"] = ent.detach()
    return loss, metrics


def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages [N]: ``(r - mean_g(r)) / (std_g(r) + eps)`` per group (unbiased std;
    0 for a single-member or all-equal group); ``scale_by_std=False`` drops the division (Dr. GRPO)."""
    g = torch.unique(group_ids, return_inverse=True)[1]
    n_groups = int(g.max()) + 1 if g.numel() else 0
    r = rewards.double()
    count = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add(0, g, torch.ones_like(r))
    mean = torch.zeros_like(count).index_add(0, g, r) / count
    dev = r - mean[g]
    var = torch.zeros_like(count).index_add(0, g, dev.square()) / (count - 1).clamp_min(1)
    std = var.sqrt()[g]
    adv = torch.where(std > 0, dev / (std + eps), dev) if scale_by_std else dev  # all-equal group: 0
    return adv.to(rewards.dtype)


def grpo_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    cu_seqlens,
    ref_logprobs=None,
    config: PolicyLossConfig | None = None,
) -> tuple[torch.Tensor, dict]:
    """GRPO: clipped surrogate with per-token (group-relative, broadcast) advantages plus
    ``kl_coef * KL_k3(current || reference)``. Default config: clip 0.2, ``kl_coef=0.001``,
    ``seq-mean-token-mean`` (the GRPO paper's reduction)."""
    cfg = config or PolicyLossConfig(kl_coef=0.001, loss_agg_mode="seq-mean-token-mean")
    return policy_loss(logprobs, old_logprobs, advantages, mask, cu_seqlens, cfg, ref_logprobs)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    clip: float | None = 0.2,
    mode: str = "token-mean",
) -> torch.Tensor:
    """Clipped value loss ``0.5 * max((v - R)^2, (clip(v, v_old +- clip) - R)^2)``, reduced."""
    err = (values - returns).square()
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err = torch.maximum(err, (clipped - returns).square())
    return aggregate(0.5 * err, mask, cu_seqlens, mode)


def ppo_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    cu_seqlens,
    config: PolicyLossConfig | None = None,
    ref_logprobs=None,
    values=None,
    old_values=None,
    returns=None,
    value_clip: float | None = 0.2,
    vf_coef: float = 0.5,
) -> tuple[torch.Tensor, dict]:
    """PPO: clipped surrogate (optionally dual-clip / KL penalty per ``config``) plus, when ``values``
    are given, ``vf_coef`` times the clipped value loss. Values of compact rows map to tokens like
    log-probs do (``value_rows[targets.row_index]``: a gather of scalars)."""
    loss, metrics = policy_loss(logprobs, old_logprobs, advantages, mask, cu_seqlens, config, ref_logprobs)
    if values is not None:
        mode = (config or PolicyLossConfig()).loss_agg_mode
        vl = value_loss(values, old_values, returns, mask, cu_seqlens, value_clip, mode)
        loss = loss + vf_coef * vl
        metrics["vf_loss"] = vl.detach()
    return loss, metrics


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation per trajectory over masked tokens (verl-style: unmasked tokens
    are skipped, the value after the last token is 0).

    rewards, values, mask [T] -> (advantages [T], returns [T]); no gradient.
    """
    with torch.no_grad():
        cu = cu_seqlens.long().tolist()
        n, width = len(cu) - 1, max((cu[i + 1] - cu[i] for i in range(len(cu) - 1)), default=0)
        seq = _seq_ids(cu_seqlens)
        col = torch.arange(rewards.numel(), device=rewards.device) - cu_seqlens.long()[seq]
        pad = lambda x: torch.zeros(n, width, dtype=torch.float64, device=x.device).index_put(
            (seq, col), x.double()
        )
        r, v, m = pad(rewards), pad(values), pad(mask.double())
        adv = torch.zeros_like(r)
        next_v = torch.zeros(n, dtype=r.dtype, device=r.device)
        last = torch.zeros_like(next_v)
        for t in reversed(range(width)):
            delta = r[:, t] + gamma * next_v - v[:, t]
            cur = delta + gamma * lam * last
            adv[:, t] = cur
            mt = m[:, t]
            next_v = mt * v[:, t] + (1 - mt) * next_v
            last = mt * cur + (1 - mt) * last
        ret = adv + v
        return adv[seq, col].to(rewards.dtype), ret[seq, col].to(rewards.dtype)
