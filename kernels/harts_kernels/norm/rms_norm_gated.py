"""Gated RMSNorm (norm before gate) forward and backward in Triton, one compile per (D, dtype,
activation).

Contract: ``rms_norm_gated(x, gate, weight, eps, activation)`` = ``x * rstd * weight * act(gate)``
over the last dim of ``x`` and ``gate`` [..., D] (same shape), ``rstd = 1 / sqrt(mean(x^2) + eps)``,
``act`` = ``sigmoid`` or ``silu`` (``"swish"`` is ``"silu"``), everything in float32 with one cast
to ``x.dtype``; gradients for ``x``, ``gate`` (in their dtypes) and ``weight`` [D] (in its dtype).
The math is fla's ``rms_norm_gated`` (``fla.modules.fused_norm_gate``) with ``bias=None``, no
residual, ``norm_before_gate``: the output norm of KDA (sigmoid) and of the gated delta net (silu).

Why: fla's ``layer_norm_gated_fwd_kernel`` / ``layer_norm_gated_bwd_kernel`` (D <= 512, the head
dims) carry ``NB = cdiv(T, 65536)`` as a constexpr and autotune key and take the rows per program
``BS = cdiv(T, SMs)`` as a specialized integer, so a never-seen row count compiles them again.

What is specialized and what is not: the kernels of :mod:`harts_kernels.norm.rms_norm`, with the
``ACTIVATION`` constexpr; ``D``, ``BD``, ``BT`` come from
:func:`harts_kernels.norm.launch.launch_config` (no row count); the row count and the backward's
program count are runtime, not-specialized arguments. ``dweight`` is the sum of one float32
partial row per backward program, taken on the host.

Importing this module needs only torch; triton loads on the first call.
"""

from __future__ import annotations

import torch

from harts_kernels.norm.rms_norm import ACTIVATIONS, RMSNormFunction


def rms_norm_gated(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, activation: str = "sigmoid"
) -> torch.Tensor:
    """Gated RMSNorm of ``x`` by ``weight`` and ``act(gate)`` (module docstring); CUDA tensors, or
    any under ``TRITON_INTERPRET=1``. Raises ``ValueError`` for another activation or a ``gate`` of
    another shape."""
    if activation not in ACTIVATIONS or activation == "none":
        raise ValueError(f"rms_norm_gated: activation {activation!r} is not 'sigmoid', 'silu' or 'swish'")
    if gate.shape != x.shape:
        raise ValueError(f"rms_norm_gated: gate {tuple(gate.shape)} is not x's {tuple(x.shape)}")
    return RMSNormFunction.apply(x, gate, weight, eps, ACTIVATIONS[activation])
