"""Differentiable collectives for tensor, sequence and expert parallelism (plain ``torch.distributed``).

Each op is an autograd Function whose backward is the adjoint collective (Megatron
``tensor_parallel/mappings.py`` has the same set). They work on gloo (CPU) and NCCL (GPU); where gloo
lacks a primitive (``reduce_scatter``) the op falls back to ``all_reduce`` plus a slice, which is
exact and only costs bandwidth.

=======================  ==========================  =============================
op                       forward                     backward
=======================  ==========================  =============================
:func:`copy_to_tp`       identity                    all-reduce (sum)
:func:`reduce_from_tp`   all-reduce (sum)            identity
:func:`gather_rows`      all-gather rows (uneven)    reduce-scatter rows
:func:`scatter_rows_sum` reduce-scatter rows         all-gather rows
:func:`all_to_all_rows`  all-to-all with splits      all-to-all with swapped splits
=======================  ==========================  =============================

Rows of a tensor of ``n`` rows are split contiguously over ``w`` ranks by :func:`row_split`
(sizes differ by at most one), so any compact row count works without padding rows the model sees.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "all_to_all_rows",
    "copy_to_tp",
    "gather_rows",
    "reduce_from_tp",
    "row_split",
    "scatter_rows_sum",
    "split_rows",
]


def row_split(n: int, world: int) -> list[int]:
    """Contiguous split sizes of ``n`` rows over ``world`` ranks (the first ``n % world`` get one more)."""
    base, extra = divmod(n, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


def split_rows(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's contiguous row block of a replicated ``x`` [n, ...] (no communication)."""
    w, r = dist.get_world_size(group), dist.get_rank(group)
    sizes = row_split(x.shape[0], w)
    start = sum(sizes[:r])
    return x[start : start + sizes[r]]


def _all_gather_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    m = max(sizes)
    pad = x.new_zeros((m - x.shape[0],) + tuple(x.shape[1:]))
    buf = [torch.empty((m,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device) for _ in sizes]
    dist.all_gather(buf, torch.cat([x, pad]).contiguous(), group=group)
    return torch.cat([b[:s] for b, s in zip(buf, sizes)])


def _reduce_scatter_rows(x: torch.Tensor, sizes: list[int], rank: int, group) -> torch.Tensor:
    # gloo has no reduce_scatter: all-reduce then keep this rank's block (exact, 1 / w efficient).
    y = x.contiguous().clone()
    dist.all_reduce(y, group=group)
    start = sum(sizes[:rank])
    return y[start : start + sizes[rank]]


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        y = x.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        w = dist.get_world_size(group)
        sizes = [0] * w
        n = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
        ns = [torch.zeros_like(n) for _ in range(w)]
        dist.all_gather(ns, n, group=group)
        sizes = [int(t.item()) for t in ns]
        ctx.group, ctx.sizes, ctx.rank = group, sizes, dist.get_rank(group)
        return _all_gather_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_rows(g, ctx.sizes, ctx.rank, ctx.group), None


class _ScatterRowsSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        w, r = dist.get_world_size(group), dist.get_rank(group)
        sizes = row_split(x.shape[0], w)
        ctx.group, ctx.sizes = group, sizes
        return _reduce_scatter_rows(x, sizes, r, group)

    @staticmethod
    def backward(ctx, g):
        return _all_gather_rows(g.contiguous(), ctx.sizes, ctx.group), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_sizes, recv_sizes, group):
        ctx.group, ctx.send, ctx.recv = group, send_sizes, recv_sizes
        out = x.new_empty((sum(recv_sizes),) + tuple(x.shape[1:]))
        dist.all_to_all_single(
            out, x.contiguous(), output_split_sizes=recv_sizes, input_split_sizes=send_sizes, group=group
        )
        return out

    @staticmethod
    def backward(ctx, g):
        out = g.new_empty((sum(ctx.send),) + tuple(g.shape[1:]))
        dist.all_to_all_single(
            out, g.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv, group=ctx.group
        )
        return out, None, None, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a tensor-parallel region with replicated rows: identity forward, gradient all-reduced."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a tensor-parallel region: sum the partial outputs of the group (row-parallel output)."""
    return _ReduceFromTP.apply(x, group)


def gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Sequence parallelism: local row block [n_r, ...] -> all rows [sum n_r, ...] in rank order."""
    return _GatherRows.apply(x, group)


def scatter_rows_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Sequence parallelism: partial sums of all rows [n, ...] -> this rank's summed row block
    (:func:`row_split` sizes)."""
    return _ScatterRowsSum.apply(x, group)


def all_to_all_rows(x: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], group) -> torch.Tensor:
    """Send ``x[sum(send_sizes[:j]) : ...]`` to rank ``j`` of ``group``; receive ``recv_sizes[j]`` rows
    from rank ``j`` (concatenated in rank order). Differentiable."""
    return _AllToAll.apply(x, list(send_sizes), list(recv_sizes), group)
