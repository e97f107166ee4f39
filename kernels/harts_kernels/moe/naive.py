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


def naive_swiglu_weighted(gu: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """``silu(a) * b`` (times ``w[m]`` per row if given) for ``gu = [a | b]`` [M, 2I], float32 math."""
    a, b = gu.float().chunk(2, dim=-1)
    h = F.silu(a) * b
    return (h if w is None else h * w.float()[:, None]).to(gu.dtype)


def naive_swiglu_weighted_bwd(gu: torch.Tensor, w: torch.Tensor | None, g: torch.Tensor):
    """``(d gu [M, 2I], d w [M] or None)`` of :func:`naive_swiglu_weighted` for the output gradient
    ``g`` [M, I], float32 math, each cast to its input's dtype."""
    a, b = gu.float().chunk(2, dim=-1)
    gf = g.float()
    s = torch.sigmoid(a)
    h = a * s * b
    dh = gf if w is None else gf * w.float()[:, None]
    da = dh * b * s * (1 + a * (1 - s))
    db = dh * a * s
    dw = None if w is None else (gf * h).sum(-1).to(w.dtype)
    return torch.cat([da, db], dim=-1).to(gu.dtype), dw
