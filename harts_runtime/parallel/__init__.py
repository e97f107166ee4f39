"""Parallel training: DP replicas from the step plan, TP/SP (vocabulary-parallel embedding and fused
LM-head log-probs included), EP.

Nothing in the single-process path imports this package; megatron-core (optional extra
``megatron``) is imported only by :func:`megatron_groups`.

Entry points::

    dims = ParallelDims(dp=2, tp=1, ep=2, world_size=2)
    groups = dims.build_groups()
    parallelize(model, dims, groups, recompute=True)
    result = run_replica_step(plan, groups.dp_rank, microbatch_fn, params=model.parameters(), groups=groups)
"""

from harts_runtime.parallel.data import (
    ReplicaStepResult,
    allreduce_gradients,
    replica_schedule,
    run_replica_step,
    sync_expert_load,
)
from harts_runtime.parallel.dims import ParallelConfigError, ParallelDims, ParallelGroups
from harts_runtime.parallel.expert import ExpertParallelMoE
from harts_runtime.parallel.launch import run_distributed
from harts_runtime.parallel.parallelize import (
    apply_dp,
    apply_ep,
    apply_recompute,
    apply_tp,
    megatron_groups,
    parallelize,
)
from harts_runtime.parallel.tensor import SequenceParallelRows, tensor_parallel_layer
from harts_runtime.parallel.vocab import (
    VocabParallelEmbedding,
    VocabParallelLMHead,
    vocab_parallel_logprobs,
    vocab_range,
)

__all__ = [
    "ExpertParallelMoE",
    "ParallelConfigError",
    "ParallelDims",
    "ParallelGroups",
    "ReplicaStepResult",
    "SequenceParallelRows",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "allreduce_gradients",
    "apply_dp",
    "apply_ep",
    "apply_recompute",
    "apply_tp",
    "megatron_groups",
    "parallelize",
    "replica_schedule",
    "run_distributed",
    "run_replica_step",
    "sync_expert_load",
    "tensor_parallel_layer",
    "vocab_parallel_logprobs",
    "vocab_range",
]
