"""The one permutation of the grouped MoE path: assignments sorted by expert, rows to their slots and back.

A router picks k experts for each of N rows (``topk_idx`` int64 [N, k]). The grouped matmuls
(:mod:`harts_runtime.ops.grouped_gemm`) run on the N*k assignment slots (slot ``c * k + j``: row
``c``'s ``j``-th expert) sorted by expert:

* :func:`sort_assignments` ``(topk_idx, E) -> (order, inverse, counts)``: a stable argsort of the
  slots by expert (rows ascending inside one expert, so the grouping is deterministic), its inverse
  by a scatter rather than a second sort, and the per-expert counts by a scatter-add into a fixed
  [E] buffer (``bincount`` on CUDA reads its output size back); the grouped matmuls' offsets are a
  cumsum of the counts;
* :func:`dispatch_rows` ``(x [N, D], rows, inverse, k) -> [N*k, D]``: ``x[rows]`` with
  ``rows = order // k``, every row gathered into its k expert-sorted slots;
* :func:`combine_rows` ``(y [N*k, D], rows, inverse, k) -> [N, D]``: the slots back into row-major
  slot order by one gather with ``inverse``, then a fixed-order sum over each row's k slots (on the
  Triton path one kernel, :func:`harts_kernels.moe.gather_sum`, with no [N*k, D] temporary).

Dispatch and combine are each other's adjoint, and each one's backward is the other's forward:
gathers and fixed-order sums, with no atomics, no accumulating ``index_put`` / ``index_add`` and no
second sort, so forward and backward are deterministic. Everything stays on the device: no value is
read back to the host, forward or backward. (A slot's routing weight follows the same permutation
through :func:`harts_runtime.ops.rows.permute_rows`.)
"""

from __future__ import annotations

import torch

from harts_runtime.modules.fused import use_fla

__all__ = ["combine_rows", "dispatch_rows", "sort_assignments"]


def sort_assignments(topk_idx: torch.Tensor, num_experts: int):
    """The one permutation of the grouped path, computed on the device (no host synchronisation).

    Parameters
    ----------
    topk_idx : Tensor, int64, [N, k]

    Returns
    -------
    order : Tensor, int64, [N*k]
        The assignment slots ``c * k + j`` sorted by expert (stable: rows ascending inside an
        expert, so the grouping is deterministic).
    inverse : Tensor, int64, [N*k]
        The inverse permutation (``inverse[order] = arange``), by a scatter rather than a second sort.
    counts : Tensor, int64, [E]
        Assignments per expert, by a scatter-add into a fixed-size buffer (``bincount`` on CUDA
        reads its output size back from the device).
    """
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    slots = torch.arange(flat.numel(), device=flat.device)
    inverse = torch.empty_like(order).scatter_(0, order, slots)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    return order, inverse, counts


def _gather_sum(y: torch.Tensor, index: torch.Tensor, k: int, fused: bool, base=None) -> torch.Tensor:
    """``y[index]`` [N*k, W] in row-major slot order, summed over each row's k slots -> [N, W], in
    a fixed order (float32 accumulation, one rounding; no atomics), plus ``base`` [N, W] if given.
    ``fused``: in one pass by :func:`harts_kernels.moe.gather_sum`, without the [N*k, W] gathered
    temporary; else PyTorch's gather, its reduction, then the add."""
    if fused:
        from harts_kernels.moe import gather_sum

        return gather_sum(y, index, k, base)
    g = y.index_select(0, index)
    out = g.view(g.shape[0] // k, k, g.shape[-1]).sum(1)
    return out if base is None else base + out


class _Dispatch(torch.autograd.Function):
    """``x[rows]`` with ``rows = order // k``: rows [N, D] to their N*k expert-sorted assignment slots.

    Backward: the slot gradients back to [N, k] order by a gather with ``inverse``, then a sum
    over the k slots (:func:`_gather_sum`), instead of autograd's accumulating ``index_put`` /
    ``index_add`` (a sort or atomics on CUDA). The adjoint of :class:`_Combine`.
    """

    @staticmethod
    def forward(ctx, x, rows, inverse, k, fused):
        ctx.save_for_backward(inverse)
        ctx.k, ctx.fused = k, fused
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, g):
        (inverse,) = ctx.saved_tensors
        return _gather_sum(g, inverse, ctx.k, ctx.fused), None, None, None, None


class _Combine(torch.autograd.Function):
    """Expert-sorted slots [N*k, D] back to their rows [N, D]: one gather by ``inverse`` (row-major
    slot order), then the fixed-order sum over the k slots of a row (:func:`_gather_sum`).

    Backward: ``g[rows]`` (``rows = order // k``, one gather straight into the expert-sorted slot
    order; no expanded [N, k, D] gradient, no scatter). The adjoint of :class:`_Dispatch`.
    """

    @staticmethod
    def forward(ctx, y, rows, inverse, k, fused, base):
        ctx.save_for_backward(rows)
        ctx.has_base = base is not None
        return _gather_sum(y, inverse, k, fused, base)

    @staticmethod
    def backward(ctx, g):
        (rows,) = ctx.saved_tensors
        return g.index_select(0, rows), None, None, None, None, (g if ctx.has_base else None)


def dispatch_rows(
    x: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor, k: int, backend: str = "auto"
) -> torch.Tensor:
    """Rows [N, D] to their N*k expert-sorted assignment slots (``x[rows]``, ``rows = order // k``);
    backward by a gather and a fixed-order sum over the k slots (:class:`_Dispatch`), fused into
    one kernel when ``backend`` selects the Triton path (:func:`~harts_runtime.modules.fused.use_fla`)."""
    return _Dispatch.apply(x, rows, inverse, k, use_fla(x, backend))


def combine_rows(
    y: torch.Tensor,
    rows: torch.Tensor,
    inverse: torch.Tensor,
    k: int,
    backend: str = "auto",
    base: torch.Tensor | None = None,
) -> torch.Tensor:
    """Expert-sorted slots [N*k, D] back to their N rows, summed over the k slots in a fixed order
    (:class:`_Combine`, the adjoint of :func:`dispatch_rows`), plus ``base`` [N, D] if given (the
    shared experts' output; its gradient is the output's); the gather, the sum and the add are one
    kernel when ``backend`` selects the Triton path."""
    return _Combine.apply(y, rows, inverse, k, use_fla(y, backend), base)
