"""The SwiGLU MLP: ``down(silu(gate(x)) * up(x))``, bias-free linears (``gate``/``up`` [I, D],
``down`` [D, I]); the tensor-parallel plan shards ``gate``/``up`` by columns and ``down`` by rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SwiGLU"]


class SwiGLU(nn.Module):
    """x [N, D] -> [N, D] through an intermediate width I."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))
