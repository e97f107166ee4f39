"""Expert parallelism for :class:`harts_runtime.layers.moe.CompactMoE` (paper Sections 3.5, 4.2, 4.3).

Each rank of an EP group of size ``ep`` keeps experts ``[r * E / ep, (r + 1) * E / ep)``; the router,
the expert bias and the multiplicity-weighted statistics stay replicated and are computed on the
rank's own compact rows, exactly as in :class:`CompactMoE` (each compact row is routed once, never
expanded by ``q_c``; ``q_c`` only weights z-loss, aux-loss mass/counts and expert-load counts). The
expert computation becomes:

1. sort the ``N * k`` assignments by expert (stable), count them per expert;
2. all-to-all the per-expert counts (``E`` integers), then the rows themselves, to the owning ranks;
3. regroup the received rows by local expert, grouped SwiGLU matmuls (gate and up as one), undo the
   regrouping;
4. all-to-all back, unsort, weight, and sum over the ``k`` slots in a fixed order.

Different ranks may hold different row counts (different microbatches of one slot), and an expert
may receive no rows; the collectives are issued once per MoE forward on every rank, which the step
plan's equal slot count guarantees.

Why not megatron-core's ``MoELayer``/``TopKRouter`` + ``MoEAlltoAllTokenDispatcher``: the router's only
per-token hook is a boolean ``padding_mask`` (no float ``q_c`` weights; a subclass would override
every loss path and ``routing()``), 0.19.2 has the padding-mask x expert-bias broadcast bug
(NVIDIA/Megatron-LM#6111), and the all-to-all dispatcher constructs ``torch.cuda.Stream`` so it cannot
run the CPU tests. The dispatch below is the same algorithm with plain ``torch.distributed``.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from harts_runtime.layers.moe import CompactMoE, gate_up_mm, grouped_mm, swiglu_rows
from harts_runtime.parallel.comm import all_to_all_rows
from harts_runtime.parallel.dims import ParallelConfigError

__all__ = ["ExpertParallelMoE"]


class ExpertParallelMoE(CompactMoE):
    """A :class:`CompactMoE` whose experts are sharded over an EP group.

    Parameters ``w_gate``, ``w_up`` [E_local, D, I] and ``w_down`` [E_local, I, D] hold this rank's
    experts (tagged ``_harts_expert`` so their gradients are summed over the expert-DP group only);
    ``router`` [E, D] and the buffers are replicated. ``forward`` is :meth:`CompactMoE.forward`.
    """

    @classmethod
    def from_dense(cls, moe: CompactMoE, group, rank: int, size: int) -> ExpertParallelMoE:
        """Shard ``moe`` (unchanged) into a new module holding rank ``rank``'s experts."""
        e = moe.config.num_experts
        if e % size:
            raise ParallelConfigError("ep", f"{size} does not divide num_experts={e}")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.config = moe.config
        self.group, self.ep_rank, self.ep_size = group, rank, size
        self.num_local = e // size
        lo = rank * self.num_local
        self.router = nn.Parameter(moe.router.detach().clone())
        # Shared experts (and Qwen's gate on them) are dense: replicated on every EP rank like the
        # router, each rank running them on its own rows; their gradients are summed with the DP
        # gradients, as the router's.
        for name in ("shared_experts", "shared_expert_gate"):
            if name in moe._modules:
                setattr(self, name, copy.deepcopy(moe._modules[name]))
        for name in ("w_gate", "w_up", "w_down"):
            p = nn.Parameter(getattr(moe, name).detach()[lo : lo + self.num_local].clone())
            p._harts_expert = True
            setattr(self, name, p)
        # Keep what tensor/sequence parallelism set on the dense layer (apply_tp runs first): the
        # row shard (SP multiplicity slice + router-statistics reduction) and the TP-partial tags.
        if "row_shard" in moe.__dict__:
            self.row_shard = moe.row_shard
        for name in ("router", "w_gate", "w_up", "w_down"):
            if getattr(getattr(moe, name), "_harts_tp_partial", False):
                getattr(self, name)._harts_tp_partial = True
        self.register_buffer("expert_bias", moe.expert_bias.detach().clone())
        self.register_buffer("local_tokens_per_expert", moe.local_tokens_per_expert.detach().clone())
        self.train(moe.training)
        return self

    def _experts_grouped(self, x, topk_idx, weight):
        return self._experts_ep(x, topk_idx, weight)

    def _experts_loop(self, x, topk_idx, weight):
        return self._experts_ep(x, topk_idx, weight)

    def _experts_ep(self, x: torch.Tensor, topk_idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        n, k = topk_idx.shape
        ep, el = self.ep_size, self.num_local
        flat = topk_idx.reshape(-1)  # [N*k]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.config.num_experts)  # [E]
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)  # [ep * El]: src-major
        send_sizes = counts.view(ep, el).sum(1).tolist()
        rc = recv_counts.view(ep, el)
        recv_sizes = rc.sum(1).tolist()
        xs = all_to_all_rows(x[order // k], send_sizes, recv_sizes, self.group)  # [R, D] src-major
        # Regroup src-major (src, expert) blocks into expert-major (expert, src) order.
        rc_l = rc.tolist()
        starts, s = [], 0
        for src in range(ep):
            row = []
            for e in range(el):
                row.append(s)
                s += rc_l[src][e]
            starts.append(row)
        pieces = [
            torch.arange(starts[src][e], starts[src][e] + rc_l[src][e], device=x.device)
            for e in range(el)
            for src in range(ep)
        ]
        regroup = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=x.device)
        local_counts = rc.sum(0)  # [El]
        xe = xs[regroup]
        # Gate and up as one grouped matmul with [w_gate | w_up], the SwiGLU as in CompactMoE (fla's
        # fused kernel on CUDA). The routing weights stay on the sending rank, so they weight the
        # D-wide outputs after the return all-to-all (folding them into h would need one more
        # all-to-all of the N*k weights).
        h = swiglu_rows(gate_up_mm(xe, self.w_gate, self.w_up, local_counts), None, self.config.backend)
        ye = grouped_mm(h, self.w_down, local_counts)  # [R, D] expert-major
        ys = torch.empty_like(ye).index_copy(0, regroup, ye)  # back to src-major
        yb = all_to_all_rows(ys, recv_sizes, send_sizes, self.group)  # [N*k, D] sorted
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        y = yb[inverse].view(n, k, -1)
        return (y * weight[..., None]).sum(1)
