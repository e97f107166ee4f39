"""Tensor and sequence parallelism for the compact-row layers (paper Section 4.3).

A *TP region* is a layer whose inner computation is sharded by heads (attention, gated attention,
MLA, KDA, Gated DeltaNet) or by the intermediate dimension (dense SwiGLU FFN): column-parallel input projections keep
``1 / tp`` of the heads, the row-parallel output projection produces a partial sum over heads. The
region is entered and left through hooks on the layer:

=====================  ===============================  ======================================
mode                   entry (on the layer input)        exit (on the layer output)
=====================  ===============================  ======================================
TP                     :func:`copy_to_tp` (bwd all-red)  :func:`reduce_from_tp` (all-reduce)
TP + SP                :func:`gather_rows` (all-gather)  :func:`scatter_rows_sum` (reduce-scatter)
=====================  ===============================  ======================================

With sequence parallelism the TP ranks of a replica hold contiguous blocks of the compact physical
rows between regions (:func:`harts_runtime.parallel.comm.row_split`); inside a region every rank sees
all rows, so row-indexed metadata (attention views, KDA call plans, positions) stays the replica's
full one and nothing about the compact layout changes.

Weights that stay replicated inside a region (MLA's latent down-projections and norms, KDA's
low-rank gate down-projections and its per-channel output norm, gated attention's q/k norms, Gated
DeltaNet's gated output norm) only see this rank's heads
downstream, so their gradients are partial: they are tagged ``_harts_tp_partial`` and summed over the
TP group by :func:`harts_runtime.parallel.data.allreduce_gradients`.

Why not megatron-core's ``ColumnParallelLinear``/``RowParallelLinear``: they fuse the region
boundary into each linear (one entry collective per projection), need a ``TransformerConfig`` and
``parallel_state`` globals, allocate through CUDA-only buffers (``GlobalMemoryBuffer``), and our
layers have several projections per region plus non-linear replicated pieces (MLA latents, KDA gates,
convolutions) between them. One entry and one exit per layer is also fewer collectives. The
collectives are the same as Megatron's ``mappings.py``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from harts_runtime.layers.attention import CompactAttention
from harts_runtime.layers.gated_attention import CompactGatedAttention
from harts_runtime.layers.gdn import CompactGatedDeltaNet
from harts_runtime.layers.kda import KDALayer
from harts_runtime.layers.mla import CompactMLA
from harts_runtime.parallel.comm import copy_to_tp, gather_rows, reduce_from_tp, row_split, scatter_rows_sum
from harts_runtime.parallel.dims import ParallelConfigError

__all__ = ["SequenceParallelRows", "shard_columns", "shard_rows", "tensor_parallel_layer"]


def _block(n: int, rank: int, world: int, field: str) -> slice:
    if n % world:
        raise ParallelConfigError(field, f"{n} is not divisible by tp={world}")
    per = n // world
    return slice(rank * per, (rank + 1) * per)


def _param_like(src: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(data.detach().clone().contiguous(), requires_grad=src.requires_grad)


def shard_columns(linear: nn.Linear, rank: int, world: int, field: str) -> None:
    """Column-parallel in place: keep output features ``[rank * O / w, (rank + 1) * O / w)`` (+ bias)."""
    s = _block(linear.out_features, rank, world, field)
    linear.weight = _param_like(linear.weight, linear.weight[s])
    if linear.bias is not None:
        linear.bias = _param_like(linear.bias, linear.bias[s])
    linear.out_features = linear.weight.shape[0]


def shard_rows(linear: nn.Linear, rank: int, world: int, field: str) -> None:
    """Row-parallel in place: keep input features ``[rank * I / w, ...)``; the output is a partial sum
    (no bias: it would be added ``world`` times by the sum)."""
    if linear.bias is not None:
        raise ParallelConfigError(field, "a row-parallel linear with a bias is not supported")
    s = _block(linear.in_features, rank, world, field)
    linear.weight = _param_like(linear.weight, linear.weight[:, s])
    linear.in_features = linear.weight.shape[1]


def _shard_param(mod: nn.Module, name: str, rank: int, world: int, field: str, dim: int = 0) -> None:
    p = getattr(mod, name)
    s = _block(p.shape[dim], rank, world, field)
    setattr(mod, name, _param_like(p, p[s] if dim == 0 else p[:, s]))


def _shard_channels(conv: nn.Conv1d, rank: int, world: int, field: str) -> None:
    """A depthwise convolution (``weight`` [C, 1, w]) keeps channels ``[rank * C / w, ...)``."""
    _shard_param(conv, "weight", rank, world, field)
    c = conv.weight.shape[0]
    conv.in_channels = conv.out_channels = conv.groups = c
    if hasattr(conv, "hidden_size"):
        conv.hidden_size = c


def _mark_partial(*modules_or_params) -> None:
    for x in modules_or_params:
        for p in x.parameters() if isinstance(x, nn.Module) else [x]:
            p._harts_tp_partial = True


def _shard_attention(m: CompactAttention | CompactGatedAttention, rank: int, tp: int) -> None:
    """KV heads are sharded when ``tp`` divides them; a single KV head (MQA) is replicated on every
    rank, with partial gradients (each rank's query heads read it). Other splits are rejected.

    Gated attention (:class:`CompactGatedAttention`): ``q_proj``'s rows are per query head
    ``[query, gate]``, so a block of heads is a block of rows; the per-``head_dim`` ``q_norm`` /
    ``k_norm`` stay replicated with partial gradients. A biased ``o_proj`` (``attention_bias``) is
    rejected by :func:`shard_rows`."""
    c = m.config
    if c.num_heads % tp:
        raise ParallelConfigError("num_heads", f"{c.num_heads} is not divisible by tp={tp}")
    shard_columns(m.q_proj, rank, tp, "num_heads")
    if c.num_kv_heads % tp == 0:
        shard_columns(m.k_proj, rank, tp, "num_kv_heads")
        shard_columns(m.v_proj, rank, tp, "num_kv_heads")
        kv_local = c.num_kv_heads // tp
    elif c.num_kv_heads == 1:
        _mark_partial(m.k_proj, m.v_proj)
        kv_local = 1
    else:
        raise ParallelConfigError(
            "tp",
            f"{tp} does not divide num_kv_heads={c.num_kv_heads} "
            "(and there is more than one KV head to replicate)",
        )
    shard_rows(m.o_proj, rank, tp, "num_heads")
    if isinstance(m, CompactGatedAttention):
        _mark_partial(m.q_norm, m.k_norm)
    m.config = dataclasses.replace(c, num_heads=c.num_heads // tp, num_kv_heads=kv_local)


def _shard_mla(m: CompactMLA, rank: int, tp: int) -> None:
    c = m.config
    if c.q_lora_rank is None:
        shard_columns(m.q_proj, rank, tp, "num_heads")
    else:
        shard_columns(m.q_b_proj, rank, tp, "num_heads")
        _mark_partial(m.q_a_proj, m.q_a_norm)
    shard_columns(m.kv_b_proj, rank, tp, "num_heads")
    shard_rows(m.o_proj, rank, tp, "num_heads")
    _mark_partial(m.kv_a_proj, m.kv_a_norm)
    m.config = dataclasses.replace(c, num_heads=c.num_heads // tp)


def _shard_kda(m: KDALayer, rank: int, tp: int) -> None:
    """Heads: the q/k/v, decay (``f_proj.1``), beta and output-gate (``g_proj.1``) projections by
    columns, the three short convolutions by channels, ``A_log`` and ``dt_bias`` by head, ``o_proj``
    by rows; the low-rank down-projections ``f_proj.0`` / ``g_proj.0`` and the per-channel
    ``o_norm`` stay replicated with partial gradients (fla's parameter names)."""
    c = m.config
    for lin in (m.q_proj, m.k_proj, m.v_proj, m.f_proj[1], m.b_proj, m.g_proj[1]):
        shard_columns(lin, rank, tp, "num_heads")
    for conv in (m.q_conv1d, m.k_conv1d, m.v_conv1d):
        _shard_channels(conv, rank, tp, "num_heads")
    for name in ("A_log", "dt_bias"):
        _shard_param(m, name, rank, tp, "num_heads")
    shard_rows(m.o_proj, rank, tp, "num_heads")
    _mark_partial(m.f_proj[0], m.g_proj[0], m.o_norm)
    m.config = dataclasses.replace(c, num_heads=c.num_heads // tp)


def _take_rows(mod: nn.Module, name: str, index: torch.Tensor) -> None:
    p = getattr(mod, name)
    setattr(mod, name, _param_like(p, p.index_select(0, index)))


def _shard_gdn(m: CompactGatedDeltaNet, rank: int, tp: int) -> None:
    """By key heads: each rank keeps key heads ``[rank * Hk / tp, ...)`` and their value heads
    (value head ``h`` belongs to key head ``h // (Hv / Hk)``, so also a contiguous block).

    Fused projections: ``in_proj_qkvz`` / ``in_proj_ba`` rows are grouped per key head, so a block
    of rows; split: the q, k and v row blocks of ``in_proj_qkv`` and blocks of ``in_proj_z`` /
    ``in_proj_b`` / ``in_proj_a``. ``conv1d`` keeps the matching q, k, v channels, ``dt_bias`` and
    ``A_log`` this rank's value heads, ``out_proj`` their columns; the per-``head_v_dim`` gated
    ``norm`` stays replicated with partial gradients."""
    c = m.config
    Hk, Hv, K, V = c.num_k_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim
    if Hk % tp:
        raise ParallelConfigError("num_k_heads", f"{Hk} is not divisible by tp={tp}")
    hk, hv = Hk // tp, Hv // tp
    qk = torch.arange(rank * hk * K, (rank + 1) * hk * K)
    vv = torch.arange(rank * hv * V, (rank + 1) * hv * V)
    conv_rows = torch.cat([qk, qk + Hk * K, vv + 2 * Hk * K])
    if c.projection == "fused":
        shard_columns(m.in_proj_qkvz, rank, tp, "num_k_heads")
        shard_columns(m.in_proj_ba, rank, tp, "num_k_heads")
    else:
        _take_rows(m.in_proj_qkv, "weight", conv_rows)
        m.in_proj_qkv.out_features = m.in_proj_qkv.weight.shape[0]
        for lin in (m.in_proj_z, m.in_proj_b, m.in_proj_a):
            shard_columns(lin, rank, tp, "num_k_heads")
    _take_rows(m.conv1d, "weight", conv_rows)
    n = m.conv1d.weight.shape[0]
    m.conv1d.in_channels = m.conv1d.out_channels = m.conv1d.groups = m.conv1d.hidden_size = n
    for name in ("dt_bias", "A_log"):
        _shard_param(m, name, rank, tp, "num_k_heads")
    shard_rows(m.out_proj, rank, tp, "num_k_heads")
    _mark_partial(m.norm)
    m.key_dim, m.value_dim = hk * K, hv * V
    m.conv_dim = 2 * m.key_dim + m.value_dim
    m.config = dataclasses.replace(c, num_k_heads=hk, num_v_heads=hv)


def _shard_swiglu(m: nn.Module, rank: int, tp: int) -> None:
    """A SwiGLU FFN with ``gate``/``up``/``down`` linears (``harts_runtime.layers.ffn.DenseFFN``)."""
    shard_columns(m.gate, rank, tp, "intermediate_size")
    shard_columns(m.up, rank, tp, "intermediate_size")
    shard_rows(m.down, rank, tp, "intermediate_size")


def _is_swiglu(m: nn.Module) -> bool:
    return all(isinstance(getattr(m, n, None), nn.Linear) for n in ("gate", "up", "down"))


def tensor_parallel_layer(
    m: nn.Module, group, rank: int, tp: int, sequence_parallel: bool = False
) -> nn.Module:
    """Shard one layer in place over the TP group and install its region entry/exit hooks.

    Supported: :class:`CompactAttention` (MHA/GQA), :class:`CompactGatedAttention`,
    :class:`CompactMLA`, :class:`KDALayer`, :class:`CompactGatedDeltaNet`, and SwiGLU
    FFNs with ``gate``/``up``/``down``. The layer is called as ``forward(x, layout)``: ``x`` the hidden
    rows ``[N, D]`` (all rows without SP, this rank's row block with SP), the output ``[N, D]``.
    Raises :class:`ParallelConfigError` naming the dimension that ``tp`` does not divide.
    """
    if isinstance(m, (CompactAttention, CompactGatedAttention)):
        _shard_attention(m, rank, tp)
    elif isinstance(m, CompactGatedDeltaNet):
        _shard_gdn(m, rank, tp)
    elif isinstance(m, CompactMLA):
        _shard_mla(m, rank, tp)
    elif isinstance(m, KDALayer):
        _shard_kda(m, rank, tp)
    elif _is_swiglu(m):
        _shard_swiglu(m, rank, tp)
    else:
        raise ParallelConfigError("module", f"no tensor-parallel plan for {type(m).__name__}")
    enter, leave = (gather_rows, scatter_rows_sum) if sequence_parallel else (copy_to_tp, reduce_from_tp)

    def pre_hook(_mod, args):
        return (enter(args[0], group),) + tuple(args[1:])

    def post_hook(_mod, _args, out):
        return leave(out, group)

    m.register_forward_pre_hook(pre_hook)
    m.register_forward_hook(post_hook)
    m._harts_tp = {"rank": rank, "size": tp, "sequence_parallel": sequence_parallel}
    return m


class SequenceParallelRows:
    """The ``row_shard`` of a :class:`harts_runtime.layers.moe.CompactMoE` under sequence parallelism.

    Between TP regions each TP rank holds the contiguous :func:`row_split` block of the replica's N
    rows, so the MoE routes only those rows; but the layout's multiplicities ``q_c`` cover all N rows
    and the router losses are nonlinear in row sums (``E / (k S^2) sum_e P_e f_e``, ``z / S``).
    ``select`` slices ``q`` to this rank's block; ``reduce`` sums the per-block partial statistics over
    the TP group with :func:`reduce_from_tp` (forward all-reduce; backward identity, because every TP
    rank evaluates the same replicated loss from the summed statistics).
    """

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, int(rank), int(size)

    def select(self, multiplicity: torch.Tensor, n: int) -> torch.Tensor:
        sizes = row_split(multiplicity.shape[0], self.size)
        if sizes[self.rank] != n:
            raise ParallelConfigError(
                "multiplicity",
                f"{multiplicity.shape[0]} rows split over tp={self.size} give "
                f"rank {self.rank} {sizes[self.rank]} rows, but the MoE "
                f"input has {n}",
            )
        start = sum(sizes[: self.rank])
        return multiplicity[start : start + n]

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(partial, self.group)
