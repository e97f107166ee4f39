"""The causal depthwise short convolution on compact rows, through a window table (Section 4.2).

:class:`ShortConvolution` has ``fla.modules.ShortConvolution``'s parameters (an ``nn.Conv1d`` with
``weight [C, 1, w]``, no bias; ``weight[:, 0, -1]`` multiplies the row itself), so an fla state dict
loads unchanged; but instead of a padded convolution over a contiguous sequence it reads each
output row's window from ``conv_index [C_out, w]`` (:mod:`harts_runtime.layout.conv`): the rows at
positions ``p - w + 1 .. p`` on the row's own ancestry path, -1 read as zeros. The gather's backward
accumulates every consumer's gradient at the unique producer row.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from harts_runtime.errors import InvalidInputError

__all__ = ["ShortConvolution", "causal_conv"]


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, conv_index: torch.Tensor, activation: str | None = "silu"
) -> torch.Tensor:
    """``y[c] = act(sum_i weight[:, i] * x[conv_index[c, i]])`` (zeros where the index is -1).

    x: [C, D]; weight: [D, w] (depthwise, no bias; ``weight[:, -1]`` multiplies the row itself);
    conv_index: [C_out, w] int64. Returns [C_out, D]; O(C_out * w * D).
    """
    xp = torch.cat([x, x.new_zeros(1, x.shape[1])], 0)  # row C = zero pad
    idx = torch.where(conv_index < 0, torch.full_like(conv_index, x.shape[0]), conv_index)
    windows = xp[idx]  # [C_out, w, D]
    y = torch.einsum("cwd,dw->cd", windows, weight.to(x.dtype))
    return F.silu(y) if activation == "silu" else y


class ShortConvolution(nn.Conv1d):
    """Depthwise causal convolution of width ``kernel_size`` over ``hidden_size`` channels.

    forward(x [C, hidden_size], conv_index [C_out, kernel_size] int64) -> [C_out, hidden_size].
    Init: ``weight[:, 0, :] ~ N(0, 1 / kernel_size)``. ``activation``: ``"silu"`` or None.
    """

    def __init__(self, hidden_size: int, kernel_size: int, activation: str | None = "silu"):
        if activation not in ("silu", None):
            raise InvalidInputError("activation", f"choose 'silu' or None, got {activation!r}")
        super().__init__(
            hidden_size, hidden_size, kernel_size, padding=kernel_size - 1, groups=hidden_size, bias=False
        )
        self.hidden_size, self.activation = hidden_size, activation

    def reset_parameters(self) -> None:
        c, w = self.weight.shape[0], self.weight.shape[-1]
        with torch.no_grad():
            self.weight.copy_((torch.randn(c, w) / math.sqrt(w)).view(c, 1, w))

    def forward(self, x: torch.Tensor, conv_index: torch.Tensor) -> torch.Tensor:
        return causal_conv(x, self.weight[:, 0, :], conv_index, self.activation)
