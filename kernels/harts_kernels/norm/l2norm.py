"""L2 norm over the last dim, forward and backward in Triton, one compile per (D, dtype).

Contract: ``l2norm(x, eps)`` = ``x * rstd`` with ``rstd = 1 / sqrt(sum(x^2, -1) + eps)`` over the
last dim of ``x`` [..., D], in float32 with one cast to ``x.dtype``; the backward takes the saved
output ``y`` (in ``x.dtype``) and ``rstd`` (float32): ``dx = dy rstd - sum(dy y) y rstd``, cast to
``x.dtype``. The math, and what is saved, are fla's ``l2norm`` (``fla.modules.l2norm``, with
``output_dtype=None``): the L2 norm of KDA's and the gated delta net's queries and keys.

Why: fla's ``l2norm_fwd_kernel`` / ``l2norm_bwd_kernel`` (D <= 512, the head dims) carry ``NB =
cdiv(T, 65536)`` as a constexpr and autotune key, so every microbatch of a never-seen row count
autotunes and compiles them again.

What is specialized: ``D``, ``BD``, ``BT`` (constexprs from
:func:`harts_kernels.norm.launch.launch_config`, no row count), the dtypes, the pointers'
alignment. What is not: the row count ``T`` (runtime, ``do_not_specialize``). Forward and backward
run ``cdiv(T, BT)`` programs of one block of ``BT`` rows each (no reduction across rows).

Importing this module needs only torch; triton loads on the first call.
"""

from __future__ import annotations

import torch

from harts_kernels.device import on_device
from harts_kernels.norm.launch import as_rows, launch_config, row_blocks

_KERNELS: dict | None = None


def _build_kernels() -> dict:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["T"])
    def l2norm_fwd_kernel(x, y, rstd, eps, T, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr):
        o_t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
        o_d = tl.arange(0, BD)
        m_t = o_t < T
        m_x = m_t[:, None] & (o_d[None, :] < D)
        p_x = o_t[:, None] * D + o_d[None, :]
        b_x = tl.load(x + p_x, mask=m_x, other=0.0).to(tl.float32)
        b_rstd = 1 / tl.sqrt(tl.sum(b_x * b_x, axis=1) + eps)
        tl.store(y + p_x, (b_x * b_rstd[:, None]).to(y.dtype.element_ty), mask=m_x)
        tl.store(rstd + o_t, b_rstd, mask=m_t)

    @triton.jit(do_not_specialize=["T"])
    def l2norm_bwd_kernel(y, rstd, dy, dx, T, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr):
        o_t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
        o_d = tl.arange(0, BD)
        m_t = o_t < T
        m_x = m_t[:, None] & (o_d[None, :] < D)
        p_x = o_t[:, None] * D + o_d[None, :]
        b_y = tl.load(y + p_x, mask=m_x, other=0.0).to(tl.float32)
        b_dy = tl.load(dy + p_x, mask=m_x, other=0.0).to(tl.float32)
        b_rstd = tl.load(rstd + o_t, mask=m_t, other=0.0)
        b_dx = b_dy * b_rstd[:, None] - tl.sum(b_dy * b_y, axis=1)[:, None] * b_y * b_rstd[:, None]
        tl.store(dx + p_x, b_dx.to(dx.dtype.element_ty), mask=m_x)

    return {"fwd": l2norm_fwd_kernel, "bwd": l2norm_bwd_kernel}


def kernels() -> dict:
    """The Triton kernels ``{"fwd": ..., "bwd": ...}`` (JIT functions), built on the first call."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _build_kernels()
    return _KERNELS


def l2norm_fwd(x: torch.Tensor, eps: float):
    """``(y, rstd)`` for ``x`` [T, D] contiguous."""
    T, D = x.shape
    cfg = launch_config(D, x.dtype)
    y = torch.empty_like(x)
    rstd = torch.empty((T,), dtype=torch.float32, device=x.device)
    if T:
        with on_device(x):
            kernels()["fwd"][(row_blocks(T, cfg),)](
                x, y, rstd, eps, T, D=D, BD=cfg.BD, BT=cfg.BT, num_warps=cfg.num_warps
            )
    return y, rstd


def l2norm_bwd(dy: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """``dx`` for ``dy``, the forward's ``y`` [T, D] contiguous and its ``rstd`` [T]."""
    T, D = y.shape
    cfg = launch_config(D, y.dtype)
    dx = torch.empty_like(y)
    if T:
        with on_device(y):
            kernels()["bwd"][(row_blocks(T, cfg),)](
                y, rstd, dy, dx, T, D=D, BD=cfg.BD, BT=cfg.BT, num_warps=cfg.num_warps
            )
    return dx


class L2NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps):
        y, rstd = l2norm_fwd(as_rows(x), eps)
        ctx.save_for_backward(y, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        y, rstd = ctx.saved_tensors
        return l2norm_bwd(as_rows(dy), y, rstd).view(ctx.shape), None


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """L2 norm of ``x`` [..., D] over the last dim (module docstring); CUDA tensors, or any under
    ``TRITON_INTERPRET=1``."""
    return L2NormFunction.apply(x, eps)
