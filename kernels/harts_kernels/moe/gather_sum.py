"""``gather_sum(y, index, k)``: rows gathered by an index and summed k at a time, in one pass.

Contract: ``y`` [M, D], ``index`` int64 [N*k] with entries in ``[0, M)``, optionally ``base``
[N, D]; returns ``out`` [N, D] in ``y.dtype`` with ``out[n] = base[n] + sum_{j < k} y[index[n*k +
j]]`` (no base: 0), accumulated in float32 in the order base, j = 0, 1, ..., k-1 and rounded once.
Deterministic (no atomics). The MoE passes its shared experts' output as ``base``, so the routed
and shared outputs are added in the same pass.

Why: the grouped MoE combines the expert-sorted slots into their rows by a gather with the inverse
permutation, then a sum over the k slots (``y[inverse].view(N, k, D).sum(1)``), and the dispatch's
backward does the same to the slot gradients. That writes and reads back an [N*k, D] temporary
(1.6 GB at N = 65,536, k = 8, D = 1,536 in bf16); here each program reads its k source rows once
and writes one row.

Launch: one program per (row, block of :func:`block_columns` columns); the column block and k are
the only constexprs besides the dtypes, so a new N or M compiles nothing.
"""

from __future__ import annotations

import torch

from harts_kernels.device import on_device


def block_columns(d: int) -> int:
    """Columns per program: the next power of two of D (at least 16), at most 1,024; D = 1,536
    runs two programs per row (1,024 and 512 live columns)."""
    b = 16
    while b < min(d, 1024):
        b *= 2
    return b


def gather_sum(
    y: torch.Tensor, index: torch.Tensor, k: int, base: torch.Tensor | None = None
) -> torch.Tensor:
    """``out[n] = base[n] + sum_{j < k} y[index[n * k + j]]`` (module docstring); CUDA tensors, or
    any under ``TRITON_INTERPRET=1``. ``index`` is trusted to hold valid rows (the MoE's own
    permutation)."""
    import triton

    from harts_kernels.moe.triton_kernels import gather_sum_kernel

    if k < 1 or index.numel() % k:
        raise ValueError(f"index: {index.numel()} entries is not a multiple of k={k}")
    y = y.contiguous()
    n, d = index.numel() // k, y.shape[-1]
    if base is not None:
        if base.shape != (n, d):
            raise ValueError(f"base: shape {tuple(base.shape)}, expected [{n}, {d}]")
        base = base.contiguous()
    out = torch.empty((n, d), dtype=y.dtype, device=y.device)
    if n == 0 or d == 0:
        return out
    bd = block_columns(d)
    with on_device(y):
        gather_sum_kernel[(n, triton.cdiv(d, bd))](
            y,
            index.contiguous(),
            y if base is None else base,
            out,
            n,
            d,
            K=k,
            HAS_BASE=base is not None,
            BD=bd,
            num_warps=4,
        )
    return out
