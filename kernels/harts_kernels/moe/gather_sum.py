"""``gather_sum(y, index, k)``: rows gathered by an index and summed k at a time, in one pass.

Contract: ``y`` [M, D], ``index`` int64 [N*k] with entries in ``[0, M)``; returns ``out`` [N, D]
in ``y.dtype`` with ``out[n] = sum_{j < k} y[index[n*k + j]]``, accumulated in float32 in the
order j = 0, 1, ..., k-1 and rounded once. Deterministic (no atomics).

Why: the grouped MoE combines the expert-sorted slots into their rows by a gather with the inverse
permutation, then a sum over the k slots (``y[inverse].view(N, k, D).sum(1)``), and the dispatch's
backward does the same to the slot gradients. That writes and reads back an [N*k, D] temporary
(1.6 GB at N = 65,536, k = 8, D = 1,536 in bf16); here each program reads its k source rows once
and writes one row.

Launch: one program per (row, block of :func:`block_columns` columns); the column block and k are
the only constexprs besides the dtypes, so a new N or M compiles nothing.
"""

from __future__ import annotations

import contextlib

import torch


def block_columns(d: int) -> int:
    """Columns per program: the next power of two of D (at least 16), at most 1,024; D = 1,536
    runs two programs per row (1,024 and 512 live columns)."""
    b = 16
    while b < min(d, 1024):
        b *= 2
    return b


def gather_sum(y: torch.Tensor, index: torch.Tensor, k: int) -> torch.Tensor:
    """``out[n] = sum_{j < k} y[index[n * k + j]]`` (module docstring); CUDA tensors, or any under
    ``TRITON_INTERPRET=1``. ``index`` is trusted to hold valid rows (the MoE's own permutation)."""
    import triton

    from harts_kernels.moe.triton_kernels import gather_sum_kernel

    if k < 1 or index.numel() % k:
        raise ValueError(f"index: {index.numel()} entries is not a multiple of k={k}")
    y = y.contiguous()
    n, d = index.numel() // k, y.shape[-1]
    out = torch.empty((n, d), dtype=y.dtype, device=y.device)
    if n == 0 or d == 0:
        return out
    bd = block_columns(d)
    with torch.cuda.device(y.device) if y.is_cuda else contextlib.nullcontext():
        gather_sum_kernel[(n, triton.cdiv(d, bd))](y, index.contiguous(), out, n, d, K=k, BD=bd, num_warps=4)
    return out
