"""Compose the parallelisms of a hybrid model in one ordered function (torchtitan's
``models/<family>/infra/parallelize.py`` pattern).

:func:`parallelize` applies, in this order:

0. :func:`~harts_runtime.parallel.context.apply_cp_rows` (with ``cp > 1``): every mixer
   head-parallel over the CP group (rows all-gathered in, partial rows reduce-scattered out), the
   embedding on this rank's row block (:mod:`harts_runtime.parallel.context`);
1. :func:`apply_tp`: every mixer and dense FFN a TP region from its plan
   (:mod:`harts_runtime.parallel.plans`, applied by :class:`~harts_runtime.parallel.tensor.TensorParallelRegion`),
   the embedding torch's ``RowwiseParallel`` over the vocabulary, the LM head a
   :class:`~harts_runtime.parallel.tensor.VocabParallelHead`, everything else (norms, MoE)
   :class:`~harts_runtime.parallel.tensor.ReplicatedParameters`; with sequence parallelism also the
   rows split between regions and every MoE's statistics summed over TP;
2. :func:`apply_ep`: every MoE's routed experts ``Shard(0)`` over the EP mesh dimension, its other
   parameters replicated there, and the all-to-all expert dispatch
   (:class:`~harts_runtime.parallel.expert.ExpertDispatch`);
3. :func:`apply_ac`: block recomputation (:func:`harts_runtime.recompute.apply_recompute`, the
   runtime's one switch; kept regions included);
4. :func:`apply_fsdp`: FSDP2 ``fully_shard`` on the embedding, every block, and the root (the final
   norm and the LM head), over ``dp_shard`` (``dp_shard x cp`` under CP; HSDP with
   ``dp_replicate``); under EP the MoE layers over their own mesh (``efsdp``, ``efsdp x cp``), as
   torchtitan does for MoE. Gradients are summed, not
   averaged (``set_gradient_divide_factor(1.0)``): every loss of the runtime is already normalised
   by step-level denominators (``harts_runtime.train``), so the sum over ranks is the step's gradient.

The model is any module whose blocks have ``.mixer`` and ``.ffn`` children
(``harts_runtime.models.HybridModel.blocks``), with ``.embed``, ``.norm`` and ``.lm_head``. Every
rank builds the same model (same seed or checkpoint) before calling :func:`parallelize`, which
distributes rank 0's values; parameter names never change, so state dicts and distributed
checkpoints are the same under any configuration. The single-process code never imports this
package; it only offers plain hooks that this package fills in (an LM head with
``mapped_logprobs``, ``CompactMoE.row_shard`` and ``CompactMoE.expert_dispatch``).

Not applied: ``torch.compile`` (torchtitan's optional step between recomputation and FSDP). Measured
on the CPU with the debug model: under block recomputation dynamo breaks the graph at the kept-region
context of the checkpointed forward and compiles nothing; without it, fake tensors reject the
float32 grouped GEMM the MoE runs eagerly. The heavy parts are Triton / CuTe kernels already.
Not yet: pipeline parallelism (``pp > 1`` is rejected by :class:`ParallelDims`; ``docs/parallel.md``).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel, parallelize_module

from harts_runtime.layers.moe import CompactMoE
from harts_runtime.parallel.context import apply_cp_head, apply_cp_rows
from harts_runtime.parallel.dims import ParallelConfigError, ParallelMesh
from harts_runtime.parallel.expert import ExpertDispatch
from harts_runtime.parallel.plans import Block, model_blocks, tp_plan
from harts_runtime.parallel.tensor import (
    ReplicatedParameters,
    SequenceParallelRows,
    TensorParallelRegion,
    VocabParallelHead,
)
from harts_runtime.recompute import apply_recompute

__all__ = ["apply_ac", "apply_cp_head", "apply_cp_rows", "apply_ep", "apply_fsdp", "apply_tp", "parallelize"]

_EXPERTS = ("w_gate", "w_up", "w_down")


def _moe(block: Block) -> CompactMoE | None:
    return block.ffn if isinstance(block.ffn, CompactMoE) else None


def apply_tp(model: nn.Module, mesh: ParallelMesh) -> None:
    """Tensor (and, with ``dims.sequence_parallel``, sequence) parallelism over the TP mesh, in place.

    Raises :class:`ParallelConfigError` naming the field when ``tp`` does not divide a layer's heads
    (or FFN width, or an MQA layer has several KV heads), or when a layer kind has no plan.
    """
    dims = mesh.dims
    sp, tp_mesh = dims.sequence_parallel, mesh.tp
    cp_mesh = mesh.cp if dims.cp > 1 else None
    blocks = model_blocks(model)
    ep = dims.ep > 1
    styles: dict[str, ParallelStyle] = {}
    for i, block in enumerate(blocks):
        if block.mixer is not None:  # None: a one-sublayer block (Nemotron-H's FFN layers)
            plan = tp_plan(block.mixer, dims.tp, f" (blocks[{i}].mixer)")
            if plan is None:
                raise ParallelConfigError(
                    f"blocks[{i}].mixer", f"no tensor-parallel plan for {type(block.mixer).__name__}"
                )
            styles[f"blocks.{i}.mixer"] = TensorParallelRegion(plan, sp, cp_mesh)
        for norm in ("norm1", "norm2"):
            if getattr(block, norm, None) is not None:
                styles[f"blocks.{i}.{norm}"] = ReplicatedParameters(partial_grad=sp)
        if block.ffn is None:
            continue
        moe = _moe(block)
        if moe is not None:
            if sp:
                moe.row_shard = SequenceParallelRows(tp_mesh)
            if not ep:  # under EP, apply_ep places the MoE's parameters on the expert mesh
                styles[f"blocks.{i}.ffn"] = ReplicatedParameters(partial_grad=sp)
            continue
        plan = tp_plan(block.ffn, dims.tp, f" (blocks[{i}].ffn)")
        if plan is None:
            raise ParallelConfigError(
                f"blocks[{i}].ffn", f"no tensor-parallel plan for {type(block.ffn).__name__}"
            )
        styles[f"blocks.{i}.ffn"] = TensorParallelRegion(plan, sp, cp_mesh)
    if not isinstance(model.embed, nn.Embedding) or not isinstance(model.lm_head, nn.Linear):
        raise ParallelConfigError(
            "model", "tensor parallelism needs an nn.Embedding .embed and an nn.Linear .lm_head"
        )
    styles["embed"] = RowwiseParallel(
        input_layouts=Replicate(), output_layouts=Shard(0) if sp else Replicate()
    )
    styles["norm"] = ReplicatedParameters(partial_grad=sp)
    styles["lm_head"] = VocabParallelHead(
        sp, backend=getattr(getattr(model, "config", None), "kda_backend", "auto")
    )
    parallelize_module(model, tp_mesh, styles)


def apply_ep(model: nn.Module, mesh: ParallelMesh) -> None:
    """Expert parallelism: each MoE's routed experts ``Shard(0)`` over the EP dimension (``Replicate``
    over TP), its router, shared experts and gate replicated; gradients ``Partial`` over EP for the
    replicated ones (each EP rank routed its own rows) and over TP under sequence parallelism.
    Raises :class:`ParallelConfigError` (``num_experts``) when ``ep`` does not divide the experts."""
    dims = mesh.dims
    spmd = mesh.expert_spmd()
    tp_grad = (Partial(),) if dims.sequence_parallel else (Replicate(),)
    tp_rep = (Replicate(),) if dims.tp > 1 else ()
    tp_grad = tp_grad if dims.tp > 1 else ()
    assert mesh.expert is not None  # expert_spmd() above checked it
    dispatch = ExpertDispatch(mesh.expert["ep"])
    for i, block in enumerate(model_blocks(model)):
        moe = _moe(block)
        if moe is None:
            continue
        e = moe.config.num_experts
        if e % dims.ep:
            raise ParallelConfigError(
                "num_experts", f"{e} is not divisible by ep={dims.ep} (blocks[{i}].ffn)"
            )
        names = [n for n, _ in moe.named_parameters()]
        placements = {n: ((Shard(0),) if n in _EXPERTS else (Replicate(),)) + tp_rep for n in names}
        grads = {n: ((Shard(0),) if n in _EXPERTS else (Partial(),)) + tp_grad for n in names}
        parallelize_module(moe, spmd, ReplicatedParameters(False, placements, grads))
        moe.expert_dispatch = dispatch


def apply_ac(model: nn.Module, keep: tuple[str, ...] = (), save_intermediates: bool = True) -> None:
    """Block recomputation (:func:`harts_runtime.recompute.apply_recompute`); ``keep`` names the
    op regions that keep their activations (``"attention"``, ``"linear_attention"``)."""
    apply_recompute(model, keep=keep, save_intermediates=save_intermediates)


def _fsdp_kwargs(mesh, param_dtype, reduce_dtype, cpu_offload, reshard_after_forward) -> dict[str, Any]:
    kw: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if param_dtype is not None or reduce_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    return kw


def apply_fsdp(
    model: nn.Module,
    mesh: ParallelMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
) -> None:
    """FSDP2 on the embedding, every block (under EP: each MoE on the expert mesh first), and the
    root (the final norm and the LM head, used by ``HybridModel.forward``'s log-probs); gradients
    summed (divide factor 1).

    ``param_dtype`` / ``reduce_dtype``: FSDP2's ``MixedPrecisionPolicy`` (e.g. bf16 parameters for
    compute with fp32 reduction; the sharded parameters, gradients and optimizer state keep the
    model's dtype). ``cpu_offload``: ``CPUOffloadPolicy`` (CUDA only: FSDP2 pins host memory).
    """
    dims = mesh.dims
    if cpu_offload and mesh.dense.device_type != "cuda":
        raise ParallelConfigError("cpu_offload", "FSDP2's CPUOffloadPolicy needs CUDA (it pins host memory)")
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    if len(dtypes) > 1:
        raise ParallelConfigError(
            "dtype",
            f"FSDP2 needs one parameter dtype per unit, the model has {sorted(map(str, dtypes))}; "
            "build it in float32 and pass param_dtype=torch.bfloat16 for bf16 compute",
        )
    kw = _fsdp_kwargs(mesh.fsdp(), param_dtype, reduce_dtype, cpu_offload, reshard_after_forward)
    fully_shard(model.get_submodule("embed"), **kw)
    for block in model_blocks(model):
        moe = _moe(block)
        if dims.ep > 1 and moe is not None:
            fully_shard(moe, **dict(kw, mesh=mesh.expert_fsdp()))
        fully_shard(cast(nn.Module, block), **kw)  # a block is a module (the Block view of it)
    fully_shard(model, **kw)  # the root: the final norm and the LM head
    if cpu_offload:  # the weights rest on the host; microbatches go to the mesh's device
        # torch's stub types Module.__setattr__'s value as Tensor | Module; any attribute is allowed.
        model._compute_device = torch.device("cuda", torch.cuda.current_device())  # pyright: ignore[reportArgumentType]
    cpu = mesh.dense.device_type == "cpu"
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            # every rank reduce-scatters every parameter, with a zero gradient where a backward did
            # not reach it (an empty padding microbatch), so the collectives always match; torch
            # releases before 2.12 lack the switch, and every parameter there must be reached
            if hasattr(m, "set_reduce_scatter_unused_params"):
                m.set_reduce_scatter_unused_params(True)
            if cpu:  # gloo has no PREMUL_SUM; a plain SUM is the same with factor 1
                m.set_force_sum_reduction_for_comms(True)


def parallelize(
    model: nn.Module,
    mesh: ParallelMesh,
    *,
    recompute: bool = False,
    keep: tuple[str, ...] = (),
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
    cp_mode: str = "auto",
    cp_capacity: int | None = None,
) -> nn.Module:
    """Apply TP, EP, recomputation and FSDP2 to ``model`` in place, in that order;
    returns it. ``mesh`` from :meth:`ParallelDims.build_mesh`; ``cp_mode`` (``"heads"``,
    ``"states"``, ``"auto"``) how CP runs each mixer (:func:`apply_cp_rows`; the choice per block is
    ``model._harts_cp_modes``; ``cp_capacity``, when given, the most rows a split may give one rank:
    the split balances cost, not rows, so a rank may hold more than ``ceil(N / C)``); the other
    options are those of :func:`apply_ac` (``recompute``,
    ``keep``) and :func:`apply_fsdp`.
    """
    if not isinstance(mesh, ParallelMesh):
        raise ParallelConfigError(
            "mesh", f"expected a ParallelMesh (ParallelDims.build_mesh()), got {type(mesh).__name__}"
        )
    if getattr(model, "_harts_parallel", None) is not None:
        raise ParallelConfigError("model", "is already parallelized")
    dims = mesh.dims
    model_blocks(model)
    if dims.cp > 1:
        apply_cp_rows(model, mesh, cp_mode, recompute=recompute, capacity=cp_capacity)
    if dims.tp > 1:
        apply_tp(model, mesh)
    if dims.cp > 1:
        apply_cp_head(model, mesh, getattr(getattr(model, "config", None), "kda_backend", "auto"))
    if dims.ep > 1:
        apply_ep(model, mesh)
    if recompute:
        apply_ac(model, keep)
    apply_fsdp(
        model,
        mesh,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        cpu_offload=cpu_offload,
        reshard_after_forward=reshard_after_forward,
    )
    # torch's stub types Module.__setattr__'s value as Tensor | Module; any attribute is allowed.
    model._harts_parallel = dims  # pyright: ignore[reportArgumentType]
    return model
