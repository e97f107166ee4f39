"""Tensor-parallel plans, declared as data: for every layer kind, the placement of each of its
parameters over the TP mesh (paper Section 4.3).

A *TP region* is a layer whose inner computation is split by heads (attention, gated attention,
MLA, KDA, Gated DeltaNet, Mamba2 by groups of heads) or by the intermediate width (dense SwiGLU
and relu2 FFNs). Its plan maps every parameter, by its name inside the layer, to one DTensor
placement over the TP mesh:

==============  =================================================================================
placement       meaning
==============  =================================================================================
``Shard(0)``    column-parallel: the rows of a projection (``[out, in]``), a convolution's channels
                or a per-head vector, one contiguous block of heads per rank
``Shard(1)``    row-parallel: the input columns of the output projection; its output is a partial
                sum over the ranks' heads
``Replicate()`` the same on every rank (latent down-projections and their norms, per-head-dim
                norms, an MQA layer's single key/value head); each rank's gradient is partial (it
                only sees its own heads downstream) and is summed over TP
==============  =================================================================================

Each plan also names the config fields whose values the TP degree must divide (``divides``): the
heads of a plan are contiguous row blocks only in multiples of those (Mamba2: ``n_groups``).
Layers infer their head counts from the local weights they are given, so a plan never rewrites a
layer's config.

:data:`TP_PLANS` maps a layer class to its plan function ``plan(layer, tp) -> LayerPlan``; a plan
depends on the layer only where the model does (MLA with or without a query latent, MQA versus
GQA, fused versus split Gated DeltaNet projections, Mamba2's optional biases).
:mod:`harts_runtime.parallel.tensor` applies them. A layer whose fused projection is no single
placement keeps its blocks as separate parameters (Gated DeltaNet's q, k, v; Mamba2's ``in_proj``
blocks), and its state-dict adapter maps transformers' fused tensor both ways.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast

from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard

from harts_runtime.errors import ParallelConfigError
from harts_runtime.layers.attention import CompactAttention
from harts_runtime.layers.ffn import DenseFFN
from harts_runtime.layers.gated_attention import CompactGatedAttention
from harts_runtime.layers.gdn import CompactGatedDeltaNet
from harts_runtime.layers.kda import KDALayer
from harts_runtime.layers.mamba2 import Mamba2Mixer
from harts_runtime.layers.mla import CompactMLA
from harts_runtime.layers.relu2_mlp import Relu2MLP

__all__ = ["TP_PLANS", "LayerPlan", "tp_plan"]

COL, ROW, REP = Shard(0), Shard(1), Replicate()


@dataclass(frozen=True)
class LayerPlan:
    """The TP plan of one layer: ``placements[name]`` for every parameter (names inside the layer)
    and the ``(config field, value)`` pairs the TP degree must divide."""

    placements: Mapping[str, Placement]
    divides: tuple[tuple[str, int], ...]

    def check(self, layer: nn.Module, tp: int, where: str = "") -> None:
        """Raise :class:`ParallelConfigError` naming the field when ``tp`` does not divide it, or
        when the plan and the layer's parameters differ (a plan must place every parameter)."""
        for field, value in self.divides:
            if value % tp:
                raise ParallelConfigError(field, f"{value} is not divisible by tp={tp}{where}")
        names = {n for n, _ in layer.named_parameters()}
        if names != set(self.placements):
            extra, missing = sorted(names - set(self.placements)), sorted(set(self.placements) - names)
            raise ParallelConfigError(
                "module",
                f"the {type(layer).__name__} TP plan{where} does not match its parameters "
                f"(not placed: {extra}; not present: {missing})",
            )


def _attention(m: CompactAttention | CompactGatedAttention, tp: int) -> LayerPlan:
    """Query heads by rows (gated attention's ``q_proj`` rows are ``[query, gate]`` per head, so a
    block of heads is a block of rows); KV heads by rows when ``tp`` divides them, a single KV head
    (MQA) replicated; ``o_proj`` by columns; the per-head-dim ``q_norm`` / ``k_norm`` replicated.
    Biases follow their projection; a biased ``o_proj`` is rejected (the bias would be summed
    ``tp`` times)."""
    c = m.config
    num_kv_heads = c.num_kv_heads or c.num_heads  # the config's __post_init__ already resolved it
    kv = COL if num_kv_heads % tp == 0 else REP
    if kv is REP and num_kv_heads != 1:
        raise ParallelConfigError(
            "num_kv_heads",
            f"{c.num_kv_heads} is not divisible by tp={tp} (only one KV head can be replicated)",
        )
    p = {}
    for name in ("q_proj", "k_proj", "v_proj"):
        for leaf in ("weight", "bias"):
            if getattr(getattr(m, name), leaf, None) is not None:
                p[f"{name}.{leaf}"] = COL if name == "q_proj" else kv
    if m.o_proj.bias is not None:
        raise ParallelConfigError("attention_bias", "a row-parallel o_proj with a bias is not supported")
    p["o_proj.weight"] = ROW
    for name in ("q_norm", "k_norm"):
        if hasattr(m, name):
            p[f"{name}.weight"] = REP
    return LayerPlan(p, (("num_heads", c.num_heads),))


def _mla(m: CompactMLA, tp: int) -> LayerPlan:
    """Heads by rows of the query (or query up-) projection and of ``kv_b_proj`` (per head
    ``[k_nope, v]``), ``o_proj`` by columns; the latent down-projections and their norms (and the
    shared rotary key part) replicated."""
    p = {"kv_a_proj.weight": REP, "kv_a_norm.weight": REP, "kv_b_proj.weight": COL, "o_proj.weight": ROW}
    if m.config.output_gate:  # Ling-3.0's head-wise gate: one row per head
        p["g_proj.weight"] = COL
    if m.config.q_lora_rank is None:
        p["q_proj.weight"] = COL
    else:
        p.update({"q_a_proj.weight": REP, "q_a_norm.weight": REP, "q_b_proj.weight": COL})
    return LayerPlan(p, (("num_heads", m.config.num_heads),))


def _kda(m: KDALayer, tp: int) -> LayerPlan:
    """Heads: the q/k/v, decay up- (``f_proj.1``), beta and output-gate up- (``g_proj.1``, and its
    bias when the layer has one: ``KDAConfig.output_gate_bias``) projections by rows, the three short
    convolutions by channels, ``A_log`` and ``dt_bias`` by head, ``o_proj`` by columns; the low-rank
    down-projections ``f_proj.0`` / ``g_proj.0`` and the per-channel ``o_norm`` replicated (fla's
    parameter names). Full-rank gate projections (``KDAConfig.low_rank_gates=False``, Ling-3.0):
    ``f_proj.0`` / ``g_proj.0`` (and its bias) by rows."""
    p = {
        name: COL
        for name in (
            "q_proj.weight",
            "k_proj.weight",
            "v_proj.weight",
            "q_conv1d.weight",
            "k_conv1d.weight",
            "v_conv1d.weight",
            "b_proj.weight",
            "A_log",
            "dt_bias",
        )
    }
    up = len(m.g_proj) - 1  # the projection with one row per head channel: 1 (low rank) or 0
    p.update({f"f_proj.{up}.weight": COL, f"g_proj.{up}.weight": COL})
    if m.g_proj[up].bias is not None:
        p[f"g_proj.{up}.bias"] = COL
    if up:
        p.update({"f_proj.0.weight": REP, "g_proj.0.weight": REP})
    p.update({"o_norm.weight": REP, "o_proj.weight": ROW})
    return LayerPlan(p, (("num_heads", m.config.num_heads),))


def _gdn(m: CompactGatedDeltaNet, tp: int) -> LayerPlan:
    """By key heads, each with its ``Hv / Hk`` value heads (a contiguous block of value heads too):
    every input projection by rows (the fused ``in_proj_qkvz`` / ``in_proj_ba`` are grouped per key
    head), the q, k and v convolutions by channels, ``dt_bias`` / ``A_log`` by value head,
    ``out_proj`` by columns; the per-``head_v_dim`` gated ``norm`` replicated."""
    p = {n: COL for n, _ in m.named_parameters() if n.startswith("in_proj") or "conv1d" in n}
    p.update({"dt_bias": COL, "A_log": COL, "norm.weight": REP, "out_proj.weight": ROW})
    return LayerPlan(p, (("num_k_heads", m.config.num_k_heads),))


def _swiglu(m: DenseFFN, tp: int) -> LayerPlan:
    """``gate`` / ``up`` by rows, ``down`` by columns."""
    p = {"gate.weight": COL, "up.weight": COL, "down.weight": ROW}
    return LayerPlan(p, (("intermediate_size", m.gate.weight.shape[0]),))


def _mamba2(m: Mamba2Mixer, tp: int) -> LayerPlan:
    """By groups of heads, each rank whole groups (B and C shared by a group's heads, the gated
    norm over a group's channels): the five input projections ``in_proj_{z,x,B,C,dt}`` (transformers'
    fused ``in_proj`` kept as its row blocks, :mod:`harts_runtime.layers.mamba2`) by rows, the
    ``x`` / ``B`` / ``C`` convolutions by channels, ``dt_bias`` / ``A_log`` / ``D`` by head, the
    per-channel ``norm`` by channels, ``out_proj`` by columns. ``tp`` must divide ``n_groups``
    (which divides the heads); a biased ``out_proj`` (``use_bias``) is rejected (the bias would be
    summed ``tp`` times)."""
    c = m.config
    if m.out_proj.bias is not None:
        raise ParallelConfigError("use_bias", "a row-parallel Mamba2 out_proj with a bias is not supported")
    blocks = (
        "in_proj_z",
        "in_proj_x",
        "in_proj_B",
        "in_proj_C",
        "in_proj_dt",
        "x_conv1d",
        "B_conv1d",
        "C_conv1d",
    )
    p = {
        f"{name}.{leaf}": COL
        for name in blocks
        for leaf in ("weight", "bias")
        if getattr(getattr(m, name), leaf, None) is not None
    }
    p.update({"dt_bias": COL, "A_log": COL, "D": COL, "norm.weight": COL, "out_proj.weight": ROW})
    return LayerPlan(p, (("num_heads", c.num_heads), ("n_groups", c.n_groups)))


def _relu2(m: Relu2MLP, tp: int) -> LayerPlan:
    """Nemotron-H's MLP: ``up_proj`` by rows, ``down_proj`` by columns (bias-free)."""
    if m.down_proj.bias is not None:
        raise ParallelConfigError("mlp_bias", "a row-parallel down_proj with a bias is not supported")
    p = {n: COL for n, _ in m.named_parameters() if n.startswith("up_proj")}
    p["down_proj.weight"] = ROW
    return LayerPlan(p, (("intermediate_size", m.up_proj.weight.shape[0]),))


# Each plan function takes its own layer class (the key): Any, as a dict cannot tie the two.
TP_PLANS: dict[type, Callable[[Any, int], LayerPlan]] = {
    CompactAttention: _attention,
    CompactGatedAttention: _attention,
    CompactMLA: _mla,
    KDALayer: _kda,
    CompactGatedDeltaNet: _gdn,
    DenseFFN: _swiglu,
    Mamba2Mixer: _mamba2,
    Relu2MLP: _relu2,
}
"""Layer class -> ``plan(layer, tp)``: the TP regions of a hybrid model."""


class Block(Protocol):
    """What the parallel steps read of a block (checked by :func:`model_blocks`): its mixer (None: a
    one-sublayer block, Nemotron-H's FFN layers) and its FFN (None: a mixer-only block)."""

    mixer: nn.Module | None
    ffn: nn.Module | None


def model_blocks(model: nn.Module) -> list[Block]:
    """``model.blocks`` as :class:`Block` s, after checking the model has the shape every parallel step
    reads (blocks with ``.mixer`` and ``.ffn``; ``.embed``, ``.norm`` and ``.lm_head`` modules)."""
    blocks = list(getattr(model, "blocks", []))
    if not blocks or not all(hasattr(b, "mixer") and hasattr(b, "ffn") for b in blocks):
        raise ParallelConfigError("model", f"{type(model).__name__} has no .blocks with .mixer and .ffn")
    for name in ("embed", "norm", "lm_head"):
        if not isinstance(getattr(model, name, None), nn.Module):
            raise ParallelConfigError("model", f"{type(model).__name__} has no .{name} module")
    return cast(list[Block], blocks)


def tp_plan(layer: nn.Module, tp: int, where: str = "") -> LayerPlan | None:
    """The checked plan of ``layer`` (None if its class has no TP plan: it stays replicated)."""
    fn = TP_PLANS.get(type(layer))
    if fn is None:
        return None
    plan = fn(layer, tp)
    plan.check(layer, tp, where)
    return plan
