"""Mixture-of-experts FFN on compact tokens with multiplicity-weighted router statistics.

Paper Sections 3.5 ("MoE semantics without expert expansion") and 4.2 ("MoE execution and
objectives"). The router sees the C compact hidden rows; each row gets one deterministic top-k
decision, one dispatch and one computation per selected expert, with no token dropping, and its
output returns to the same row. Rows never expand by their multiplicity ``q_c`` (the number of
semantic positions that share row ``c``; ``sum_c q_c = S``, padding rows have ``q_c = 0``).

``q_c`` only weights the statistics, so that each equals what trajectory-wise training on the S
expanded rows computes (``p`` = routing probabilities, ``a`` = top-k assignment indicator):

* router z-loss (Megatron ``z_loss_func``): ``(1 / S) sum_c q_c logsumexp(logits_c)^2``;
* load-balancing loss (Switch / Megatron ``switch_load_balancing_loss_func``):
  ``E / (k S^2) * sum_e P_e f_e`` with mass ``P_e = sum_c q_c p_{c,e}`` and counts
  ``f_e = sum_c q_c a_{c,e}`` (gradient through ``P`` only);
* expert-load counts for the aux-loss-free bias update: ``f_e`` again, accumulated in
  ``local_tokens_per_expert``; :meth:`CompactMoE.update_expert_bias` applies
  ``bias += rate * sign(mean(f) - f)`` (Megatron ``get_updated_expert_bias``).

Kimi-Linear / DeepSeek-V3 options (defaults off): group-limited selection (``num_expert_groups``
groups of ``E / G`` experts; a row first keeps the ``topk_groups`` groups with the largest sum of
their two best biased scores, then takes its top-k inside them), ``routed_scaling_factor`` on the
combine weights, and ``num_shared_experts`` always-on SwiGLU experts (one SwiGLU of width
``shared_intermediate_size``, default ``num_shared_experts * intermediate_size``) whose output is
added to the routed output (Qwen3-Next / Qwen3.5: scaled per row by ``sigmoid(shared_expert_gate(x))``
with ``shared_expert_gate``). Group limiting changes only which experts a row selects, so the
statistics stay per row and the multiplicity weighting stays exact.

Determinism: top-k is a stable descending sort of the (biased) scores, so ties go to the lower
expert id, and a row's decision depends only on that row. Sequence-level aux losses (per-trajectory
balance) are not implemented: they need per-trajectory mass, which a compact row shares across
trajectories (doable with path sums over the segment tree; not needed by the paper's objective).

Routing replay (``EngineConfig(routing_replay=True)``, :func:`enable_routing_replay`): each MoE
layer, numbered in model order (``replay_layer``), takes its rows' experts from the layout
(``layout.info["routes"]``, int64 [N, M, k] with one route per row,
:func:`harts_runtime.ops.router.resolve_routes`) instead of its own top-k; a row whose route is -1
keeps its own. The combine weights are the router's scores gathered at the given experts,
normalised (``norm_topk_prob``) and scaled as without replay, so the router is still trained through
the gates of the experts that ran; the statistics count the given assignment.

Expert computation, chosen by ``MoEConfig.grouped``:

* ``grouped=False``: a loop over experts (the reference, as torchtitan ``_run_experts_for_loop``;
  it synchronises with the device once per expert, through ``nonzero``);
* ``grouped=True`` (:meth:`CompactMoE._experts_grouped`), on the ops of :mod:`harts_runtime.ops`:
  the N*k assignments are sorted by expert once and the rows gathered once
  (:mod:`~harts_runtime.ops.dispatch`); two grouped matmuls run on the expert-sorted rows, gate and
  up as one product with ``[w_gate | w_up]`` [E, D, 2I], then the down projection
  (:mod:`~harts_runtime.ops.grouped_gemm`); between them the SwiGLU (a fused Triton kernel on
  CUDA, ``MoEConfig.backend``) also scales each slot's I-wide row by its routing weight (exact: the
  down projection is linear; :mod:`~harts_runtime.ops.swiglu`), so the slots go back with one
  gather by the inverse permutation and a plain fixed-order sum over the k slots (one fused
  gather-sum kernel on CUDA). The backward is gathers and fixed-order sums too (no atomics, no
  second sort).

Host synchronisation: on CUDA the grouped path issues no device-to-host copy and no
data-dependent output shape, forward or backward, when ``torch._grouped_mm`` takes its fast path
(bf16, compute capability 9.x or 10.x, 16-byte aligned rows: the conditions are in
:mod:`harts_runtime.ops.grouped_gemm`); anything else takes the padded-bmm fallback, one
synchronisation per grouped matmul. The router, its statistics (z-loss, load-balancing loss,
multiplicity-weighted counts ``f_e``), the count accumulation into ``local_tokens_per_expert`` and
:meth:`CompactMoE.update_expert_bias` are device-side in every path: nothing is read back per step.

The router's top-k and statistics (:func:`route`, :func:`router_losses`) are
:mod:`harts_runtime.layers.moe_routing`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from harts_runtime.errors import InvalidInputError
from harts_runtime.layers.moe_routing import SCORE_FUNCS, route, router_losses
from harts_runtime.layers.relu2_mlp import Relu2MLP, relu2
from harts_runtime.layout.rows import RowLayout
from harts_runtime.modules.swiglu import SwiGLU, swiglu
from harts_runtime.ops.dispatch import combine_rows, dispatch_rows, sort_assignments
from harts_runtime.ops.grouped_gemm import gate_up_mm, grouped_mm
from harts_runtime.ops.router import router_logits
from harts_runtime.ops.rows import permute_rows
from harts_runtime.ops.swiglu import swiglu_rows

__all__ = [
    "SCORE_FUNCS",
    "CompactMoE",
    "MoEConfig",
    "MoEOutput",
    "enable_routing_replay",
    "route",
    "router_losses",
]


@dataclass(kw_only=True)
class MoEConfig:
    """Routed-expert FFN (SwiGLU experts)."""

    hidden_size: int
    """Model width D."""
    num_experts: int
    """E."""
    top_k: int
    """Experts per token k."""
    intermediate_size: int
    """Expert FFN width I."""
    score_func: str = "softmax"
    """``softmax`` or ``sigmoid`` routing scores."""
    norm_topk_prob: bool = False
    """Renormalise the k selected scores to sum to one (usual with sigmoid)."""
    routed_scaling_factor: float = 1.0
    """Multiplier on the combine weights."""
    use_expert_bias: bool = False
    """Aux-loss-free balancing: a non-trained bias added to the scores for selection only."""
    bias_update_rate: float = 1e-3
    """Step of the sign update of the expert bias."""
    aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss in :attr:`MoEOutput.router_loss`."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss in :attr:`MoEOutput.router_loss`."""
    num_expert_groups: int = 1
    """G: expert groups for group-limited selection (1: no limit; ``E`` must be a multiple)."""
    topk_groups: int = 1
    """Groups a row may select from (only with ``num_expert_groups > 1``)."""
    num_shared_experts: int = 0
    """Always-on shared experts (0: none), run as one SwiGLU ``shared_experts`` on every row."""
    shared_intermediate_size: int | None = None
    """Width of the shared SwiGLU (None: ``num_shared_experts * intermediate_size``)."""
    shared_expert_gate: bool = False
    """Qwen's sigmoid gate on the shared output (``shared_expert_gate``, a [1, D] linear):
    ``routed + sigmoid(shared_expert_gate(x)) * shared_experts(x)``."""
    swiglu_limit: float = 0.0
    """Clipped SwiGLU of the routed experts (Ling-3.0's per-layer ``expert_swiglu_limit``): with
    L > 0 each expert computes ``min(silu(x W_gate), L) * clamp(x W_up, -L, L)``; 0: plain."""
    shared_swiglu_limit: float = 0.0
    """The same clipping of the shared experts (Ling-3.0's ``share_expert_swiglu_limit``)."""
    activation: str = "swiglu"
    """Expert FFN: ``"swiglu"`` (gated: ``w_gate``, ``w_up``, ``w_down``) or ``"relu2"`` (Nemotron-H's
    non-gated ``relu(x W_up) ** 2 W_down``: no ``w_gate``; the shared experts a
    :class:`~harts_runtime.layers.relu2_mlp.Relu2MLP`)."""
    grouped: bool = True
    """Grouped-matmul expert path (True) or the per-expert loop reference (False)."""
    backend: str = "auto"
    """Where the grouped path's memory-bound steps run (:mod:`harts_runtime.modules.fused`):
    ``"triton"`` (the fused kernels of :mod:`harts_kernels.moe`: the weighted SwiGLU and the
    gather-sums of the combine and the dispatch's backward), ``"naive"`` (PyTorch) or ``"auto"``
    (the kernels on CUDA when triton and fla-core are importable, else PyTorch)."""
    accumulate_counts: bool = True
    """Add each training-mode forward's counts to ``local_tokens_per_expert``. A model that
    recomputes this forward (activation checkpointing) sets False and accumulates
    :attr:`MoEOutput.tokens_per_expert` itself, once per forward (``HybridModel`` does)."""


@dataclass
class MoEOutput:
    """Result of :meth:`CompactMoE.forward` on N rows."""

    hidden: torch.Tensor
    """[N, D] combined expert outputs, one per row."""
    aux_loss: torch.Tensor
    """Scalar load-balancing loss (unscaled, multiplicity-weighted)."""
    z_loss: torch.Tensor
    """Scalar router z-loss (unscaled, multiplicity-weighted)."""
    tokens_per_expert: torch.Tensor
    """float32 [E] multiplicity-weighted assignment counts ``f_e``."""
    topk_idx: torch.Tensor
    """int64 [N, k] selected experts, best first."""
    topk_weight: torch.Tensor
    """[N, k] combine weights."""
    router_loss: torch.Tensor
    """``aux_loss_coef * aux_loss + z_loss_coef * z_loss``."""


class RowShard(Protocol):
    """What sequence / context parallelism sets as :attr:`CompactMoE.row_shard`: this rank's block of
    the replica's per-row multiplicities, and the reduction of the router's partial sums."""

    def select(self, multiplicity: torch.Tensor, n: int) -> torch.Tensor: ...

    def reduce(self, partial: torch.Tensor) -> torch.Tensor: ...


class ExpertDispatchFn(Protocol):
    """What expert parallelism sets as :attr:`CompactMoE.expert_dispatch`: rows to the ranks holding
    their experts and back."""

    def __call__(
        self, moe: CompactMoE, x: torch.Tensor, topk_idx: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor: ...


# ---------------------------------------------------------------------------------- module
class CompactMoE(nn.Module):
    """Routed SwiGLU experts on compact rows.

    Parameters: ``router`` [E, D]; ``w_gate`` (not with ``activation="relu2"``), ``w_up`` [E, D, I];
    ``w_down`` [E, I, D]; with
    shared experts also ``shared_experts`` (a :class:`~harts_runtime.modules.swiglu.SwiGLU`:
    ``gate``/``up`` [I_s, D], ``down`` [D, I_s]). Buffers:
    ``expert_bias`` [E] (selection only) and ``local_tokens_per_expert`` [E] (float32, weighted
    counts accumulated since the last :meth:`update_expert_bias`).

    ``row_shard`` is None in the single-process path. Sequence parallelism
    (``harts_runtime.parallel``) sets it to an object with ``select(multiplicity [N_all], n) -> [n]``
    (this rank's contiguous block of the replica's per-row multiplicities, for its ``n`` hidden rows)
    and ``reduce(partial_sums) -> sums`` (see :func:`router_losses`); it is a plain attribute so this
    module needs no parallel import.
    """

    row_shard: RowShard | None = None
    replay_layer: int | None = None
    """Routing replay: this layer's index among the model's MoE layers (:func:`enable_routing_replay`),
    or None (the router's own top-k)."""
    expert_dispatch: ExpertDispatchFn | None = None
    """None: the experts run here. Expert parallelism (``harts_runtime.parallel``) sets a callable
    ``(moe, hidden [N, D], topk_idx [N, k], weight [N, k]) -> [N, D]`` that sends the rows to the
    ranks holding their experts and back (a plain attribute, like ``row_shard``)."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        c = self.config = config
        if c.activation not in ("swiglu", "relu2"):
            raise InvalidInputError("activation", f"choose 'swiglu' or 'relu2', got {c.activation!r}")
        self.router = nn.Parameter(torch.empty(c.num_experts, c.hidden_size))
        if c.activation == "swiglu":
            self.w_gate = nn.Parameter(torch.empty(c.num_experts, c.hidden_size, c.intermediate_size))
        self.w_up = nn.Parameter(torch.empty(c.num_experts, c.hidden_size, c.intermediate_size))
        self.w_down = nn.Parameter(torch.empty(c.num_experts, c.intermediate_size, c.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(c.num_experts))
        self.register_buffer("local_tokens_per_expert", torch.zeros(c.num_experts))
        if c.num_shared_experts > 0:
            width = c.shared_intermediate_size or c.num_shared_experts * c.intermediate_size
            if c.activation == "relu2":
                self.shared_experts = Relu2MLP(c.hidden_size, width)
            else:
                self.shared_experts = SwiGLU(c.hidden_size, width, limit=c.shared_swiglu_limit)
            if c.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w, fan_in in (
            (self.router, self.config.hidden_size),
            (getattr(self, "w_gate", None), self.config.hidden_size),
            (self.w_up, self.config.hidden_size),
            (self.w_down, self.config.intermediate_size),
        ):
            if w is not None:
                nn.init.normal_(w, std=fan_in**-0.5)

    def forward(self, hidden: torch.Tensor, layout: RowLayout | None = None) -> MoEOutput:
        """Route and run experts once per row.

        Parameters
        ----------
        hidden : Tensor, shape [N, D]
            Compact rows (or expanded rows for the trajectory-wise baseline).
        layout : RowLayout, optional
            Its ``multiplicity`` ``q_c`` [N] (int or float) weights the statistics; None (or a
            layout without multiplicities) weights every row once.

        Returns
        -------
        MoEOutput
            ``hidden`` [N, D] and the weighted router statistics; in training mode with
            ``config.accumulate_counts`` the counts are also added to ``local_tokens_per_expert``.
        """
        multiplicity = None if layout is None else layout.multiplicity
        c = self.config
        shard = self.row_shard
        given = None if self.replay_layer is None else self._given_routes(hidden.shape[0], layout)
        logits = router_logits(hidden, self.router)  # [N, E] float32 (float64 rows: float64)
        probs, topk_idx, weight = route(
            logits,
            c.top_k,
            c.score_func,
            self.expert_bias if c.use_expert_bias else None,
            c.norm_topk_prob,
            c.routed_scaling_factor,
            c.num_expert_groups,
            c.topk_groups,
            given,
        )
        if shard is not None and multiplicity is not None:
            multiplicity = shard.select(multiplicity, hidden.shape[0])
        aux, z, counts = router_losses(
            logits, probs, topk_idx, multiplicity, reduce=None if shard is None else shard.reduce
        )
        if self.training and c.accumulate_counts:
            self.local_tokens_per_expert += counts.detach()
        # Shared experts: a dense SwiGLU, independent of the routing, issued before the routed
        # path on the same stream (no side streams). The grouped path adds their output in its
        # combine (one pass); the others add it after.
        s = self._shared(hidden) if c.num_shared_experts > 0 else None
        w = weight.to(hidden.dtype)
        if self.expert_dispatch is None and c.grouped:
            out = self._experts_grouped(hidden, topk_idx, w, base=s)
        else:
            if self.expert_dispatch is not None:
                out = self.expert_dispatch(self, hidden, topk_idx, w)
            else:
                out = self._experts_loop(hidden, topk_idx, w)
            if s is not None:
                out = out + s
        return MoEOutput(
            out, aux, z, counts.detach(), topk_idx, weight, c.aux_loss_coef * aux + c.z_loss_coef * z
        )

    def _given_routes(self, n: int, layout: RowLayout | None) -> torch.Tensor:
        """This layer's replayed routes of the ``n`` rows (int64 [n, k])."""
        routes = None if layout is None else layout.info.get("routes")
        if routes is None:
            raise InvalidInputError(
                "routes", "routing_replay is on but this microbatch has none (give Rollouts(routes=...))"
            )
        given = routes[:, self.replay_layer]
        if self.row_shard is not None:
            given = self.row_shard.select(given, n)
        if given.shape != (n, self.config.top_k):
            raise InvalidInputError(
                "routes",
                f"{tuple(given.shape)} routes for {n} rows of top_k {self.config.top_k} in this layer",
            )
        return given

    def _shared(self, hidden: torch.Tensor) -> torch.Tensor:
        shared = getattr(self, "shared_experts", None)
        if shared is None:  # a subclass that did not build them (expert parallelism)
            raise InvalidInputError("num_shared_experts", "this MoE module has no shared experts")
        s = shared(hidden)
        if self.config.shared_expert_gate:
            s = torch.sigmoid(self.shared_expert_gate(hidden)) * s
        return s

    def _ffn(self, x: torch.Tensor, e: int) -> torch.Tensor:
        if self.config.activation == "relu2":
            return relu2(x @ self.w_up[e]) @ self.w_down[e]
        return swiglu(x @ self.w_gate[e], x @ self.w_up[e], self.config.swiglu_limit) @ self.w_down[e]

    def _experts_loop(self, x, topk_idx, weight):
        """Reference: for each expert, its rows, its FFN, weighted ``index_add`` into the rows."""
        out = torch.zeros_like(x)
        for e in range(self.config.num_experts):
            rows, slot = (topk_idx == e).nonzero(as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, self._ffn(x[rows], e) * weight[rows, slot, None])
        return out

    def _experts_grouped(self, x, topk_idx, weight, base=None):
        """Fast path: one expert sort of the N*k assignments, one gather of the rows, two grouped
        matmuls on device offsets (gate and up as one [E, D, 2I] product, then the down
        projection), the SwiGLU with the routing weights folded into its I-wide output, one gather
        back and a fixed-order sum over the k slots, plus ``base`` [N, D] (the shared experts'
        output) if given. No host synchronisation on the ``torch._grouped_mm`` path (module
        docstring).

        The routing weight of a slot multiplies its intermediate row ``h`` before the (linear) down
        projection, ``(w h) W_down = w (h W_down)``: the combine then has no D-wide weighted
        temporaries, and the weight gradient is an I-wide row dot product."""
        n, k = topk_idx.shape
        order, inverse, counts = sort_assignments(topk_idx, self.config.num_experts)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        rows = torch.div(order, k, rounding_mode="floor")
        be = self.config.backend
        xs = dispatch_rows(x, rows, inverse, k, be)  # [N*k, D] expert-sorted
        ws = permute_rows(weight.reshape(-1), order, inverse)  # [N*k] slot weights, expert-sorted
        if self.config.activation == "relu2":  # non-gated: one grouped matmul, relu2 in PyTorch
            h = relu2(grouped_mm(xs, self.w_up, counts, offs=offs)) * ws[:, None]  # [N*k, I], weighted
        else:
            gu = gate_up_mm(xs, self.w_gate, self.w_up, counts, offs=offs)  # [N*k, 2I]
            h = swiglu_rows(gu, ws, be, self.config.swiglu_limit)  # [N*k, I], weighted
        ys = grouped_mm(h, self.w_down, counts, offs=offs)  # [N*k, D] expert-sorted, weighted
        return combine_rows(ys, rows, inverse, k, be, base)

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor | None = None) -> torch.Tensor:
        """Aux-loss-free bias step ``bias += rate * sign(mean(f) - f)``; resets the accumulator.

        ``tokens_per_expert`` overrides the local accumulator (e.g. after an all-reduce over DP).
        Returns the counts used.
        """
        f = self.local_tokens_per_expert.clone() if tokens_per_expert is None else tokens_per_expert
        self.expert_bias += self.config.bias_update_rate * torch.sign(f.mean() - f)
        self.local_tokens_per_expert.zero_()
        return f


def enable_routing_replay(model: nn.Module, on: bool = True) -> list[CompactMoE]:
    """Number the model's MoE layers in module order (``replay_layer`` 0 .. M - 1: the ``M`` axis of
    ``routes``) so each replays its rows' given routes (``on=False``: none does). Returns the layers;
    the model's ``_harts_routing_replay`` holds them while on (what the step loop reads)."""
    layers = [m for m in model.modules() if isinstance(m, CompactMoE)]
    for j, m in enumerate(layers):
        m.replay_layer = j if on else None
    model._harts_routing_replay = layers if on else None
    return layers
