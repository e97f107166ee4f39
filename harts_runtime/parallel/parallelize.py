"""Compose the parallelisms of a hybrid model in one ordered function (torchtitan style).

:func:`parallelize` applies, in this order:

1. :func:`apply_tp`: shard every mixer (GQA/MHA, MLA, KDA) and dense SwiGLU FFN over the TP group
   (:mod:`harts_runtime.parallel.tensor`); MoE layers stay replicated over TP (or go to EP);
2. :func:`apply_ep`: replace every :class:`CompactMoE` by an :class:`ExpertParallelMoE` holding
   ``num_experts / ep`` experts (:mod:`harts_runtime.parallel.expert`);
3. :func:`apply_dp`: make the replicas identical (broadcast from DP rank 0 of each group) and tag the
   parameters for :func:`harts_runtime.parallel.data.allreduce_gradients`; the step itself is run by
   :func:`harts_runtime.parallel.data.run_replica_step` over the step plan;
4. :func:`apply_recompute` (optional): full-block activation recomputation with
   ``torch.utils.checkpoint`` (non-reentrant). Use it *or* the train step's own ``recompute`` flag.

The model is any module whose blocks have ``.mixer`` and ``.ffn`` children (``harts_runtime.model``'s
``HybridModel.blocks``); layers are recognised by type, so the single-process model code is unchanged
and never imports this package.

Why not megatron-core's recomputation (``tensor_parallel.checkpoint``): it is reentrant and restores
CUDA RNG tracker state; our layers have no dropout, so there is no RNG state to restore, and the
non-reentrant torch checkpoint re-issues the same TP/EP collectives in the same order on every rank
during backward. The megatron-core parts that fit are optional: process groups can come from
``megatron.core.parallel_state`` (:func:`megatron_groups`) on the GPU machine.

Not yet built (see ``docs/parallel.md``): pipeline parallelism (``pp > 1`` is rejected by
:class:`ParallelDims`); model-level sequence parallelism (the layers support it and are tested, but
the model's embedding/LM-head row scatter/gather and the TP reduction of MoE router statistics
on SP rows are not wired); the vocabulary-parallel LM head inside the model (the vocab-parallel
mapped log-probs are built and tested, :mod:`harts_runtime.parallel.vocab`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from harts_runtime.moe import CompactMoE
from harts_runtime.parallel.dims import ParallelConfigError, ParallelDims, ParallelGroups
from harts_runtime.parallel.expert import ExpertParallelMoE
from harts_runtime.parallel.tensor import _is_swiglu, tensor_parallel_layer

__all__ = ["apply_dp", "apply_ep", "apply_recompute", "apply_tp", "megatron_groups", "parallelize"]


def _blocks(model: nn.Module) -> list[nn.Module]:
    blocks = [m for m in model.modules() if hasattr(m, "mixer") and hasattr(m, "ffn")]
    if not blocks:
        raise ParallelConfigError("model", f"{type(model).__name__} has no blocks with .mixer and .ffn")
    return blocks


def apply_tp(model: nn.Module, groups: ParallelGroups) -> None:
    """Tensor parallelism over ``groups.tp``: mixers and dense FFNs, in place."""
    dims = groups.dims
    if dims.sequence_parallel:
        raise ParallelConfigError("sequence_parallel", "model-level sequence parallelism is not wired yet "
                                                       "(layers support it; see docs/parallel.md)")
    for block in _blocks(model):
        tensor_parallel_layer(block.mixer, groups.tp, groups.tp_rank, dims.tp)
        if _is_swiglu(block.ffn):
            tensor_parallel_layer(block.ffn, groups.tp, groups.tp_rank, dims.tp)


def apply_ep(model: nn.Module, groups: ParallelGroups) -> None:
    """Expert parallelism over ``groups.ep``: every ``CompactMoE`` becomes an ``ExpertParallelMoE``."""
    for block in _blocks(model):
        if isinstance(block.ffn, CompactMoE) and not isinstance(block.ffn, ExpertParallelMoE):
            block.ffn = ExpertParallelMoE.from_dense(block.ffn, groups.ep, groups.ep_rank, groups.dims.ep)


@torch.no_grad()
def apply_dp(model: nn.Module, groups: ParallelGroups) -> None:
    """Broadcast parameters and buffers from the first replica of each group, so every replica starts
    identical (dense tensors over the DP group, expert shards over the expert-DP group)."""
    dims = groups.dims
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        expert = getattr(t, "_harts_expert", False)
        kind, size = ("edp", dims.dp // dims.ep) if expert else ("dp", dims.dp)
        if size > 1:
            dist.broadcast(t.data, src=groups.ranks[kind][0], group=getattr(groups, kind))


class _Checkpointed(nn.Module):
    """Wraps a block: forward under ``torch.utils.checkpoint`` while grad is enabled."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules")       # absent while copying / unpickling
            if not modules or "block" not in modules:
                raise
            return getattr(modules["block"], name)

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            return checkpoint(self.block, *args, use_reentrant=False, **kwargs)
        return self.block(*args, **kwargs)


def apply_recompute(model: nn.Module) -> None:
    """Full-block activation recomputation: each block's forward is re-run in backward."""
    for parent in list(model.modules()):
        if isinstance(parent, _Checkpointed):
            continue
        for name, child in list(parent.named_children()):
            if hasattr(child, "mixer") and hasattr(child, "ffn") and not isinstance(child, _Checkpointed):
                if isinstance(parent, nn.ModuleList):
                    parent[int(name)] = _Checkpointed(child)
                else:
                    setattr(parent, name, _Checkpointed(child))


def parallelize(model: nn.Module, dims: ParallelDims, groups: ParallelGroups, *,
                recompute: bool = False) -> nn.Module:
    """Apply TP, EP, DP (and recomputation) to ``model`` in place, in that order; returns it.

    ``groups`` come from :meth:`ParallelDims.build_groups` (or :func:`megatron_groups`) and must match
    ``dims``. Every rank builds the same model (same seed/checkpoint) before calling this.
    """
    if groups.dims != dims:
        raise ParallelConfigError("groups", f"built for {groups.dims}, not {dims}")
    if dims.tp > 1:
        apply_tp(model, groups)
    if dims.ep > 1:
        apply_ep(model, groups)
    apply_dp(model, groups)
    if recompute:
        apply_recompute(model)
    model._harts_parallel = dims
    return model


def megatron_groups(dims: ParallelDims) -> ParallelGroups:
    """Process groups from ``megatron.core.parallel_state`` (optional extra ``megatron``, Python >= 3.12
    for megatron-core >= 0.17). Megatron's default rank order ``tp-cp-ep-dp-pp`` puts TP fastest, as
    :class:`ParallelDims` does; with ``tp > 1`` and ``ep > 1`` Megatron folds EP over TP x DP
    (``expert_tensor_parallel_size = 1``), which differs from our EP-over-DP groups, so that
    combination is rejected here.
    """
    if dims.tp > 1 and dims.ep > 1:
        raise ParallelConfigError("ep", "megatron's EP groups span TP ranks; use ParallelDims.build_groups")
    from megatron.core import parallel_state as ps  # optional dependency, parallel path only

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
                                     expert_model_parallel_size=dims.ep)
    rank = dist.get_rank()
    groups = {"dp": ps.get_data_parallel_group(), "tp": ps.get_tensor_model_parallel_group(),
              "ep": ps.get_expert_model_parallel_group(), "edp": ps.get_expert_data_parallel_group()}
    ranks = {k: dist.get_process_group_ranks(g) for k, g in groups.items()}
    ours = {k: next(r for r in v if rank in r) for k, v in dims.group_ranks().items()}
    if ranks != ours:
        raise ParallelConfigError("groups", f"megatron groups {ranks} differ from ParallelDims' {ours}")
    return ParallelGroups(dims, rank, ranks=ranks, **groups)
