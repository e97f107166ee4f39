"""RMSNorm (optionally gated) forward and backward in Triton, one compile per (D, dtype, gate).

Contract: ``rms_norm(x, weight, eps)`` = ``x * rsqrt(mean(x^2, -1) + eps) * weight`` over the last
dim of ``x`` [..., D], statistics and product in float32, one cast to ``x.dtype``; gradients for
``x`` and ``weight`` (``weight`` [D], any float dtype; its gradient in its dtype). The math is fla's
``rms_norm`` (``fla.modules.norm.layernorm``: ``rstd = 1 / sqrt(mean(x^2) + eps)``, ``dx = (w dy -
xhat mean(xhat w dy)) rstd``). The kernels here also serve
:func:`harts_kernels.norm.rms_norm_gated` (the ``ACTIVATION`` constexpr: ``"none"``, ``"sigmoid"``,
``"silu"``).

Why: fla's kernels compile per row count. For D <= 512 its forward and backward carry ``NB =
cdiv(T, 2048)`` as a constexpr and autotune key, and its backward the rows per program ``BS``; for
D > 512 its backward row kernel takes ``BS = cdiv(T, SMs)`` as a constexpr: a never-seen step of
12 microbatches compiles the row kernel 12 times (more than half of the step's first-pass
overhead), and bucketing ``BS`` still compiles once per new bucket.

What is specialized: ``D``, ``BD``, ``BT``, ``ACTIVATION`` (constexprs from
:func:`harts_kernels.norm.launch.launch_config`, no row count), the dtypes, the pointers' alignment.
What is not: the row count ``T`` and the backward's program count ``NP`` (runtime,
``do_not_specialize``). Forward: ``cdiv(T, BT)`` programs of one block of ``BT`` rows. Backward:
:func:`~harts_kernels.norm.launch.backward_programs` programs, program ``p`` takes row blocks
``p, p + NP, ...`` (a runtime loop bound and stride), accumulates ``dweight`` in float32 and writes
one partial row; the host sums the partial rows (fla's reduction, grouped differently).

Importing this module needs only torch; triton loads on the first call.
"""

from __future__ import annotations

import torch

from harts_kernels.device import on_device
from harts_kernels.norm.launch import as_rows, backward_programs, launch_config, row_blocks, sm_count

# activation names of the gate -> the kernels' ACTIVATION constexpr
ACTIVATIONS = {"none": "none", "sigmoid": "sigmoid", "silu": "silu", "swish": "silu"}

_KERNELS: dict | None = None


def _build_kernels() -> dict:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["T"])
    def rms_norm_fwd_kernel(
        x,
        g,
        w,
        y,
        rstd,
        eps,
        T,
        D: tl.constexpr,
        BD: tl.constexpr,
        BT: tl.constexpr,
        ACTIVATION: tl.constexpr,
    ):
        o_t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
        o_d = tl.arange(0, BD)
        m_t = o_t < T
        m_d = o_d < D
        m_x = m_t[:, None] & m_d[None, :]
        p_x = o_t[:, None] * D + o_d[None, :]
        b_x = tl.load(x + p_x, mask=m_x, other=0.0).to(tl.float32)
        b_rstd = 1 / tl.sqrt(tl.sum(b_x * b_x, axis=1) / D + eps)
        tl.store(rstd + o_t, b_rstd, mask=m_t)
        b_w = tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_y = b_x * b_rstd[:, None] * b_w[None, :]
        if ACTIVATION == "sigmoid":
            b_g = tl.load(g + p_x, mask=m_x, other=0.0).to(tl.float32)
            b_y = b_y * tl.sigmoid(b_g)
        elif ACTIVATION == "silu":
            b_g = tl.load(g + p_x, mask=m_x, other=0.0).to(tl.float32)
            b_y = b_y * b_g * tl.sigmoid(b_g)
        tl.store(y + p_x, b_y.to(y.dtype.element_ty), mask=m_x)

    @triton.jit(do_not_specialize=["T", "NP"])
    def rms_norm_bwd_kernel(
        x,
        g,
        w,
        dy,
        rstd,
        dx,
        dg,
        dw,
        T,
        NP,
        D: tl.constexpr,
        BD: tl.constexpr,
        BT: tl.constexpr,
        ACTIVATION: tl.constexpr,
    ):
        i_p = tl.program_id(0)
        o_d = tl.arange(0, BD)
        m_d = o_d < D
        b_w = tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_dw = tl.zeros([BT, BD], dtype=tl.float32)
        for i_b in range(i_p, tl.cdiv(T, BT), NP):
            o_t = (i_b * BT + tl.arange(0, BT)).to(tl.int64)
            m_t = o_t < T
            m_x = m_t[:, None] & m_d[None, :]
            p_x = o_t[:, None] * D + o_d[None, :]
            b_x = tl.load(x + p_x, mask=m_x, other=0.0).to(tl.float32)
            b_dy = tl.load(dy + p_x, mask=m_x, other=0.0).to(tl.float32)
            b_rstd = tl.load(rstd + o_t, mask=m_t, other=0.0)
            b_xhat = b_x * b_rstd[:, None]
            if ACTIVATION != "none":
                b_g = tl.load(g + p_x, mask=m_x, other=0.0).to(tl.float32)
                b_s = tl.sigmoid(b_g)
                b_y = b_xhat * b_w[None, :]
                if ACTIVATION == "sigmoid":
                    b_gate = b_s
                    b_dg = b_dy * b_y * b_s * (1 - b_s)
                else:
                    b_gate = b_g * b_s
                    b_dg = b_dy * b_y * (b_s + b_g * b_s * (1 - b_s))
                tl.store(dg + p_x, b_dg.to(dg.dtype.element_ty), mask=m_x)
                b_dy = b_dy * b_gate
            b_dw += b_dy * b_xhat  # rows past T and columns past D hold zeros
            b_wdy = b_dy * b_w[None, :]
            b_c1 = tl.sum(b_xhat * b_wdy, axis=1) / D
            b_dx = (b_wdy - b_xhat * b_c1[:, None]) * b_rstd[:, None]
            tl.store(dx + p_x, b_dx.to(dx.dtype.element_ty), mask=m_x)
        tl.store(dw + i_p.to(tl.int64) * D + o_d, tl.sum(b_dw, axis=0), mask=m_d)

    return {"fwd": rms_norm_fwd_kernel, "bwd": rms_norm_bwd_kernel}


def kernels() -> dict:
    """The Triton kernels ``{"fwd": ..., "bwd": ...}`` (JIT functions), built on the first call."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _build_kernels()
    return _KERNELS


def rms_norm_fwd(x, gate, weight, eps: float, activation: str):
    """``(y, rstd)`` for ``x`` (and ``gate`` or None) [T, D] contiguous; ``activation`` is a value of
    :data:`ACTIVATIONS`."""
    T, D = x.shape
    cfg = launch_config(D, x.dtype)
    y = torch.empty_like(x)
    rstd = torch.empty((T,), dtype=torch.float32, device=x.device)
    if T:
        with on_device(x):
            kernels()["fwd"][(row_blocks(T, cfg),)](
                x, gate, weight, y, rstd, eps, T,
                D=D, BD=cfg.BD, BT=cfg.BT, ACTIVATION=activation, num_warps=cfg.num_warps,
            )  # fmt: skip
    return y, rstd


def rms_norm_bwd(dy, x, gate, weight, rstd, activation: str):
    """``(dx, dgate or None, dweight)`` for ``dy``, ``x``, ``gate`` [T, D] contiguous and the
    forward's ``rstd`` [T]; ``dweight`` in ``weight.dtype``."""
    T, D = x.shape
    cfg = launch_config(D, x.dtype)
    dx = torch.empty_like(x)
    dg = torch.empty_like(gate) if gate is not None else None
    ns = backward_programs(T, cfg, sm_count(x.device))
    dw = torch.empty((ns, D), dtype=torch.float32, device=x.device)  # every program writes its row
    if T:
        with on_device(x):
            kernels()["bwd"][(ns,)](
                x, gate, weight, dy, rstd, dx, dg, dw, T, ns,
                D=D, BD=cfg.BD, BT=cfg.BT, ACTIVATION=activation, num_warps=cfg.num_warps,
            )  # fmt: skip
    else:
        dw.zero_()
    return dx, dg, dw.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    """Autograd of :func:`rms_norm` and :func:`harts_kernels.norm.rms_norm_gated` (``gate`` None
    with ``activation`` ``"none"``)."""

    @staticmethod
    def forward(ctx, x, gate, weight, eps, activation):
        x2 = as_rows(x)
        g2 = as_rows(gate) if gate is not None else None
        y, rstd = rms_norm_fwd(x2, g2, weight, eps, activation)
        ctx.save_for_backward(x2, g2, weight, rstd)
        ctx.shape, ctx.activation = x.shape, activation
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x, g, weight, rstd = ctx.saved_tensors
        dx, dg, dw = rms_norm_bwd(as_rows(dy), x, g, weight, rstd, ctx.activation)
        return dx.view(ctx.shape), dg.view(ctx.shape) if dg is not None else None, dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` [..., D] by ``weight`` [D] (module docstring); CUDA tensors, or any under
    ``TRITON_INTERPRET=1``."""
    return RMSNormFunction.apply(x, None, weight, eps, "none")
