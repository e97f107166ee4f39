"""Data parallelism driven by the step plan (paper Sections 2.4 and 3.2).

The step plan assigns every microbatch ``M`` a DP replica ``replica[M]`` and a slot ``slot[M]``. A
rank executes its replica's microbatches slot by slot (:func:`replica_schedule`); the TP ranks of
a replica run the same microbatch. Every rank of an FSDP or EP group must run the same number of
forwards and backwards (each one issues the same per-layer all-gathers, reduce-scatters and
all-to-alls), so every rank runs :func:`step_slots` slots, the most any replica has, and a replica
with fewer microbatches runs an *empty microbatch* (no trajectories, zero rows: every layer still
issues its collectives, every parameter gets a zero gradient) in each missing slot. Nothing is
exchanged to agree on the count: every rank reads it from the same plan.

Exactness: the microbatch callable returns a loss already normalised by step-level denominators
(``harts_runtime.train``), so the step loss is the plain sum of microbatch losses in any grouping.
FSDP2 sums the gradients of every backward over the DP group (``apply_fsdp`` sets the divide factor
to 1) into the sharded gradients, and the step's losses are summed over the replicas here; the
result equals one process running the whole step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from harts_runtime.parallel.dims import ParallelConfigError

__all__ = [
    "ReplicaStepResult",
    "rank_schedule",
    "replica_schedule",
    "run_replica_step",
    "step_slots",
    "sync_expert_load",
]

EMPTY = np.zeros(0, dtype=np.int64)
"""The trajectories of an empty (padding) microbatch."""


def _assignments(plan):
    replica = np.asarray(plan.replica, dtype=np.int64)
    slot = np.asarray(plan.slot, dtype=np.int64)
    if len(replica) != len(plan.microbatches) or len(slot) != len(replica):
        raise ParallelConfigError("plan", "replica, slot and microbatches differ in length")
    return replica, slot


def replica_schedule(plan, replica: int) -> list[np.ndarray]:
    """Trajectory indices of replica ``replica``'s non-empty microbatches, in slot order.

    ``plan``: a :class:`harts_planner.StepPlan` or any object with ``dp_size``, ``microbatches``,
    ``replica`` and ``slot``. Raises :class:`ParallelConfigError` (``field="replica"``) for a replica
    outside the plan.
    """
    if not 0 <= replica < plan.dp_size:
        raise ParallelConfigError("replica", f"{replica} is outside the plan's [0, {plan.dp_size})")
    rep, slot = _assignments(plan)
    mine = np.nonzero(rep == replica)[0]
    mine = mine[np.argsort(slot[mine], kind="stable")]
    out = [np.asarray(plan.microbatches[m], dtype=np.int64) for m in mine.tolist()]
    return [m for m in out if m.size]


def rank_schedule(plan, mesh) -> list[np.ndarray]:
    """The non-empty microbatches this rank runs, in order: its replica's in slot order
    (:func:`replica_schedule`, ``plan.dp_size`` must equal the mesh's DP degree), or without a mesh
    (one process holding the whole step) every microbatch of the plan, whatever replica it was
    planned for, in the plan's order."""
    if mesh is None:
        out = [np.asarray(m, dtype=np.int64) for m in plan.microbatches]
        return [m for m in out if m.size]
    if plan.dp_size != mesh.dims.dp:
        raise ParallelConfigError(
            "plan", f"dp_size {plan.dp_size} != dp_replicate * dp_shard = {mesh.dims.dp}"
        )
    return replica_schedule(plan, mesh.replica)


def step_slots(plan) -> int:
    """Slots every rank runs: the most non-empty microbatches of any replica."""
    return max((len(replica_schedule(plan, r)) for r in range(plan.dp_size)), default=0)


@dataclass
class ReplicaStepResult:
    """What one rank did in :func:`run_replica_step`."""

    loss: float
    """The step loss: the sum of every replica's microbatch losses (equal on all ranks)."""
    local_loss: float
    """This replica's share (the sum over its slots)."""
    padded_slots: int = 0
    """Slots this rank ran an empty microbatch in."""
    slot_seconds: list[float] = field(default_factory=list)
    """Wall time of each slot on this rank (forward + backward, gradient reduction included)."""


def run_replica_step(
    plan,
    mesh,
    microbatch_fn: Callable[[int, np.ndarray], torch.Tensor | float],
) -> ReplicaStepResult:
    """The step loop: run this rank's replica's microbatches slot by slot, padding with empty
    microbatches, and sum the step loss over the replicas. :meth:`HartsEngine.forward_backward
    <harts_runtime.engine.HartsEngine.forward_backward>` is its caller.

    Parameters
    ----------
    plan : harts_planner.StepPlan
        With ``plan.dp_size`` equal to ``mesh.dims.dp`` (any without a mesh).
    mesh : ParallelMesh or None
        This job's meshes (:meth:`ParallelDims.build_mesh`); None for one process holding the whole
        step, which runs every microbatch of the plan (:func:`rank_schedule`), without padding or
        collectives.
    microbatch_fn : callable ``(slot, trajectory_indices) -> loss``
        Runs one microbatch's forward and backward (e.g. ``harts_runtime.run_microbatch``, which
        backpropagates) and returns its detached loss contribution; called with an empty index
        array for a padding slot.

    Returns
    -------
    ReplicaStepResult
    """
    dp = 1 if mesh is None else mesh.dims.dp
    schedule = rank_schedule(plan, mesh)
    slots = len(schedule) if mesh is None else step_slots(plan)
    local, seconds = 0.0, []
    for j in range(slots):
        t0 = time.perf_counter()
        loss = microbatch_fn(j, schedule[j] if j < len(schedule) else EMPTY)
        local += float(loss.detach()) if torch.is_tensor(loss) else float(loss)
        seconds.append(time.perf_counter() - t0)
    total = local
    if mesh is not None and dp > 1:  # dp > 1 only with a mesh
        group = mesh.dp.get_group()
        t = torch.tensor([local], dtype=torch.float64, device=_device(group))
        dist.all_reduce(t, group=group)
        total = float(t.item())
    return ReplicaStepResult(total, local, slots - len(schedule), seconds)


def _device(group) -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else torch.device("cpu")
    )


@torch.no_grad()
def sync_expert_load(model: torch.nn.Module, mesh) -> None:
    """Sum every MoE layer's multiplicity-weighted expert-load counts (``local_tokens_per_expert``)
    over the ranks that routed different rows: the DP group, the CP group (each CP rank routed its
    row block) and the TP group under sequence parallelism (each TP rank routed its row block). Call once per step, before
    ``model.update_expert_bias()``; afterwards every rank holds the step's counts, exactly those of
    one process running the whole step (Section 3.5)."""
    dims = mesh.dims
    groups = []
    if dims.dp > 1:
        groups.append(mesh.dp.get_group())
    if dims.cp > 1:
        groups.append(mesh.cp.get_group())
    if dims.sequence_parallel:
        groups.append(mesh.tp.get_group())
    if not groups:
        return
    for m in model.modules():
        buf = getattr(m, "local_tokens_per_expert", None)
        if buf is None:
            continue
        for g in groups:
            dist.all_reduce(buf, group=g)
