"""SwiGLU on rows, each row optionally scaled by a weight: :func:`swiglu_rows`.

``swiglu_rows(gu [M, 2I], w [M] or None, backend) -> [M, I]``: ``silu(a) * b`` for
``gu = [a | b]`` (the output of :func:`~harts_runtime.ops.grouped_gemm.gate_up_mm`), times ``w`` per
row if given. The grouped MoE path passes each slot's routing weight as ``w``: the down projection
is linear, ``(w h) W_down = w (h W_down)``, so scaling the I-wide rows here is exact, the combine
has no D-wide weighted temporaries, and the weight's gradient is an I-wide row dot product.

``backend`` is the :mod:`harts_runtime.modules.fused` switch (:func:`~harts_runtime.modules.fused.use_fla`):
``"triton"`` runs fla's fused Triton SwiGLU kernels (:class:`_FusedSwiGLU`: ``swiglu_fwd`` /
``swiglu_fwdbwd``, fp32 math, one rounding; it saves only ``gu`` and ``w`` and recomputes ``h`` in
the backward kernel, so no [M, I] intermediate is kept), ``"naive"`` the PyTorch reference
``F.silu(a) * b`` (then ``* w``), ``"auto"`` fla's kernels on CUDA when fla-core is importable, else
the reference. A tensor without rows takes the reference. Neither path synchronises with the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from harts_runtime.modules.fused import device_guard, use_fla

__all__ = ["swiglu_rows"]


class _FusedSwiGLU(torch.autograd.Function):
    """``silu(a) * b`` (times ``w`` per row, if given) for ``gu = [a | b]`` [M, 2I], through fla's
    Triton SwiGLU kernels (``swiglu_fwd`` / ``swiglu_fwdbwd``, the ones ``fla.modules.activations
    .swiglu`` runs; fp32 math, one rounding).

    Saves only ``gu`` and ``w``: the backward recomputes ``h = silu(a) * b`` in the same kernel that
    forms ``da``, ``db`` (``use_weight=True``), so no [M, I] intermediate is kept. ``da`` and
    ``db`` are written into one [M, 2I] gradient (one ``cat``; two slice backwards would each fill
    a zero [M, 2I] buffer and add them). ``dw = sum_I(g * h)``, as autograd forms it for ``h * w``.
    """

    @staticmethod
    def forward(ctx, gu, w):
        from fla.modules.activations.ops import swiglu_fwd

        a, b = gu.chunk(2, dim=-1)
        with device_guard(gu):
            h = swiglu_fwd(a, b)
        ctx.save_for_backward(gu, w)
        return h if w is None else h.mul_(w[:, None])

    @staticmethod
    def backward(ctx, g):
        from fla.modules.activations.ops import swiglu_fwdbwd

        gu, w = ctx.saved_tensors
        a, b = gu.chunk(2, dim=-1)
        need_w = w is not None and ctx.needs_input_grad[1]
        with device_guard(gu):
            if w is None:
                da, db = swiglu_fwdbwd(a, b, g)
            else:
                da, db, h = swiglu_fwdbwd(a, b, g * w[:, None], use_weight=True)
        dw = (g * h).sum(-1) if need_w else None
        return torch.cat([da, db], dim=-1), dw


def swiglu_rows(gu: torch.Tensor, w: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """``silu(a) * b``, each row scaled by ``w`` [M] if given, for ``gu = [a | b]`` [M, 2I] -> [M, I].

    ``backend`` as :func:`harts_runtime.modules.fused.use_fla`: fla's fused kernels
    (:class:`_FusedSwiGLU`) or the PyTorch reference ``F.silu(a) * b`` (then ``* w``)."""
    if use_fla(gu, backend):
        return _FusedSwiGLU.apply(gu, w)
    a, b = gu.chunk(2, dim=-1)
    h = F.silu(a) * b
    return h if w is None else h * w[:, None]
