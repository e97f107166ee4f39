"""Row maps between physical rows and the packed rows of a KDA schedule, with gather-only backwards.

A schedule's packed rows (:class:`~harts_runtime.layout.kda_plan.KDASchedule`) read every physical
row once at its own position (``own_pos``) and a few rows again as replay (``replay_pos`` ->
``replay_src``). :func:`gather_packed` (physical -> packed) and :func:`scatter_own` (packed core
outputs -> physical rows) use that structure in backward: a gather over ``own_pos`` plus a small
``index_add_`` over the replay rows, and an ``index_copy_`` onto distinct rows, instead of autograd's
accumulating scatter over all rows. :func:`permute_rows` is the same gather for a plain
permutation (no replay rows; the MoE's expert-sorted routing weights).
"""

from __future__ import annotations

import torch

__all__ = ["gather_packed", "permute_rows", "scatter_own"]


class _GatherPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gather, own_pos, replay_pos, replay_src):
        ctx.save_for_backward(own_pos, replay_pos, replay_src)
        return x.index_select(0, gather)

    @staticmethod
    def backward(ctx, grad):
        own_pos, replay_pos, replay_src = ctx.saved_tensors
        dx = grad.index_select(0, own_pos)
        if replay_pos is not None and replay_pos.numel():
            dx.index_add_(0, replay_src, grad.index_select(0, replay_pos))
        return dx, None, None, None, None


class _ScatterOwn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, packed, own_pos):
        ctx.save_for_backward(own_pos)
        ctx.packed_rows = packed.shape[0]
        return packed.index_select(0, own_pos)

    @staticmethod
    def backward(ctx, grad):
        (own_pos,) = ctx.saved_tensors
        d = grad.new_zeros((ctx.packed_rows, *grad.shape[1:]))
        d.index_copy_(0, own_pos, grad)  # distinct rows; replay rows get no output gradient
        return d, None


def gather_packed(x: torch.Tensor, sched) -> torch.Tensor:
    """x [C, ...] physical rows -> [P, ...] packed rows of every round of ``sched``."""
    if sched.identity:
        return x
    return _GatherPacked.apply(x, sched.gather, sched.own_pos, sched.replay_pos, sched.replay_src)


def permute_rows(x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``x[perm]`` for a permutation ``perm`` of x's rows with inverse ``inverse``; backward is
    the gather ``grad[inverse]`` (no zero fill, no accumulation): :func:`gather_packed` with no
    replay rows."""
    return _GatherPacked.apply(x, perm, inverse, None, None)


def scatter_own(packed: torch.Tensor, sched) -> torch.Tensor:
    """[P, ...] packed core outputs -> [C, ...] physical rows (each from its own packed row)."""
    if sched.identity:
        return packed
    return _ScatterOwn.apply(packed, sched.own_pos)
