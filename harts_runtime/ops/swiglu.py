"""SwiGLU on rows, each row optionally scaled by a weight: :func:`swiglu_rows`.

``swiglu_rows(gu [M, 2I], w [M] or None, backend) -> [M, I]``: ``silu(a) * b`` for
``gu = [a | b]`` (the output of :func:`~harts_runtime.ops.grouped_gemm.gate_up_mm`), times ``w`` per
row if given. The grouped MoE path passes each slot's routing weight as ``w``: the down projection
is linear, ``(w h) W_down = w (h W_down)``, so scaling the I-wide rows here is exact, the combine
has no D-wide weighted temporaries, and the weight's gradient is an I-wide row dot product.

``backend`` is the :mod:`harts_runtime.modules.fused` switch (:func:`~harts_runtime.modules.fused.use_fla`):
``"triton"`` runs the fused Triton kernels of :mod:`harts_kernels.moe` (:class:`_FusedSwiGLU`: the
forward in one pass, the backward in one pass that also forms the weight's gradient; fp32 math, one
rounding per output; only ``gu`` and ``w`` are saved), ``"naive"`` the PyTorch reference
``F.silu(a) * b`` (then ``* w``), ``"auto"`` the kernels on CUDA when triton (with fla-core) is
importable, else the reference. A tensor without rows takes the reference. Neither path
synchronises with the host. (fla's ``swiglu_fwd`` / ``swiglu_fwdbwd`` were used before: with the
weight product, its gradient and the ``cat`` around them they took seven passes where these take
two; :mod:`harts_kernels.moe.swiglu` has the figures.)

``limit`` L > 0 (None or 0: off) is the clipped SwiGLU ``min(silu(a), L) * clamp(b, -L, L)``
(Ling-3.0's ``expert_swiglu_limit``), in both paths.
"""

from __future__ import annotations

import torch

from harts_runtime.modules.fused import use_fla
from harts_runtime.modules.swiglu import swiglu

__all__ = ["swiglu_rows"]


class _FusedSwiGLU(torch.autograd.Function):
    """``silu(a) * b`` (times ``w`` per row, if given) for ``gu = [a | b]`` [M, 2I], through
    :func:`harts_kernels.moe.swiglu_weighted` and its backward (fp32 math, one rounding per output).

    Saves only ``gu`` and ``w``: the backward kernel recomputes ``silu(a) * b``, writes ``d a`` and
    ``d b`` straight into one [M, 2I] gradient and forms ``d w = sum_I(g * silu(a) * b)`` in the
    same pass, so no [M, I] intermediate is kept and nothing is concatenated.
    """

    @staticmethod
    def forward(ctx, gu, w, limit):
        from harts_kernels.moe import swiglu_weighted

        ctx.save_for_backward(gu, w)
        ctx.limit = limit
        return swiglu_weighted(gu, w, limit)

    @staticmethod
    def backward(ctx, g):
        from harts_kernels.moe import swiglu_weighted_bwd

        gu, w = ctx.saved_tensors
        dgu, dw = swiglu_weighted_bwd(gu, w, g, ctx.limit)
        return dgu, (dw if ctx.needs_input_grad[1] else None), None


def swiglu_rows(
    gu: torch.Tensor, w: torch.Tensor | None = None, backend: str = "auto", limit: float | None = None
) -> torch.Tensor:
    """``silu(a) * b``, each row scaled by ``w`` [M] if given, for ``gu = [a | b]`` [M, 2I] -> [M, I]
    (``limit``: the clipped SwiGLU, module docstring).

    ``backend`` as :func:`harts_runtime.modules.fused.use_fla`: the fused kernels
    (:class:`_FusedSwiGLU`) or the PyTorch reference ``F.silu(a) * b`` (then ``* w``)."""
    if use_fla(gu, backend):
        return _FusedSwiGLU.apply(gu, w, limit or None)
    a, b = gu.chunk(2, dim=-1)
    h = swiglu(a, b, limit)
    return h if w is None else h * w[:, None]
