"""Data parallelism driven by the step plan (paper Sections 2.4 and 3.2).

The step plan assigns every microbatch ``M`` a DP replica ``replica[M]`` and a slot ``slot[M]``; each
replica has exactly ``K / D`` non-empty microbatches, one per slot. A rank executes its replica's
microbatches slot by slot, ``j = 0 .. K/D - 1``, so every collective inside a microbatch (TP, EP) is
issued the same number of times, in the same order, on every replica. Gradients accumulate locally
across slots and are summed across replicas once at the end of the step.

Exactness: the microbatch callable returns a loss already normalised by *step-level* denominators
(e.g. the number of action tokens of the whole step, not of the microbatch), so the step loss is the
plain sum of microbatch losses in any grouping, and the all-reduce is a SUM, never a mean. That is
why this module does not wrap the model in ``torch.nn.parallel.DistributedDataParallel`` (which
averages over ranks and hooks one forward per backward) nor in megatron-core's DDP (which needs its
``TransformerConfig``/param-and-grad buffers and scales by the DP size unless configured for
per-token losses; on GPU it would add bucketed overlap, a planned optimisation). A coalesced SUM of
flattened gradients at the end of the step is exact, backend-agnostic and easy to check.

Parameter classes, set by :mod:`harts_runtime.parallel.parallelize` as attributes on parameters:

* default: replicated on every DP replica -> gradient summed over the DP group;
* ``param._harts_expert = True``: an expert shard (EP) -> summed over the expert-DP group;
* ``param._harts_tp_partial = True``: replicated over TP but each TP rank produces a partial gradient
  (a replicated weight inside a TP region, or any weight acting on sequence-parallel rows) ->
  additionally summed over the TP group.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from harts_runtime.parallel.dims import ParallelConfigError

__all__ = [
    "ReplicaStepResult",
    "allreduce_gradients",
    "replica_schedule",
    "run_replica_step",
    "sync_expert_load",
]


def replica_schedule(plan, replica: int) -> list[np.ndarray]:
    """Trajectory indices of replica ``replica``'s microbatches, in slot order (``K / D`` of them).

    Raises :class:`ParallelConfigError` (``field="replica"``) for a replica outside the plan and
    (``field="plan"``) if a slot is empty, which would desynchronise the collectives of a slot.
    """
    if not 0 <= replica < plan.dp_size:
        raise ParallelConfigError("replica", f"{replica} is outside the plan's [0, {plan.dp_size})")
    out = []
    for j in range(plan.num_slots):
        members = np.asarray(plan.microbatch_at(replica, j))
        if members.size == 0:
            raise ParallelConfigError(
                "plan",
                f"microbatch (replica={replica}, slot={j}) is empty; every "
                "replica needs the same number of non-empty microbatches",
            )
        out.append(members)
    return out


@dataclass
class ReplicaStepResult:
    """What one rank did in :func:`run_replica_step`."""

    loss: float
    """The step loss: sum of every replica's microbatch losses (all-reduced; equal on all ranks)."""
    local_loss: float
    """This replica's share (sum over its slots)."""
    slot_seconds: list[float] = field(default_factory=list)
    """Wall time of each slot on this rank (forward + backward)."""
    sync_seconds: float = 0.0
    """Time of the gradient all-reduce."""


def run_replica_step(
    plan,
    replica: int,
    microbatch_fn: Callable[[int, np.ndarray], torch.Tensor],
    *,
    params: Iterable[torch.nn.Parameter] | None = None,
    groups=None,
    backward: bool = True,
) -> ReplicaStepResult:
    """Execute replica ``replica``'s microbatches slot by slot, then synchronise gradients.

    Parameters
    ----------
    plan : harts_planner.StepPlan
        With ``plan.dp_size`` equal to the DP degree.
    replica : int
        This rank's DP replica (``ParallelGroups.dp_rank``).
    microbatch_fn : callable ``(slot, trajectory_indices) -> loss``
        Runs one microbatch; returns a scalar loss tensor normalised by step-level denominators.
        When ``backward`` is True the executor calls ``loss.backward()``; otherwise ``microbatch_fn``
        must have run backward itself and may return a float or a detached tensor.
    params : iterable of Parameters, optional
        Whose gradients to all-reduce (None: no gradient synchronisation, e.g. world size 1).
    groups : ParallelGroups, optional
        Process groups; required with ``params``. Without groups and with an initialised default
        group, the loss is summed over the default group.

    Returns
    -------
    ReplicaStepResult
    """
    schedule = replica_schedule(plan, replica)
    local = 0.0
    slot_seconds = []
    for j, members in enumerate(schedule):
        t0 = time.perf_counter()
        loss = microbatch_fn(j, members)
        if backward:
            loss.backward()
        local += float(loss.detach()) if torch.is_tensor(loss) else float(loss)
        slot_seconds.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    if params is not None:
        if groups is None:
            raise ParallelConfigError("groups", "needed to all-reduce gradients")
        allreduce_gradients(params, groups)
    total = local
    if dist.is_available() and dist.is_initialized():
        group = groups.dp if groups is not None else None
        t = torch.tensor([local], dtype=torch.float64)
        if dist.get_backend(group) == "nccl":
            t = t.cuda()
        dist.all_reduce(t, group=group)
        total = float(t.item())
    return ReplicaStepResult(total, local, slot_seconds, time.perf_counter() - t0)


def _sum_flat(grads: list[torch.Tensor], group, bucket_bytes: int) -> None:
    """All-reduce (SUM) a list of same-dtype, same-device gradients through flat buckets."""
    bucket: list[torch.Tensor] = []
    size = 0

    def flush():
        if not bucket:
            return
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        off = 0
        for g in bucket:
            g.copy_(flat[off : off + g.numel()].view_as(g))
            off += g.numel()
        bucket.clear()

    for g in grads:
        bucket.append(g)
        size += g.numel() * g.element_size()
        if size >= bucket_bytes:
            flush()
            size = 0
    flush()


def allreduce_gradients(
    params: Iterable[torch.nn.Parameter], groups, *, bucket_bytes: int = 64 << 20
) -> None:
    """Sum gradients over DP (dense), expert-DP (EP shards) and, for TP-partial weights, TP.

    Parameters without a gradient get a zero gradient first, so every rank issues the same
    collectives even if a parameter was unused on one replica (e.g. an expert no row selected).
    """
    plist = [p for p in params if p.requires_grad]
    for p in plist:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_group: dict[tuple, list[torch.Tensor]] = {}
    for p in plist:
        kind = "edp" if getattr(p, "_harts_expert", False) else "dp"
        by_group.setdefault((kind, p.grad.dtype, p.grad.device), []).append(p.grad)
        if getattr(p, "_harts_tp_partial", False) and groups.dims.tp > 1:
            by_group.setdefault(("tp", p.grad.dtype, p.grad.device), []).append(p.grad)
    # TP partial sums first (within a replica), then across replicas; sums commute, order is fixed
    # so every rank issues identical collectives.
    for kind in ("tp", "dp", "edp"):
        size = {"tp": groups.dims.tp, "dp": groups.dims.dp, "edp": groups.dims.dp // groups.dims.ep}[kind]
        if size == 1:
            continue
        for (k, _dtype, _dev), grads in sorted(by_group.items(), key=lambda kv: str(kv[0])):
            if k == kind:
                _sum_flat(grads, getattr(groups, kind), bucket_bytes)


def sync_expert_load(modules: Iterable[torch.nn.Module], groups) -> None:
    """Sum every MoE layer's ``local_tokens_per_expert`` over the DP group (before the expert-bias
    update), so each replica applies the same update computed from the whole step's weighted
    counts. Under sequence parallelism the counts are partial per TP rank and also summed over TP.
    """
    for m in modules:
        buf = getattr(m, "local_tokens_per_expert", None)
        if buf is None:
            continue
        if groups.dims.dp > 1:
            dist.all_reduce(buf, group=groups.dp)
        if groups.dims.sequence_parallel:
            dist.all_reduce(buf, group=groups.tp)
