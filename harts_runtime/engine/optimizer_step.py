"""The optimizer step of a training job (:func:`optimizer_step`): the global gradient norm over every
rank's shards (:func:`grad_norm`), clipping, the optimizer and its LR schedule, the MoE expert-bias
update, and what it did (:class:`StepReport`). :meth:`HartsEngine.optimizer_step
<harts_runtime.engine.HartsEngine.optimizer_step>` calls it with the engine's parts."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch

__all__ = ["StepReport", "grad_norm", "optimizer_step"]


@dataclass
class StepReport:
    """What :meth:`HartsEngine.optimizer_step <harts_runtime.engine.HartsEngine.optimizer_step>` did."""

    step: int
    """Optimizer steps taken so far (not counting skipped ones)."""
    grad_norm: float
    """The global gradient norm before clipping (over every rank's shards)."""
    lr: float
    skipped: bool = False
    reason: str = ""


def grad_norm(model) -> float:
    """The global L2 norm of ``model``'s accumulated gradients over every rank's shards (DTensor
    gradients are grouped by mesh: dense and expert parameters live on different meshes)."""
    from torch.distributed.tensor import DTensor

    groups: dict = defaultdict(list)
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad
            groups[id(g.device_mesh) if isinstance(g, DTensor) else None].append(g)
    sq = 0.0
    for gs in groups.values():
        n = torch.nn.utils.get_total_norm(gs, 2.0, error_if_nonfinite=False, foreach=True)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        sq += float(n) ** 2
    return math.sqrt(sq)


def optimizer_step(model, optimizer, scheduler, mesh, max_grad_norm: float | None, step: int) -> StepReport:
    """Clip ``model``'s gradients to ``max_grad_norm`` (None: no clipping), step ``optimizer`` and
    ``scheduler`` (None: an external schedule), update the MoE expert biases (their
    multiplicity-weighted counts summed over ``mesh``'s ranks first), zero the gradients; ``step``:
    the optimizer steps taken before. When the gradient norm is not finite the step is skipped, the
    gradients and expert-load counts dropped, and the report says so."""
    norm = grad_norm(model)
    lr = optimizer.param_groups[0]["lr"]
    clip = max_grad_norm
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        for m in model.modules():
            if hasattr(m, "local_tokens_per_expert"):
                m.get_buffer("local_tokens_per_expert").zero_()
        return StepReport(step, norm, lr, True, f"non-finite gradient norm {norm}; step skipped")
    if clip is not None and norm > clip:
        coef = clip / (norm + 1e-6)
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    if mesh is not None:
        from harts_runtime.parallel import sync_expert_load

        sync_expert_load(model, mesh)
    model.update_expert_bias()
    for moe in model.moe_layers():  # per-step counts (update_expert_bias resets them only with a bias)
        moe.get_buffer("local_tokens_per_expert").zero_()
    optimizer.zero_grad(set_to_none=True)
    return StepReport(step + 1, norm, lr)
