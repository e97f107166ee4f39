"""Compose the parallelisms of a hybrid model in one ordered function (torchtitan style).

:func:`parallelize` applies, in this order:

1. :func:`apply_tp`: shard every mixer (GQA/MHA, MLA, KDA) and dense SwiGLU FFN over the TP group
   (:mod:`harts_runtime.parallel.tensor`), and the embedding and LM head over the vocabulary
   (:mod:`harts_runtime.parallel.vocab`); with sequence parallelism also split the rows between
   regions (embedding reduce-scatter, LM-head all-gather, MoE multiplicity slice and TP-summed router
   statistics); MoE layers stay replicated over TP (or go to EP);
2. :func:`apply_ep`: replace every :class:`CompactMoE` by an :class:`ExpertParallelMoE` holding
   ``num_experts / ep`` experts (:mod:`harts_runtime.parallel.expert`);
3. :func:`apply_dp`: make the replicas identical (broadcast from DP rank 0 of each group) and tag the
   parameters for :func:`harts_runtime.parallel.data.allreduce_gradients`; the step itself is run by
   :func:`harts_runtime.parallel.data.run_replica_step` over the step plan;
4. :func:`~harts_runtime.recompute.apply_recompute` (optional): full-block activation recomputation
   with ``torch.utils.checkpoint`` (non-reentrant), the runtime's one recomputation switch.

The model is any module whose blocks have ``.mixer`` and ``.ffn`` children
(``harts_runtime.models.HybridModel.blocks``); layers are recognised by type. The single-process code never imports this
package: it only offers two plain hooks that the parallel path fills in (an LM head with
``mapped_logprobs``, used by ``HybridModel.logprobs``, and ``CompactMoE.row_shard``).

Why not megatron-core's recomputation (``tensor_parallel.checkpoint``): it is reentrant and restores
CUDA RNG tracker state; our layers have no dropout, so there is no RNG state to restore, and the
non-reentrant torch checkpoint re-issues the same TP/EP collectives in the same order on every rank
during backward. The megatron-core parts that fit are optional: process groups can come from
``megatron.core.parallel_state`` (:func:`megatron_groups`) on the GPU machine.

Not yet built (see ``docs/parallel.md``): pipeline parallelism (``pp > 1`` is rejected by
:class:`ParallelDims`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from harts_runtime.layers.moe import CompactMoE
from harts_runtime.parallel.dims import ParallelConfigError, ParallelDims, ParallelGroups
from harts_runtime.parallel.expert import ExpertParallelMoE
from harts_runtime.parallel.tensor import SequenceParallelRows, _is_swiglu, tensor_parallel_layer
from harts_runtime.parallel.vocab import VocabParallelEmbedding, VocabParallelLMHead
from harts_runtime.recompute import apply_recompute

__all__ = ["apply_dp", "apply_ep", "apply_recompute", "apply_tp", "megatron_groups", "parallelize"]


def _blocks(model: nn.Module) -> list[nn.Module]:
    blocks = [m for m in model.modules() if hasattr(m, "mixer") and hasattr(m, "ffn")]
    if not blocks:
        raise ParallelConfigError("model", f"{type(model).__name__} has no blocks with .mixer and .ffn")
    return blocks


def apply_tp(model: nn.Module, groups: ParallelGroups) -> None:
    """Tensor (and, with ``dims.sequence_parallel``, sequence) parallelism over ``groups.tp``, in place.

    * every mixer and dense SwiGLU FFN becomes a TP region (:func:`tensor_parallel_layer`);
    * ``model.embed`` (``nn.Embedding``) becomes a :class:`VocabParallelEmbedding` and ``model.lm_head``
      (bias-free ``nn.Linear``) a :class:`VocabParallelLMHead`: both hold ``V / tp`` vocabulary rows, and
      the model's fused chunked log-probs reduce only per-row max / sum-exp and one target logit per
      semantic position over TP (Section 3.5);
    * sequence parallelism additionally: the embedding reduce-scatters its rows (each TP rank keeps its
      :func:`row_split` block), the LM head all-gathers them back, every MoE layer gets a
      :class:`SequenceParallelRows` (multiplicity slice + TP-summed router statistics), and every
      parameter that acts on the local row block outside a region (norms, router, experts) is tagged
      ``_harts_tp_partial`` so its gradient is summed over TP.

    MoE layers stay replicated over TP (or go to EP, :func:`apply_ep`).
    """
    dims = groups.dims
    sp = dims.sequence_parallel
    blocks = _blocks(model)
    embed, head = getattr(model, "embed", None), getattr(model, "lm_head", None)
    if sp and not (isinstance(embed, nn.Embedding) and isinstance(head, nn.Linear)):
        raise ParallelConfigError(
            "sequence_parallel",
            f"needs a model whose .embed is an nn.Embedding and "
            f".lm_head an nn.Linear (rows are split at the embedding and "
            f"gathered at the LM head); {type(model).__name__} has not",
        )
    for i, block in enumerate(blocks):
        tensor_parallel_layer(block.mixer, groups.tp, groups.tp_rank, dims.tp, sequence_parallel=sp)
        if _is_swiglu(block.ffn):
            tensor_parallel_layer(block.ffn, groups.tp, groups.tp_rank, dims.tp, sequence_parallel=sp)
        elif isinstance(block.ffn, CompactMoE):
            if sp:
                block.ffn.row_shard = SequenceParallelRows(groups.tp, groups.tp_rank, dims.tp)
        elif sp:
            raise ParallelConfigError(
                f"blocks[{i}].ffn", f"no sequence-parallel plan for {type(block.ffn).__name__}"
            )
    if isinstance(embed, nn.Embedding):
        model.embed = VocabParallelEmbedding.from_dense(embed, groups.tp, groups.tp_rank, dims.tp, sp)
    if isinstance(head, nn.Linear):
        model.lm_head = VocabParallelLMHead.from_dense(head, groups.tp, groups.tp_rank, dims.tp, sp)
    if sp:
        in_region = set()
        for m in model.modules():
            if hasattr(m, "_harts_tp") or isinstance(m, (VocabParallelEmbedding, VocabParallelLMHead)):
                in_region.update(id(p) for p in m.parameters())
        for p in model.parameters():
            if id(p) not in in_region:
                p._harts_tp_partial = True


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
    for _name, t in list(model.named_parameters()) + list(model.named_buffers()):
        expert = getattr(t, "_harts_expert", False)
        kind, size = ("edp", dims.dp // dims.ep) if expert else ("dp", dims.dp)
        if size > 1:
            dist.broadcast(t.data, src=groups.ranks[kind][0], group=getattr(groups, kind))


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    groups: ParallelGroups,
    *,
    recompute: bool = False,
    keep: tuple[str, ...] = (),
) -> nn.Module:
    """Apply TP, EP, DP (and recomputation) to ``model`` in place, in that order; returns it.
    ``keep``: the op regions recomputation keeps (:func:`~harts_runtime.recompute.apply_recompute`).

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
        apply_recompute(model, keep=keep)
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
        ps.initialize_model_parallel(
            tensor_model_parallel_size=dims.tp,
            pipeline_model_parallel_size=dims.pp,
            expert_model_parallel_size=dims.ep,
        )
    rank = dist.get_rank()
    groups = {
        "dp": ps.get_data_parallel_group(),
        "tp": ps.get_tensor_model_parallel_group(),
        "ep": ps.get_expert_model_parallel_group(),
        "edp": ps.get_expert_data_parallel_group(),
    }
    ranks = {k: dist.get_process_group_ranks(g) for k, g in groups.items()}
    ours = {k: next(r for r in v if rank in r) for k, v in dims.group_ranks().items()}
    if ranks != ours:
        raise ParallelConfigError("groups", f"megatron groups {ranks} differ from ParallelDims' {ours}")
    return ParallelGroups(dims, rank, ranks=ranks, **groups)
