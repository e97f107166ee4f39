"""RMSNorm forward and backward on fla's kernels, without a compile per row count.

Contract: ``rms_norm(x, weight, eps)`` = ``x * rsqrt(mean(x^2, -1) + eps) * weight`` over the last
dim of ``x`` [..., D], statistics and product in float32, one cast to ``x.dtype``; gradients for
``x`` and ``weight`` (``weight`` [D], any float dtype; its gradient in its dtype). The math and the
kernels are fla's ``rms_norm`` (``fla.modules.norm.layernorm``); only the backward's launch differs.

Why: for D > 512 fla's backward runs ``layer_norm_bwd_kernel_row`` with ``NS`` = the SM count
programs of ``BS = ceil(T / NS)`` rows each, and ``BS`` is a ``tl.constexpr``. Every row count T
that gives a new ``BS`` compiles the kernel again: on the H200 (132 SMs) a never-seen step of 12
microbatches compiled it 12 times (3.1 s of a 5.8 s first-pass overhead), and T <= 65,536 allows
497 variants. Here ``BS`` is rounded up by :func:`rows_per_program` to one of four values per
octave (at most 25% more rows for a program, about 4 log2(BS) variants in all) and the grid is the
``ceil(T / BS)`` programs the rows need; the programs-per-group constexpr ``GS`` (fla: ``NS``) is
the SM count, which any grid of one group may use. The kernel bounds each program's loop by T and
writes one partial ``dw`` row per program, so the result is fla's with the partial sums grouped
differently.

For D <= 512 fla takes another kernel whose row bucket (``NB = ceil(T / 2048)``) is already bounded;
that path is fla's own ``layer_norm_bwd``.
"""

from __future__ import annotations

import contextlib

import torch


def _on_device(t: torch.Tensor):
    """fla's kernels launch on the current CUDA device: make it ``t``'s (a no-op off CUDA)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def rows_per_program(rows: int, programs: int) -> int:
    """Rows per program of the backward: ``ceil(rows / programs)`` rounded up to ``m * 2**e`` with
    ``m`` in {4, 5, 6, 7} (exact below 8). Never less than ``ceil(rows / programs)``, at most 25%
    more (rounding keeps it within a quarter of an octave)."""
    need = -(-max(rows, 1) // max(programs, 1))
    if need <= 8:
        return need
    step = 1 << (need.bit_length() - 3)  # need in [4 step, 8 step)
    return -(-need // step) * step


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        from fla.modules.norm.layernorm import layer_norm_fwd

        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        with _on_device(x):
            y, _, rstd, _ = layer_norm_fwd(x=x2, weight=weight, bias=None, eps=eps, is_rms_norm=True)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        with _on_device(x):
            dx, dw = rms_norm_bwd(dy.reshape(x.shape).contiguous(), x, weight, rstd)
        return dx.view(ctx.shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` [..., D] by ``weight`` [D] (module docstring); on CUDA tensors (or under
    ``TRITON_INTERPRET=1``) with fla-core installed."""
    return _RMSNorm.apply(x, weight, eps)


def rms_norm_bwd(dy, x, weight, rstd):
    """``(dx, dweight)`` of :func:`rms_norm` for ``x``, ``dy`` [T, D] and the forward's ``rstd`` [T]."""
    import triton
    from fla.modules.norm.layernorm import layer_norm_bwd, layer_norm_bwd_kernel_row
    from fla.utils import IS_INTEL, get_multiprocessor_count

    T, D = x.shape
    if D <= 512 and not (D == 512 and IS_INTEL):
        dx, dw, _, _ = layer_norm_bwd(dy=dy, x=x, weight=weight, bias=None, rstd=rstd, is_rms_norm=True)
        return dx, dw
    bd = min(65536 // x.element_size(), triton.next_power_of_2(D))
    if D > bd:
        raise RuntimeError("rms_norm: feature dim >= 64KB is not supported (fla's limit)")
    sms = get_multiprocessor_count(x.device.index)
    bs = rows_per_program(T, min(sms, T))
    ns = -(-T // bs)  # <= min(sms, T)
    dx = torch.empty_like(x)
    dw = torch.empty((ns, D), dtype=torch.float32, device=x.device)
    layer_norm_bwd_kernel_row[(ns,)](
        x=x,
        w=weight,
        b=None,
        y=None,
        dy=dy,
        dx=dx,
        dw=dw,
        db=None,
        dres=None,
        dres_in=None,
        mean=None,
        rstd=rstd,
        T=T,
        G=1,
        D=D,
        BS=bs,
        BD=bd,
        GS=sms,  # programs per group, a constexpr too: any value >= ns (one group) is right
        IS_RMS_NORM=True,
        HAS_DRESIDUAL=False,
        STORE_DRESIDUAL=False,
        HAS_WEIGHT=True,
        HAS_BIAS=False,
        RECOMPUTE_OUTPUT=False,
    )
    return dx, dw.sum(0).to(weight.dtype)
