"""The head slices of head-parallel context parallelism: which block of each mixer parameter a CP
rank holds (:func:`cp_plan`), read from the layer's TP plan. Apart from
:mod:`harts_runtime.parallel.context` so that the states mode's chooser
(:mod:`harts_runtime.parallel.context_states`) can ask whether heads mode can run a layer without
importing the heads-mode runtime."""

from __future__ import annotations

from torch import nn

from harts_runtime.errors import ParallelConfigError
from harts_runtime.layers.attention import CompactAttention
from harts_runtime.layers.gated_attention import CompactGatedAttention
from harts_runtime.parallel.plans import COL, tp_plan

__all__ = ["GROUP", "cp_plan"]

GROUP = "group"
"""A CP slice of a GQA layer's key/value projection when the ranks outnumber its (local) KV heads:
each rank takes the one KV head its query heads read."""


def cp_plan(layer: nn.Module, tp: int, cp: int, where: str = "") -> dict[str, object]:
    """How each parameter of mixer ``layer`` is sliced between the CP ranks: name -> ``COL`` (a block
    of rows / channels / per-head entries), ``ROW`` (a block of input columns of the output
    projection), ``REP`` (whole) or :data:`GROUP`. Read from the layer's TP plan
    (:mod:`harts_runtime.parallel.plans`), whose head blocks are the same; the TP plan is checked at
    ``tp``. Raises :class:`ParallelConfigError` naming the field when ``tp * cp`` does not divide
    the heads, or the layer has no head-parallel plan."""
    plan = tp_plan(layer, tp, where)
    if plan is None:
        raise ParallelConfigError(
            "cp",
            f"{type(layer).__name__}{where} has no head-parallel plan; context parallelism splits "
            "every mixer's heads between the CP ranks",
        )
    for field, value in plan.divides:
        if value % (tp * cp):
            raise ParallelConfigError(
                field,
                f"{value} is not divisible by tp * cp = {tp} * {cp}{where} (context parallelism splits "
                "each mixer's heads between the CP ranks: C is capped by the head count)",
            )
    out: dict[str, object] = dict(plan.placements)
    if isinstance(layer, (CompactAttention, CompactGatedAttention)):
        kv = layer.config.num_kv_heads or layer.config.num_heads  # resolved by the config already
        local_kv = kv // tp if kv % tp == 0 else kv  # a replicated single KV head under TP
        if out.get("k_proj.weight") == COL or local_kv == 1:
            if local_kv % cp:
                if cp % local_kv:
                    raise ParallelConfigError(
                        "num_kv_heads",
                        f"{kv} KV heads over tp * cp = {tp} * {cp}{where}: the CP degree must divide "
                        "the local KV heads or be a multiple of them",
                    )
                for name in list(out):
                    if name.split(".")[0] in ("k_proj", "v_proj"):
                        out[name] = GROUP
    return out
