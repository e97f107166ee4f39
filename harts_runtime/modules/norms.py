"""Normalisations with float32 statistics: RMSNorm, the sigmoid-gated RMSNorm of KDA's output
(``fla.modules.FusedRMSNormGated(activation="sigmoid")``'s parameters and math) and the L2 norm of
KDA's queries and keys. Each returns its input's dtype; the statistics are computed in float32."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["GatedRMSNorm", "RMSNorm", "l2_norm"]


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim; ``weight`` [dim] (ones at init)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """``rmsnorm(x) * weight * sigmoid(gate)`` over the last dim (per head: x, gate [..., dim]);
    ``weight`` [dim] (ones at init). The parameters of ``fla.modules.FusedRMSNormGated``."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float() * torch.sigmoid(gate.float())).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim (the sum in float32)."""
    return x * torch.rsqrt((x.float() * x.float()).sum(-1, keepdim=True) + eps).to(x.dtype)
