"""Normalisations with float32 statistics: RMSNorm (optionally zero-centred, Qwen3-Next's
``Qwen3NextRMSNorm``), the gated RMSNorm of KDA's output (``fla.modules.FusedRMSNormGated(
activation="sigmoid")``'s parameters and math) and of Qwen3-Next / Qwen3.5's gated-delta-net output
(``activation="silu"``), and the L2 norm of KDA's queries and keys. Each returns its input's dtype;
the statistics are computed in float32.

:class:`RMSNorm`, :class:`GatedRMSNorm` and :func:`l2_norm` take a ``backend``
(:mod:`harts_runtime.modules.fused`): on CUDA they run the Triton kernels of
:mod:`harts_kernels.norm` (``rms_norm``, ``rms_norm_gated``, ``l2norm``: fla's math, float32 inside,
compiled once per width and dtype whatever the row count), on the CPU the PyTorch reference below."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harts_runtime.errors import InvalidInputError
from harts_runtime.modules.fused import use_fla

__all__ = ["GatedRMSNorm", "RMSNorm", "l2_norm"]


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim; ``weight`` [dim] (ones at init).

    ``zero_centered=True``: ``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` with ``weight`` zeros at
    init, all in float32 and cast to ``x.dtype`` once at the end: the math of transformers'
    ``Qwen3NextRMSNorm`` / ``Qwen3_5MoeRMSNorm`` (so their checkpoints' norm weights load as is).
    """

    def __init__(self, dim: int, eps: float, *, zero_centered: bool = False, backend: str = "auto"):
        super().__init__()
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fla(x, self.backend):  # fused kernels: float32 statistics and product, one cast
            from harts_kernels.norm import rms_norm  # no compile per row count

            w = 1.0 + self.weight.float() if self.zero_centered else self.weight  # as the reference
            return rms_norm(x, w, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return (xf * self.weight.float()).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, zero_centered={self.zero_centered}"


_GATE_ACTIVATIONS = {"sigmoid": torch.sigmoid, "silu": F.silu, "swish": F.silu}


class GatedRMSNorm(nn.Module):
    """``rmsnorm(x) * weight * act(gate)`` over the last dim (per head: x, gate [..., dim]);
    ``weight`` [dim] (ones at init). The parameters of ``fla.modules.FusedRMSNormGated``.

    ``activation``: ``"sigmoid"`` (KDA's output norm, the default) or ``"silu"`` (``"swish"``): the
    output norm of Qwen3-Next / Qwen3.5's gated delta net (transformers' ``Qwen3NextRMSNormGated``,
    norm before gate). Everything is float32 with one cast at the end, as fla's kernel; transformers'
    torch fallback rounds the normalised ``x`` to the input dtype before the weight, so below float32
    the two differ by that rounding (equal in float32).
    """

    def __init__(
        self, hidden_size: int, eps: float = 1e-5, *, activation: str = "sigmoid", backend: str = "auto"
    ):
        super().__init__()
        if activation not in _GATE_ACTIVATIONS:
            raise InvalidInputError(
                "activation", f"{activation!r}; choose one of {sorted(_GATE_ACTIVATIONS)}"
            )
        self.hidden_size, self.eps, self.activation, self.backend = hidden_size, eps, activation, backend
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if use_fla(x, self.backend):
            from harts_kernels.norm import rms_norm_gated  # fla's math, no compile per row count

            return rms_norm_gated(x, gate, self.weight, self.eps, self.activation)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float() * _GATE_ACTIVATIONS[self.activation](gate.float())).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6, backend: str = "naive") -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim (the sum in float32); the fused kernel
    (:func:`harts_kernels.norm.l2norm`, fla's math) when ``backend`` selects it (the reference by
    default)."""
    if use_fla(x, backend):
        from harts_kernels.norm import l2norm

        return l2norm(x, eps)
    return x * torch.rsqrt((x.float() * x.float()).sum(-1, keepdim=True) + eps).to(x.dtype)
