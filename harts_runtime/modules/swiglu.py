"""The SwiGLU MLP: ``down(silu(gate(x)) * up(x))``, bias-free linears (``gate``/``up`` [I, D],
``down`` [D, I]); the tensor-parallel plan shards ``gate``/``up`` by columns and ``down`` by rows.

Clipped SwiGLU (Ling-3.0's ``expert_swiglu_limit`` / ``share_expert_swiglu_limit``, clipping after
the activation): with a limit L > 0, ``down(min(silu(gate(x)), L) * clamp(up(x), -L, L))``
(:func:`swiglu`); L = 0 or None is the plain SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SwiGLU", "swiglu"]


def swiglu(a: torch.Tensor, b: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """``silu(a) * b``; with ``limit`` L > 0 ``min(silu(a), L) * clamp(b, -L, L)``."""
    act = F.silu(a)
    if limit:
        act, b = act.clamp(max=limit), b.clamp(-limit, limit)
    return act * b


class SwiGLU(nn.Module):
    """x [N, D] -> [N, D] through an intermediate width I (``limit``: the clipped SwiGLU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float | None = None):
        super().__init__()
        self.limit = limit or None
        self.gate = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(swiglu(self.gate(x), self.up(x), self.limit))
