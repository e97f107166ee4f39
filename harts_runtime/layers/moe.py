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

Expert computation, chosen by ``MoEConfig.grouped``:

* ``grouped=False``: a loop over experts (the reference, as torchtitan ``_run_experts_for_loop``;
  it synchronises with the device once per expert, through ``nonzero``);
* ``grouped=True``: one permutation: the N*k assignments are sorted by expert once (a stable
  device-side argsort, its inverse by a scatter, the per-expert counts by a scatter-add into a
  fixed [E] buffer, offsets by a cumsum), the rows are gathered once, two grouped matmuls run
  on the expert-sorted rows (``torch._grouped_mm`` with the device offsets where
  :func:`_grouped_mm_ok` allows, else a padded batched matmul over experts): gate and up as one
  product with ``[w_gate | w_up]`` [E, D, 2I] (:func:`gate_up_mm`: concatenated inside the
  forward and again in the backward, never saved between them; the parameters stay separate for
  the state-dict adapters and expert parallelism), then the down projection. Between them the SwiGLU (fla's fused Triton kernel on
  CUDA, ``MoEConfig.backend``) also scales each slot's I-wide row by its routing weight (exact:
  the down projection is linear), so the slots go back with one gather by the inverse
  permutation and a plain fixed-order sum over the k slots. The backward is gathers and
  fixed-order sums too (no atomics, no second sort).

Host synchronisation (issue 15): on CUDA the grouped path issues no device-to-host copy and no
data-dependent output shape, forward or backward, when ``torch._grouped_mm`` takes its fast path:
bf16 inputs and weights, compute capability 9.x or 10.x (PyTorch's ``_grouped_mm_cuda``; other
devices and dtypes run ``_grouped_mm_fallback``, which copies the offsets to the host), and
16-byte aligned rows (D and I multiples of 8 in bf16: D=1536, I=512 qualifies). Group sizes need
no padding: the forward and input-gradient products are 2-D x 3-D (the ragged dimension is M),
and the weight gradient is ``x^T`` (column-major) times the row-major output gradient, the one
2-D x 2-D layout the kernel accepts with any group size, empty groups included. Anything else
(fp32 or fp16 on CUDA, unaligned widths, older GPUs) takes the padded-bmm fallback, which reads
the largest count on the host (one synchronisation per grouped matmul). The router, its
statistics (z-loss, load-balancing loss, multiplicity-weighted counts ``f_e``), the count
accumulation into ``local_tokens_per_expert`` and :meth:`CompactMoE.update_expert_bias` are
device-side in every path: nothing is read back per step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from harts_runtime.errors import InvalidInputError
from harts_runtime.layout.rows import RowLayout
from harts_runtime.modules.fused import device_guard, use_fla
from harts_runtime.modules.swiglu import SwiGLU
from harts_runtime.ops.rows import permute_rows

__all__ = [
    "SCORE_FUNCS",
    "CompactMoE",
    "MoEConfig",
    "MoEOutput",
    "combine_rows",
    "dispatch_rows",
    "gate_up_mm",
    "grouped_mm",
    "route",
    "router_losses",
    "sort_assignments",
    "swiglu_rows",
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
    grouped: bool = True
    """Grouped-matmul expert path (True) or the per-expert loop reference (False)."""
    backend: str = "auto"
    """Where the grouped path's SwiGLU runs (:mod:`harts_runtime.modules.fused`): ``"triton"``
    (fla's fused SwiGLU kernels), ``"naive"`` (``F.silu(a) * b``) or ``"auto"`` (fla's on CUDA
    when fla-core is importable, else the reference)."""
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


def _softmax_scores(logits: torch.Tensor):
    scores = logits.softmax(-1)
    return scores, scores


def _sigmoid_scores(logits: torch.Tensor):
    scores = logits.sigmoid()
    return scores, scores / (scores.sum(-1, keepdim=True) + 1e-20)


SCORE_FUNCS = {"softmax": _softmax_scores, "sigmoid": _sigmoid_scores}
"""Router score name -> ``logits [N, E] -> (scores, probs)``: the scores select and weight the
experts, ``probs`` (sigmoid scores normalised per row) enter the load-balancing loss."""


def route(
    logits: torch.Tensor,
    top_k: int,
    score_func: str = "softmax",
    expert_bias=None,
    norm_topk_prob: bool = False,
    scaling: float = 1.0,
    num_groups: int = 1,
    topk_groups: int = 1,
):
    """Deterministic top-k routing of N rows.

    Parameters
    ----------
    logits : Tensor, float32, shape [N, E]
    expert_bias : Tensor, shape [E], optional
        Added to the scores for selection only.
    num_groups, topk_groups : int
        Group-limited selection (DeepSeek-V3 / Kimi-Linear ``n_group`` / ``topk_group``): the E
        experts form ``num_groups`` contiguous groups; a group's score is the sum of its two best
        selection scores (its best one for groups of one expert); only the experts of the
        ``topk_groups`` best groups can be selected. ``num_groups=1`` is plain top-k.

    Returns
    -------
    probs : Tensor, [N, E]
        Routing probabilities for the aux loss (softmax; sigmoid scores normalised per row).
    topk_idx : Tensor, int64, [N, k]
        Stable descending order: ties go to the lower expert id.
    topk_weight : Tensor, [N, k]
        Combine weights (unbiased scores of the selected experts, optionally renormalised, scaled).
    """
    if score_func not in SCORE_FUNCS:
        raise InvalidInputError("score_func", f"unknown {score_func!r}; choose one of {sorted(SCORE_FUNCS)}")
    scores, probs = SCORE_FUNCS[score_func](logits)
    select = scores.detach() if expert_bias is None else scores.detach() + expert_bias
    if num_groups > 1:
        n, e = select.shape
        if e % num_groups or not 1 <= topk_groups <= num_groups:
            raise InvalidInputError(
                "num_expert_groups", f"{e} experts in {num_groups} groups, keeping {topk_groups}"
            )
        per = select.view(n, num_groups, e // num_groups)
        group_score = per.topk(min(2, e // num_groups), dim=-1).values.sum(-1)  # [N, G]
        keep = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[:, :topk_groups]
        allowed = torch.zeros(n, num_groups, dtype=torch.bool, device=select.device).scatter_(1, keep, True)
        select = per.masked_fill(~allowed[..., None], float("-inf")).view(n, e)
    topk_idx = torch.sort(select, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weight = scores.gather(1, topk_idx)
    if norm_topk_prob:
        weight = weight / (weight.sum(-1, keepdim=True) + 1e-20)
    return probs, topk_idx, weight * scaling


def router_losses(
    logits: torch.Tensor, probs: torch.Tensor, topk_idx: torch.Tensor, multiplicity=None, reduce=None
):
    """Multiplicity-weighted router statistics of N rows.

    Parameters
    ----------
    logits : Tensor, float32 (or float64), [N, E]
    probs : Tensor, [N, E]
    topk_idx : Tensor, int64, [N, k]
    multiplicity : Tensor, [N], optional
        ``q_c`` (None: every row once, i.e. trajectory-wise training on expanded rows).
    reduce : callable, optional
        For rows sharded over ranks (sequence parallelism): sums a 1-D tensor of per-shard partial
        sums over the shards, differentiably (forward all-reduce, backward identity). The losses are
        nonlinear in the row sums (``P_e f_e / S^2``, ``z / S``), so the mass ``P``, counts ``f``,
        ``S`` and the z-loss numerator are summed first (one call, ``2E + 2`` scalars) and the
        losses formed from the totals; they are then the whole row set's, equal on every shard.

    Returns
    -------
    (aux_loss, z_loss, tokens_per_expert) : scalar, scalar, float32 [E]
        As defined in the module docstring; ``S = sum q``. ``tokens_per_expert`` is always these
        N rows' counts (partial under ``reduce``), so that accumulating them per shard and summing
        the accumulators later counts every row once.
    """
    n, e = probs.shape
    k = topk_idx.shape[1]
    dt = logits.dtype
    q = torch.ones(n, device=logits.device, dtype=dt) if multiplicity is None else multiplicity.to(dt)
    s = q.sum()
    assigned = torch.zeros(n, e, device=logits.device, dtype=dt).scatter_(1, topk_idx, 1.0)  # a_{c,e}
    tokens_per_expert = q @ assigned  # [E] f_e
    mass = (q[:, None] * probs.to(dt)).sum(0)  # [E] P_e
    z_sum = (q * torch.logsumexp(logits, dim=-1).square()).sum()
    counts = tokens_per_expert
    if reduce is not None:
        total = reduce(torch.cat([mass, z_sum[None], tokens_per_expert, s[None]]))
        mass, z_sum, counts, s = total[:e], total[e], total[e + 1 : 2 * e + 1], total[2 * e + 1]
        counts, s = counts.detach(), s.detach()
    s = s.clamp(min=1)  # an empty microbatch (0 rows: DP padding) has no statistics, not NaN ones
    aux = (mass * counts).sum() * (e / (k * s * s))
    z = z_sum / s
    return aux, z, tokens_per_expert.float()


# ------------------------------------------------------------------------------ grouped matmul
class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (``_grouped_mm`` needs it)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


@functools.cache
def _has_grouped_mm() -> bool:
    return hasattr(torch, "_grouped_mm")


@functools.cache
def _cuda_fast_grouped_mm(device_index: int) -> bool:
    """PyTorch's bf16 ``_grouped_mm`` fast path (CUTLASS, offsets read on the device) exists for
    compute capability 9.x and 10.x only (``_scaled_mm_allowed_device(sm90_only, sm100_only)``)."""
    return torch.cuda.get_device_capability(device_index)[0] in (9, 10)


def _tma_layout(t: torch.Tensor) -> bool:
    """Row- or column-major in the last two dimensions with 16-byte aligned leading strides (the
    ``check_valid_strides_and_return_transposed`` rule of ``_grouped_mm``)."""
    align = 16 // t.element_size()
    s, z = t.stride(), t.shape
    if s[-1] == 1 and s[-2] >= max(1, z[-1]):
        return s[-2] % align == 0
    if s[-2] == 1 and s[-1] >= max(1, z[-2]):
        return s[-1] % align == 0
    return False


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`grouped_mm` may call ``torch._grouped_mm`` for ``x`` [M, K] and ``w`` [E, K, N].

    Both need 16-byte aligned rows (``K`` and ``N`` times the element size) and one dtype. On CUDA
    the dtype must be bf16 and the device SM90/SM100, the only case whose kernel reads the offsets
    on the device; fp32/fp16 there would run PyTorch's per-group host loop (a synchronisation),
    so they take the padded bmm instead. On the CPU fp32 and bf16 qualify.
    """
    if not _has_grouped_mm() or x.dtype != w.dtype:
        return False
    aligned = _tma_layout(x) and _tma_layout(w) and (w.shape[-1] * w.element_size()) % 16 == 0
    if x.is_cuda:
        return (
            aligned
            and x.dtype == torch.bfloat16
            and all((t.storage_offset() * t.element_size()) % 16 == 0 for t in (x, w))
            and _cuda_fast_grouped_mm(x.device.index)
        )
    return aligned and x.dtype in (torch.float32, torch.bfloat16)


def _padded_bmm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Segmented matmul by padding each expert's rows into [E, max_count, K] and one bmm.

    The fallback of :func:`grouped_mm`: the padded shape needs the largest count on the host (one
    device synchronisation per call)."""
    e = w.shape[0]
    m = int(counts.max()) if counts.numel() else 0
    starts = torch.cumsum(counts, 0) - counts
    expert = torch.repeat_interleave(torch.arange(e, device=x.device), counts, output_size=x.shape[0])
    slot = torch.arange(x.shape[0], device=x.device) - starts[expert]
    padded = x.new_zeros(e, m, x.shape[1]).index_put((expert, slot), x)
    return torch.bmm(padded, w)[expert, slot]


def grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    counts: torch.Tensor,
    impl: str = "auto",
    offs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of ``x`` [M, K] grouped by expert (``counts`` int [E], summing to M) times ``w`` [E, K, N].

    Returns [M, N]: group ``e``'s rows times ``w[e]``. ``impl``: ``"grouped_mm"``
    (``torch._grouped_mm``), ``"bmm"`` (padded batched matmul) or ``"auto"`` (the first when
    :func:`_grouped_mm_ok` allows it). Both are differentiable. ``offs``: the int32 cumulative
    counts, if the caller already has them (several matmuls over one grouping); computed on the
    device otherwise.
    """
    if _takes_grouped_mm(impl, x, w):
        offs = torch.cumsum(counts, 0, dtype=torch.int32) if offs is None else offs
        return _ContiguousGrad.apply(torch._grouped_mm(x, w, offs=offs))
    return _padded_bmm(x, w, counts)


def _takes_grouped_mm(impl: str, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a grouped matmul of ``x`` by ``w`` under ``impl`` calls ``torch._grouped_mm``
    (:func:`grouped_mm`); :class:`InvalidInputError` for an unknown ``impl``."""
    if impl not in ("auto", "grouped_mm", "bmm"):
        raise InvalidInputError("impl", f"unknown {impl!r}; choose auto, grouped_mm or bmm")
    return impl == "grouped_mm" or (impl == "auto" and x.shape[0] > 0 and _grouped_mm_ok(x, w))


# ------------------------------------------------------------------------- dispatch and combine
class _GateUpGroupedMM(torch.autograd.Function):
    """``torch._grouped_mm(x, [w_gate | w_up], offs)`` that does not keep the concatenation.

    The forward concatenates the two [E, D, I] weights into one [E, D, 2I] operand, multiplies and
    frees it; it saves ``x`` and the two parameters (which live anyway). The backward rebuilds the
    concatenation only for the input gradient, ``dY [w_gate | w_up]^T``, and computes the weight
    gradient as one ``x^T dY`` [E, D, 2I] split into the two parameters' gradients. These are the
    products of ``torch._grouped_mm``'s own derivative (2-D x 3-D, and column-major ``x^T`` times
    the row-major ``dY``: its device-offset fast path). With autograd's ``cat`` the [E, D, 2I]
    operand was saved from the forward to the backward: 2 E D I elements (0.4 GB per ling-tiny MoE
    layer in bf16, 1 GB per Qwen3.5-35B-A3B layer) per layer without recomputation."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, offs):
        ctx.save_for_backward(x, w_gate, w_up, offs)
        return torch._grouped_mm(x, torch.cat([w_gate, w_up], dim=-1), offs=offs)

    @staticmethod
    def backward(ctx, g):
        x, w_gate, w_up, offs = ctx.saved_tensors
        g = g.contiguous()
        dx = dg = du = None
        if ctx.needs_input_grad[0]:
            w = torch.cat([w_gate, w_up], dim=-1)
            dx = torch._grouped_mm(g, w.transpose(-2, -1), offs=offs)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            dg, du = torch._grouped_mm(x.t(), g, offs=offs).split(w_gate.shape[-1], dim=-1)
        return dx, dg, du, None


def gate_up_mm(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    counts: torch.Tensor,
    impl: str = "auto",
    offs: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`grouped_mm` of ``x`` [M, D] with ``[w_gate | w_up]`` [E, D, 2I] (the two [E, D, I]
    weights side by side): [M, 2I], the gate product in the first I columns. On the
    ``torch._grouped_mm`` path the concatenation lives only inside the forward and the backward
    (:class:`_GateUpGroupedMM`); on the padded-bmm fallback it is an autograd ``cat``."""
    if w_gate.shape != w_up.shape or w_gate.dtype != w_up.dtype:
        raise InvalidInputError(
            "w_up", f"{tuple(w_up.shape)} {w_up.dtype} != w_gate {tuple(w_gate.shape)} {w_gate.dtype}"
        )
    # the concatenation is a fresh contiguous [E, D, 2I]: w_gate's checks cover its dtype, device
    # and alignment (I aligned implies 2I aligned)
    if _takes_grouped_mm(impl, x, w_gate):
        offs = torch.cumsum(counts, 0, dtype=torch.int32) if offs is None else offs
        return _GateUpGroupedMM.apply(x, w_gate, w_up, offs)
    return grouped_mm(x, torch.cat([w_gate, w_up], dim=-1), counts, impl, offs)


def sort_assignments(topk_idx: torch.Tensor, num_experts: int):
    """The one permutation of the grouped path, computed on the device (no host synchronisation).

    Parameters
    ----------
    topk_idx : Tensor, int64, [N, k]

    Returns
    -------
    order : Tensor, int64, [N*k]
        The assignment slots ``c * k + j`` sorted by expert (stable: rows ascending inside an
        expert, so the grouping is deterministic).
    inverse : Tensor, int64, [N*k]
        The inverse permutation (``inverse[order] = arange``), by a scatter rather than a second sort.
    counts : Tensor, int64, [E]
        Assignments per expert, by a scatter-add into a fixed-size buffer (``bincount`` on CUDA
        reads its output size back from the device).
    """
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    slots = torch.arange(flat.numel(), device=flat.device)
    inverse = torch.empty_like(order).scatter_(0, order, slots)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    return order, inverse, counts


def _sum_slots(y: torch.Tensor, k: int) -> torch.Tensor:
    """[N*k, W] slots in row-major slot order -> [N, W]: a fixed-order sum over the k slots of a
    row (PyTorch's reduction accumulates bf16 in fp32 and rounds once; no atomics)."""
    return y.view(y.shape[0] // k, k, y.shape[-1]).sum(1)


class _Dispatch(torch.autograd.Function):
    """``x[rows]`` with ``rows = order // k``: rows [N, D] to their N*k expert-sorted assignment slots.

    Backward: the slot gradients back to [N, k] order by a gather with ``inverse``, then a sum
    over the k slots (:func:`_sum_slots`), instead of autograd's accumulating ``index_put`` /
    ``index_add`` (a sort or atomics on CUDA). The adjoint of :class:`_Combine`.
    """

    @staticmethod
    def forward(ctx, x, rows, inverse, k):
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, g):
        (inverse,) = ctx.saved_tensors
        return _sum_slots(g.index_select(0, inverse), ctx.k), None, None, None


class _Combine(torch.autograd.Function):
    """Expert-sorted slots [N*k, D] back to their rows [N, D]: one gather by ``inverse`` (row-major
    slot order), then the fixed-order sum over the k slots of a row (:func:`_sum_slots`).

    Backward: ``g[rows]`` (``rows = order // k``, one gather straight into the expert-sorted slot
    order; no expanded [N, k, D] gradient, no scatter). The adjoint of :class:`_Dispatch`.
    """

    @staticmethod
    def forward(ctx, y, rows, inverse, k):
        ctx.save_for_backward(rows)
        return _sum_slots(y.index_select(0, inverse), k)

    @staticmethod
    def backward(ctx, g):
        (rows,) = ctx.saved_tensors
        return g.index_select(0, rows), None, None, None


def dispatch_rows(x: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
    """Rows [N, D] to their N*k expert-sorted assignment slots (``x[rows]``, ``rows = order // k``);
    backward by a gather and a fixed-order sum over the k slots (:class:`_Dispatch`)."""
    return _Dispatch.apply(x, rows, inverse, k)


def combine_rows(y: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
    """Expert-sorted slots [N*k, D] back to their N rows, summed over the k slots in a fixed order
    (:class:`_Combine`, the adjoint of :func:`dispatch_rows`)."""
    return _Combine.apply(y, rows, inverse, k)


# ------------------------------------------------------------------------------------ SwiGLU
class _FusedSwiGLU(torch.autograd.Function):
    """``silu(a) * b`` (times ``w`` per row, if given) for ``gu = [a | b]`` [M, 2I], through fla's
    Triton SwiGLU kernels (``swiglu_fwd`` / ``swiglu_fwdbwd``, the ones ``fla.modules.activations
    .swiglu`` runs; fp32 math, one rounding).

    Saves only ``gu`` and ``w``: the backward recomputes ``h = silu(a) * b`` in the same kernel that
    forms ``da``, ``db`` (``use_weight=True``), so no [M, I] intermediate is kept. ``da`` and
    ``db`` are written into one [M, 2I] gradient (one ``cat``; two slice backwards would each fill
    a zero [M, 2I] buffer and add them). ``dw = sum_I(g * h)``, as autograd forms it for ``h * w``.
    """

    @staticmethod
    def forward(ctx, gu, w):
        from fla.modules.activations.ops import swiglu_fwd

        a, b = gu.chunk(2, dim=-1)
        with device_guard(gu):
            h = swiglu_fwd(a, b)
        ctx.save_for_backward(gu, w)
        return h if w is None else h.mul_(w[:, None])

    @staticmethod
    def backward(ctx, g):
        from fla.modules.activations.ops import swiglu_fwdbwd

        gu, w = ctx.saved_tensors
        a, b = gu.chunk(2, dim=-1)
        need_w = w is not None and ctx.needs_input_grad[1]
        with device_guard(gu):
            if w is None:
                da, db = swiglu_fwdbwd(a, b, g)
            else:
                da, db, h = swiglu_fwdbwd(a, b, g * w[:, None], use_weight=True)
        dw = (g * h).sum(-1) if need_w else None
        return torch.cat([da, db], dim=-1), dw


def swiglu_rows(gu: torch.Tensor, w: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """``silu(a) * b``, each row scaled by ``w`` [M] if given, for ``gu = [a | b]`` [M, 2I] -> [M, I].

    ``backend`` as :func:`harts_runtime.modules.fused.use_fla`: fla's fused kernels
    (:class:`_FusedSwiGLU`) or the PyTorch reference ``F.silu(a) * b`` (then ``* w``)."""
    if use_fla(gu, backend):
        return _FusedSwiGLU.apply(gu, w)
    a, b = gu.chunk(2, dim=-1)
    h = F.silu(a) * b
    return h if w is None else h * w[:, None]


# ---------------------------------------------------------------------------------- module
class CompactMoE(nn.Module):
    """Routed SwiGLU experts on compact rows.

    Parameters: ``router`` [E, D]; ``w_gate``, ``w_up`` [E, D, I]; ``w_down`` [E, I, D]; with
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

    row_shard = None
    expert_dispatch = None
    """None: the experts run here. Expert parallelism (``harts_runtime.parallel``) sets a callable
    ``(moe, hidden [N, D], topk_idx [N, k], weight [N, k]) -> [N, D]`` that sends the rows to the
    ranks holding their experts and back (a plain attribute, like ``row_shard``)."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        c = self.config = config
        self.router = nn.Parameter(torch.empty(c.num_experts, c.hidden_size))
        self.w_gate = nn.Parameter(torch.empty(c.num_experts, c.hidden_size, c.intermediate_size))
        self.w_up = nn.Parameter(torch.empty(c.num_experts, c.hidden_size, c.intermediate_size))
        self.w_down = nn.Parameter(torch.empty(c.num_experts, c.intermediate_size, c.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(c.num_experts))
        self.register_buffer("local_tokens_per_expert", torch.zeros(c.num_experts))
        if c.num_shared_experts > 0:
            width = c.shared_intermediate_size or c.num_shared_experts * c.intermediate_size
            self.shared_experts = SwiGLU(c.hidden_size, width)
            if c.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w, fan_in in (
            (self.router, self.config.hidden_size),
            (self.w_gate, self.config.hidden_size),
            (self.w_up, self.config.hidden_size),
            (self.w_down, self.config.intermediate_size),
        ):
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
        dt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        logits = hidden.to(dt) @ self.router.to(dt).t()  # [N, E]
        probs, topk_idx, weight = route(
            logits,
            c.top_k,
            c.score_func,
            self.expert_bias if c.use_expert_bias else None,
            c.norm_topk_prob,
            c.routed_scaling_factor,
            c.num_expert_groups,
            c.topk_groups,
        )
        shard = self.row_shard
        if shard is not None and multiplicity is not None:
            multiplicity = shard.select(multiplicity, hidden.shape[0])
        aux, z, counts = router_losses(
            logits, probs, topk_idx, multiplicity, reduce=None if shard is None else shard.reduce
        )
        if self.training and c.accumulate_counts:
            self.local_tokens_per_expert += counts.detach()
        # Shared experts: a dense SwiGLU, independent of the routing, issued before the routed
        # path on the same stream (no side streams); the sum below is the same either way.
        s = self._shared(hidden) if c.num_shared_experts > 0 else None
        if self.expert_dispatch is not None:
            out = self.expert_dispatch(self, hidden, topk_idx, weight.to(hidden.dtype))
        else:
            experts = self._experts_grouped if c.grouped else self._experts_loop
            out = experts(hidden, topk_idx, weight.to(hidden.dtype))
        if s is not None:
            out = out + s
        return MoEOutput(
            out, aux, z, counts.detach(), topk_idx, weight, c.aux_loss_coef * aux + c.z_loss_coef * z
        )

    def _shared(self, hidden: torch.Tensor) -> torch.Tensor:
        shared = getattr(self, "shared_experts", None)
        if shared is None:  # a subclass that did not build them (expert parallelism)
            raise InvalidInputError("num_shared_experts", "this MoE module has no shared experts")
        s = shared(hidden)
        if self.config.shared_expert_gate:
            s = torch.sigmoid(self.shared_expert_gate(hidden)) * s
        return s

    def _ffn(self, x: torch.Tensor, e: int) -> torch.Tensor:
        return (F.silu(x @ self.w_gate[e]) * (x @ self.w_up[e])) @ self.w_down[e]

    def _experts_loop(self, x, topk_idx, weight):
        """Reference: for each expert, its rows, its FFN, weighted ``index_add`` into the rows."""
        out = torch.zeros_like(x)
        for e in range(self.config.num_experts):
            rows, slot = (topk_idx == e).nonzero(as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, self._ffn(x[rows], e) * weight[rows, slot, None])
        return out

    def _experts_grouped(self, x, topk_idx, weight):
        """Fast path: one expert sort of the N*k assignments, one gather of the rows, two grouped
        matmuls on device offsets (gate and up as one [E, D, 2I] product, then the down
        projection), the SwiGLU with the routing weights folded into its I-wide output, one gather
        back and a fixed-order sum over the k slots. No host synchronisation on the
        ``torch._grouped_mm`` path (module docstring).

        The routing weight of a slot multiplies its intermediate row ``h`` before the (linear) down
        projection, ``(w h) W_down = w (h W_down)``: the combine then has no D-wide weighted
        temporaries, and the weight gradient is an I-wide row dot product."""
        n, k = topk_idx.shape
        order, inverse, counts = sort_assignments(topk_idx, self.config.num_experts)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        rows = torch.div(order, k, rounding_mode="floor")
        xs = dispatch_rows(x, rows, inverse, k)  # [N*k, D] expert-sorted
        ws = permute_rows(weight.reshape(-1), order, inverse)  # [N*k] slot weights, expert-sorted
        gu = gate_up_mm(xs, self.w_gate, self.w_up, counts, offs=offs)  # [N*k, 2I]
        h = swiglu_rows(gu, ws, self.config.backend)  # [N*k, I], weighted
        ys = grouped_mm(h, self.w_down, counts, offs=offs)  # [N*k, D] expert-sorted, weighted
        return combine_rows(ys, rows, inverse, k)

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
