"""Expert parallelism for :class:`harts_runtime.layers.moe.CompactMoE` (paper Sections 3.5, 4.2, 4.3).

The routed experts ``w_gate``, ``w_up`` [E, D, I] and ``w_down`` [E, I, D] are DTensors
``Shard(0)`` over the EP mesh dimension: rank ``r`` of an EP group of size ``ep`` holds experts
``[r E / ep, (r + 1) E / ep)``. The router, the shared experts (and Qwen's gate on them), the
expert bias and the multiplicity-weighted statistics stay replicated and are computed on the rank's
own compact rows, exactly as in :class:`CompactMoE`: each compact row is routed once, never expanded
by its multiplicity ``q_c`` (``q_c`` only weights the z-loss, the aux-loss mass and counts and the
expert-load counts). The expert computation is :class:`ExpertDispatch`:

1. sort the ``N k`` assignments by expert (:func:`~harts_runtime.ops.dispatch.sort_assignments`),
   gather the rows in that order;
2. all-to-all the per-expert counts (``E`` integers; the one host synchronisation, for the
   split sizes), then the rows, to the ranks that own their experts
   (``torch.distributed._functional_collectives.all_to_all_single_autograd``);
3. regroup the received rows by local expert, the grouped SwiGLU (gate and up as one grouped
   matmul) and the down projection on the local experts, undo the regrouping;
4. all-to-all back, weight each slot by its routing weight, and sum a row's k slots in a fixed
   order.

Different ranks may hold different row counts (different microbatches of one slot, or an empty
padding microbatch), and an expert may receive no rows; the collectives are issued once per MoE
forward on every rank, which the step schedule's equal slot count guarantees
(:mod:`harts_runtime.parallel.data`).
"""

from __future__ import annotations

import torch
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

from harts_runtime.ops.dispatch import combine_rows, dispatch_rows, sort_assignments
from harts_runtime.ops.grouped_gemm import gate_up_mm, grouped_mm
from harts_runtime.ops.swiglu import swiglu_rows

__all__ = ["ExpertDispatch"]


class ExpertDispatch:
    """The ``expert_dispatch`` of a :class:`CompactMoE` under expert parallelism (see the module
    docstring). ``mesh``: the 1-D EP mesh (``ParallelMesh.expert["ep"]``); the MoE's expert
    parameters are read as this rank's local ``[E / ep, ...]`` shards."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.size = mesh.size()
        self.group = mesh.get_group()

    def __call__(self, moe, x: torch.Tensor, topk_idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        n, k = topk_idx.shape
        ep, el = self.size, moe.w_gate.shape[0]  # local experts, from the local shard
        order, inverse, counts = sort_assignments(topk_idx, ep * el)
        rows = torch.div(order, k, rounding_mode="floor")
        xs = dispatch_rows(x, rows, inverse, k, moe.config.backend)  # [N k, D] expert-sorted
        ws = weight.reshape(-1)[order]  # [N k] slot weights, expert-sorted
        # src-major: recv[src * el + e] rows of local expert e come from rank src
        recv = all_to_all_single(counts, None, None, self.group).view(ep, el)
        send_sizes = counts.view(ep, el).sum(1).tolist()
        recv_l = recv.tolist()  # the host synchronisation (split sizes)
        recv_sizes = [sum(r) for r in recv_l]
        xr = all_to_all_single_autograd(xs, recv_sizes, send_sizes, self.group)  # [R, D]
        regroup = _expert_major(recv, sum(recv_sizes))
        local_counts = recv.sum(0)
        h = swiglu_rows(gate_up_mm(xr[regroup], moe.w_gate, moe.w_up, local_counts), None, moe.config.backend)
        ye = grouped_mm(h, moe.w_down, local_counts)  # [R, D] expert-major
        yr = torch.empty_like(ye).index_copy(0, regroup, ye)  # back to src-major
        yb = all_to_all_single_autograd(yr, send_sizes, recv_sizes, self.group)  # [N k, D] expert-sorted
        return combine_rows(yb * ws[:, None], rows, inverse, k, moe.config.backend)


def _expert_major(recv: torch.Tensor, total: int) -> torch.Tensor:
    """Row index [R] that reorders received rows from (source rank, local expert) blocks to (local
    expert, source rank) blocks; ``recv`` [ep, el] the block sizes, ``total`` their sum. On the
    device, O(R)."""
    flat = recv.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat  # src-major block starts
    em_counts = recv.t().reshape(-1)
    em_starts = starts.view_as(recv).t().reshape(-1)
    first = torch.cumsum(em_counts, 0) - em_counts  # expert-major block starts
    block_start = torch.repeat_interleave(em_starts - first, em_counts, output_size=total)
    return block_start + torch.arange(total, device=recv.device)
