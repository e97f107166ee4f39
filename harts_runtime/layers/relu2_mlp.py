"""The non-gated squared-ReLU MLP of Nemotron-H (transformers' ``NemotronHMLP`` with
``mlp_hidden_act="relu2"``): ``down(relu(up(x)) ** 2)`` per row, called like every layer as
``forward(x, layout)`` (it reads nothing from the layout). Parameters under transformers' names:
``up_proj`` [I, D], ``down_proj`` [D, I] (biases with ``bias``, transformers' ``mlp_bias``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harts_runtime.errors import InvalidInputError
from harts_runtime.layout.rows import RowLayout

__all__ = ["Relu2MLP", "relu2"]


def relu2(x: torch.Tensor) -> torch.Tensor:
    """``relu(x) ** 2`` (transformers' ``ReLUSquaredActivation``)."""
    return torch.square(F.relu(x))


class Relu2MLP(nn.Module):
    """x [N, D] -> ``down_proj(relu(up_proj(x)) ** 2)`` [N, D]."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        for name, v in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if v < 1:
                raise InvalidInputError(name, f"must be >= 1, got {v}")
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, layout: RowLayout | None = None) -> torch.Tensor:
        return self.down_proj(relu2(self.up_proj(x)))
