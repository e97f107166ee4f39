"""Parallel training on torch.distributed: FSDP2, DTensor tensor / sequence parallelism, expert
parallelism, DP replicas from the step plan, distributed checkpoints.

Nothing in the single-process path imports this package. Entry points::

    dims = ParallelDims(dp_shard=2, tp=2, ep=2, world_size=4, sequence_parallel=True)
    mesh = dims.build_mesh()
    parallelize(model, mesh, recompute=True)          # TP -> EP -> AC -> FSDP2
    calls = lambda traj: microbatch_call_plan(model, step, traj)   # harts_runtime.engine plans
    result = run_replica_step(plan, mesh, lambda slot, traj: run_microbatch(model, step, traj, call_plan=calls(traj))[0])
    sync_expert_load(model, mesh)                      # before model.update_expert_bias()
    save_checkpoint(path, model, optimizer, extra={"step": 1})   # DCP; loads under any other config
    load_checkpoint(path, model, optimizer)
    model = load_pretrained(hf_folder, mesh=mesh)      # harts_runtime.load_pretrained: each rank its slices
    save_pretrained(model, out_folder)                 # harts_runtime.save_pretrained: collective
"""

from harts_runtime.parallel.checkpoint import load_checkpoint, save_checkpoint
from harts_runtime.parallel.data import (
    ReplicaStepResult,
    replica_schedule,
    run_replica_step,
    step_slots,
    sync_expert_load,
)
from harts_runtime.parallel.dims import ParallelConfigError, ParallelDims, ParallelMesh
from harts_runtime.parallel.expert import ExpertDispatch
from harts_runtime.parallel.launch import run_distributed
from harts_runtime.parallel.parallelize import (
    apply_ac,
    apply_ep,
    apply_fsdp,
    apply_tp,
    parallelize,
)
from harts_runtime.parallel.plans import TP_PLANS, LayerPlan, tp_plan
from harts_runtime.parallel.tensor import (
    ReplicatedParameters,
    SequenceParallelRows,
    TensorParallelRegion,
    VocabParallelHead,
    row_block,
)

__all__ = [
    "TP_PLANS",
    "ExpertDispatch",
    "LayerPlan",
    "ParallelConfigError",
    "ParallelDims",
    "ParallelMesh",
    "ReplicaStepResult",
    "ReplicatedParameters",
    "SequenceParallelRows",
    "TensorParallelRegion",
    "VocabParallelHead",
    "apply_ac",
    "apply_ep",
    "apply_fsdp",
    "apply_tp",
    "load_checkpoint",
    "parallelize",
    "replica_schedule",
    "row_block",
    "run_distributed",
    "run_replica_step",
    "save_checkpoint",
    "step_slots",
    "sync_expert_load",
    "tp_plan",
]
