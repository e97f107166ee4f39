"""The MoE router's decision and statistics (:mod:`harts_runtime.layers.moe`): the score functions,
deterministic top-k routing of N rows (group-limited, or replayed) and the multiplicity-weighted
z-loss, load-balancing loss and expert counts."""

from __future__ import annotations

import torch

from harts_runtime.errors import InvalidInputError

__all__ = ["SCORE_FUNCS", "route", "router_losses"]


def _softmax_scores(logits: torch.Tensor):
    scores = logits.softmax(-1)
    return scores, scores


def _sigmoid_scores(logits: torch.Tensor):
    scores = logits.sigmoid()
    return scores, scores / (scores.sum(-1, keepdim=True) + 1e-20)


SCORE_FUNCS = {"softmax": _softmax_scores, "sigmoid": _sigmoid_scores}
"""Router score name -> ``logits [N, E] -> (scores, probs)``: the scores select and weight the
experts, ``probs`` (sigmoid scores normalised per row) enter the load-balancing loss."""


def route(
    logits: torch.Tensor,
    top_k: int,
    score_func: str = "softmax",
    expert_bias=None,
    norm_topk_prob: bool = False,
    scaling: float = 1.0,
    num_groups: int = 1,
    topk_groups: int = 1,
    given: torch.Tensor | None = None,
):
    """Deterministic top-k routing of N rows (or, with ``given``, replayed routing).

    Parameters
    ----------
    logits : Tensor, float32, shape [N, E]
    expert_bias : Tensor, shape [E], optional
        Added to the scores for selection only.
    num_groups, topk_groups : int
        Group-limited selection (DeepSeek-V3 / Kimi-Linear ``n_group`` / ``topk_group``): the E
        experts form ``num_groups`` contiguous groups; a group's score is the sum of its two best
        selection scores (its best one for groups of one expert); only the experts of the
        ``topk_groups`` best groups can be selected. ``num_groups=1`` is plain top-k.
    given : Tensor, int64, [N, k], optional
        Routing replay: the experts of each row (a row of -1: its own top-k); the weights are the
        scores at these experts, normalised and scaled alike.

    Returns
    -------
    probs : Tensor, [N, E]
        Routing probabilities for the aux loss (softmax; sigmoid scores normalised per row).
    topk_idx : Tensor, int64, [N, k]
        Stable descending order: ties go to the lower expert id.
    topk_weight : Tensor, [N, k]
        Combine weights (unbiased scores of the selected experts, optionally renormalised, scaled).
    """
    if score_func not in SCORE_FUNCS:
        raise InvalidInputError("score_func", f"unknown {score_func!r}; choose one of {sorted(SCORE_FUNCS)}")
    scores, probs = SCORE_FUNCS[score_func](logits)
    select = scores.detach() if expert_bias is None else scores.detach() + expert_bias
    if num_groups > 1:
        n, e = select.shape
        if e % num_groups or not 1 <= topk_groups <= num_groups:
            raise InvalidInputError(
                "num_expert_groups", f"{e} experts in {num_groups} groups, keeping {topk_groups}"
            )
        per = select.view(n, num_groups, e // num_groups)
        group_score = per.topk(min(2, e // num_groups), dim=-1).values.sum(-1)  # [N, G]
        keep = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[:, :topk_groups]
        allowed = torch.zeros(n, num_groups, dtype=torch.bool, device=select.device).scatter_(1, keep, True)
        select = per.masked_fill(~allowed[..., None], float("-inf")).view(n, e)
    topk_idx = torch.sort(select, dim=-1, descending=True, stable=True).indices[:, :top_k]
    if given is not None:
        topk_idx = torch.where(given[:, :1] >= 0, given.to(topk_idx.device, topk_idx.dtype), topk_idx)
    weight = scores.gather(1, topk_idx)
    if norm_topk_prob:
        weight = weight / (weight.sum(-1, keepdim=True) + 1e-20)
    return probs, topk_idx, weight * scaling


def router_losses(
    logits: torch.Tensor, probs: torch.Tensor, topk_idx: torch.Tensor, multiplicity=None, reduce=None
):
    """Multiplicity-weighted router statistics of N rows.

    Parameters
    ----------
    logits : Tensor, float32 (or float64), [N, E]
    probs : Tensor, [N, E]
    topk_idx : Tensor, int64, [N, k]
    multiplicity : Tensor, [N], optional
        ``q_c`` (None: every row once, i.e. trajectory-wise training on expanded rows).
    reduce : callable, optional
        For rows sharded over ranks (sequence parallelism): sums a 1-D tensor of per-shard partial
        sums over the shards, differentiably (forward all-reduce, backward identity). The losses are
        nonlinear in the row sums (``P_e f_e / S^2``, ``z / S``), so the mass ``P``, counts ``f``,
        ``S`` and the z-loss numerator are summed first (one call, ``2E + 2`` scalars) and the
        losses formed from the totals; they are then the whole row set's, equal on every shard.

    Returns
    -------
    (aux_loss, z_loss, tokens_per_expert) : scalar, scalar, float32 [E]
        As defined in :mod:`harts_runtime.layers.moe`'s docstring; ``S = sum q``. ``tokens_per_expert`` is always these
        N rows' counts (partial under ``reduce``), so that accumulating them per shard and summing
        the accumulators later counts every row once.
    """
    n, e = probs.shape
    k = topk_idx.shape[1]
    dt = logits.dtype
    q = torch.ones(n, device=logits.device, dtype=dt) if multiplicity is None else multiplicity.to(dt)
    s = q.sum()
    assigned = torch.zeros(n, e, device=logits.device, dtype=dt).scatter_(1, topk_idx, 1.0)  # a_{c,e}
    tokens_per_expert = q @ assigned  # [E] f_e
    mass = (q[:, None] * probs.to(dt)).sum(0)  # [E] P_e
    z_sum = (q * torch.logsumexp(logits, dim=-1).square()).sum()
    counts = tokens_per_expert
    if reduce is not None:
        total = reduce(torch.cat([mass, z_sum[None], tokens_per_expert, s[None]]))
        mass, z_sum, counts, s = total[:e], total[e], total[e + 1 : 2 * e + 1], total[2 * e + 1]
        counts, s = counts.detach(), s.detach()
    s = s.clamp(min=1)  # an empty microbatch (0 rows: DP padding) has no statistics, not NaN ones
    aux = (mass * counts).sum() * (e / (k * s * s))
    z = z_sum / s
    return aux, z, tokens_per_expert.float()
