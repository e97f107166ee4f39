"""The dense FFN layer: a SwiGLU MLP per row (:class:`harts_runtime.modules.swiglu.SwiGLU`),
called like every layer as ``forward(x, layout)`` (it reads nothing from the layout)."""

from __future__ import annotations

import torch

from harts_runtime.layout.rows import RowLayout
from harts_runtime.modules.swiglu import SwiGLU

__all__ = ["DenseFFN"]


class DenseFFN(SwiGLU):
    """x [N, D] -> [N, D]; ``gate``/``up`` [I, D], ``down`` [D, I], no bias."""

    def forward(self, x: torch.Tensor, layout: RowLayout | None = None) -> torch.Tensor:
        return super().forward(x)
