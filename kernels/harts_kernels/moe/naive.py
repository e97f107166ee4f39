"""References of :mod:`harts_kernels.moe`: the same signatures, float32 math in PyTorch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_gather_sum(
    y: torch.Tensor, index: torch.Tensor, k: int, base: torch.Tensor | None = None
) -> torch.Tensor:
    """``out[n] = base[n] + sum_{j < k} y[index[n * k + j]]`` in float32, cast to ``y.dtype``."""
    d = y.shape[-1]
    out = y.float().index_select(0, index).view(-1, k, d).sum(1)
    return (out if base is None else base.float() + out).to(y.dtype)


def naive_swiglu_weighted(
    gu: torch.Tensor, w: torch.Tensor | None, limit: float | None = None
) -> torch.Tensor:
    """``silu(a) * b`` (times ``w[m]`` per row if given) for ``gu = [a | b]`` [M, 2I], float32 math;
    with ``limit`` L > 0 ``min(silu(a), L) * clamp(b, -L, L)``."""
    a, b = gu.float().chunk(2, dim=-1)
    act = F.silu(a)
    if limit:
        act, b = act.clamp(max=limit), b.clamp(-limit, limit)
    h = act * b
    return (h if w is None else h * w.float()[:, None]).to(gu.dtype)


def naive_swiglu_weighted_bwd(
    gu: torch.Tensor, w: torch.Tensor | None, g: torch.Tensor, limit: float | None = None
):
    """``(d gu [M, 2I], d w [M] or None)`` of :func:`naive_swiglu_weighted` (same ``limit``) for
    the output gradient ``g`` [M, I], float32 math, each cast to its input's dtype. A clamp passes
    the gradient where its input lies inside the closed interval (torch's convention)."""
    a, b = gu.float().chunk(2, dim=-1)
    gf = g.float()
    s = torch.sigmoid(a)
    act = a * s
    dact = s * (1 + a * (1 - s))
    if limit:
        dact = dact * (act <= limit)
        bpass = (b >= -limit) & (b <= limit)
        act, b = act.clamp(max=limit), b.clamp(-limit, limit)
    h = act * b
    dh = gf if w is None else gf * w.float()[:, None]
    da = dh * b * dact
    db = dh * act
    if limit:
        db = db * bpass
    dw = None if w is None else (gf * h).sum(-1).to(w.dtype)
    return torch.cat([da, db], dim=-1).to(gu.dtype), dw
