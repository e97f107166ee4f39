"""SwiGLU with a per-row weight, forward and backward, each in one memory pass.

Contract: ``gu = [a | b]`` [M, 2I] (contiguous), ``w`` [M] or None.
:func:`swiglu_weighted` returns ``h = silu(a) * b * w[:, None]`` [M, I] in ``gu.dtype``;
:func:`swiglu_weighted_bwd` ``(gu, w, g [M, I]) -> (d gu [M, 2I], d w [M] or None)`` with
``d a = g w b s (1 + a (1 - s))``, ``d b = g w silu(a)`` (``s = sigmoid(a)``) and
``d w = sum_I g silu(a) b``. All math in float32, one rounding per output.

Clipped SwiGLU (Ling-3.0's ``expert_swiglu_limit``): with ``limit`` L > 0 (None or 0: off),
``h = min(silu(a), L) * clamp(b, -L, L) * w``; the backward passes each clamp's gradient where
its input lies inside the closed interval (torch's ``clamp`` convention), zero outside.

Why: the grouped MoE folds each slot's routing weight into its I-wide SwiGLU row
(:mod:`harts_runtime.ops.swiglu`). On fla's SwiGLU kernels that takes the SwiGLU, a separate
``h *= w``, in the backward ``g * w``, the SwiGLU backward recomputing ``h``, ``(g * h).sum(-1)``
and a ``cat`` of ``da`` and ``db``: seven passes over [M, I]-sized tensors, about an eighth of the
grouped MoE's time (benchmarks/README.md, "Numbers behind the source's design notes"). Here the
forward is one pass, and the backward one pass that writes ``d gu`` in place and ``d w`` by an
in-register row sum.

Launch: ``M`` is runtime and not specialized; the blocks come from I alone
(:func:`launch_blocks`), so a new row count compiles nothing.
"""

from __future__ import annotations

import torch

from harts_kernels.device import on_device


def launch_blocks(i: int) -> tuple[int, int]:
    """``(BM, BI)``: rows and columns per program for width I. Columns: I's next power of two, at
    most 512 (the backward loops over I in blocks of BI); rows: so a block holds 4,096 elements."""
    bi = 16
    while bi < min(i, 512):
        bi *= 2
    return max(1, 4096 // bi), bi


def _check(gu: torch.Tensor, w: torch.Tensor | None):
    if gu.dim() != 2 or gu.shape[1] % 2:
        raise ValueError(f"gu: shape {tuple(gu.shape)} is not [M, 2I]")
    if w is not None and w.shape != (gu.shape[0],):
        raise ValueError(f"w: shape {tuple(w.shape)}, expected [{gu.shape[0]}]")


def swiglu_weighted(
    gu: torch.Tensor, w: torch.Tensor | None = None, limit: float | None = None
) -> torch.Tensor:
    """``silu(a) * b * w[:, None]`` for ``gu = [a | b]`` [M, 2I] (module docstring); with a
    ``limit`` (> 0) the clipped SwiGLU ``min(silu(a), limit) * clamp(b, -limit, limit) * w``."""
    import triton

    from harts_kernels.moe.triton_kernels import swiglu_fwd_kernel

    _check(gu, w)
    gu = gu.contiguous()
    m, i = gu.shape[0], gu.shape[1] // 2
    h = torch.empty((m, i), dtype=gu.dtype, device=gu.device)
    if m == 0 or i == 0:
        return h
    bm, bi = launch_blocks(i)
    with on_device(gu):
        swiglu_fwd_kernel[(triton.cdiv(m, bm), triton.cdiv(i, bi))](
            gu,
            w if w is not None else gu,
            h,
            m,
            i,
            float(limit or 0.0),
            HAS_W=w is not None,
            HAS_LIMIT=bool(limit),
            BM=bm,
            BI=bi,
            num_warps=4,
        )
    return h


def swiglu_weighted_bwd(
    gu: torch.Tensor, w: torch.Tensor | None, g: torch.Tensor, limit: float | None = None
):
    """``(d gu [M, 2I], d w [M] or None)`` of :func:`swiglu_weighted` (with the same ``limit``)
    for the output gradient ``g``."""
    import triton

    from harts_kernels.moe.triton_kernels import swiglu_bwd_kernel

    _check(gu, w)
    gu, g = gu.contiguous(), g.contiguous()
    m, i = gu.shape[0], gu.shape[1] // 2
    if g.shape != (m, i):
        raise ValueError(f"g: shape {tuple(g.shape)}, expected [{m}, {i}]")
    dgu = torch.empty_like(gu)
    dw = None if w is None else torch.empty_like(w)
    if m == 0 or i == 0:
        if dw is not None:
            dw.zero_()
        return dgu.zero_(), dw
    bm, bi = launch_blocks(i)
    with on_device(gu):
        swiglu_bwd_kernel[(triton.cdiv(m, bm),)](
            gu,
            w if w is not None else gu,
            g,
            dgu,
            dw if dw is not None else gu,
            m,
            i,
            float(limit or 0.0),
            HAS_W=w is not None,
            HAS_LIMIT=bool(limit),
            BM=bm,
            BI=bi,
            num_warps=4,
        )
    return dgu, dw
