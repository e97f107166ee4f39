"""References of :mod:`harts_kernels.norm`: the same signatures as the kernels, float32 math in
PyTorch, one cast to the input's dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

_GATES = {"sigmoid": torch.sigmoid, "silu": F.silu, "swish": F.silu}


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * weight`` in float32, cast to ``x.dtype`` once."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def naive_rms_norm_gated(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, activation: str = "sigmoid"
) -> torch.Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * weight * act(gate)`` (``act``: ``"sigmoid"``, ``"silu"``
    or ``"swish"``) in float32, cast to ``x.dtype`` once."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * _GATES[activation](gate.float())).to(x.dtype)


def naive_l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2, -1) + eps)`` in float32, cast to ``x.dtype`` once."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)
