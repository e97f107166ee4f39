"""Router logits: float32 logits of the rows against the router's expert vectors.

``router_logits(hidden [N, D], weight [E, D]) -> float32 [N, E]`` = ``hidden @ weight^T`` in
float32 (float64 for float64 inputs), as transformers' routers compute them (Kimi-Linear, Ling and
DeepSeek-V3 cast both operands to float32 first).

On CUDA with both operands in bf16 all three products run on bf16 tensor cores with float32
outputs (``torch.mm(..., out_dtype=torch.float32)``, :class:`_Bf16RouterLogits`):

* forward, ``logits = hidden @ W^T``: every product of two bf16 values is exact in float32 and the
  sum is accumulated in float32, so the logits are the float32 product's up to the accumulation
  order, with no float32 copy of ``hidden``;
* backward, ``d hidden = d logits @ W`` and ``d W = d logits^T @ hidden``: ``d logits`` is a
  float32 value, so it is split into two bf16 terms, ``hi = bf16(g)`` and ``lo = bf16(g - hi)``
  (:func:`split_bf16`; ``hi + lo`` is ``g`` to 2^-16 relative), and each product is the sum of the
  two exact bf16 products. That is float32's product up to about 2^-16 relative, far below the
  bf16 rounding (2^-8) of the gradients that come out.

What it replaces: three float32 SIMT GEMMs, together about 7% of a ling-tiny MoE layer's time (the
forward runs twice under recomputation; benchmarks/README.md, "Numbers behind the source's design
notes"), and the float32 copy of ``hidden`` autograd kept for the backward. Everything else
(float32 or float64 rows, the CPU, a torch without ``out_dtype``) is the plain float32 product.

Routing replay (``EngineConfig(routing_replay=True)``): the rollout engine's expert ids per token
(``routes`` int [S, M, k]: token, MoE layer, slot; -1 where not known, as vLLM returns prefix-cached
positions) become one route per compact row (:func:`resolve_routes`): a row stands for every
semantic position that shares it, and its route is that of the *first* of them (lowest trajectory,
then position) whose route at that layer is known; positions whose known route differs (as a set
of experts) are counted as ``conflicts``, rows no position routes are counted as ``unrouted`` and
keep the router's own top-k. The trajectory-wise baseline replays the same resolved routes, so
both executions compute the same thing.
"""

from __future__ import annotations

import numpy as np
import torch

from harts_runtime.errors import InvalidInputError

__all__ = ["check_routes", "microbatch_routes", "replay_metrics", "resolve_routes", "router_logits"]


def split_bf16(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi, lo)`` in bf16 with ``hi = bf16(g)``, ``lo = bf16(g - hi)``: ``hi + lo`` equals the
    float32 ``g`` to 2^-16 relative (a bf16 rounding errs by at most 2^-8 of its value, and ``lo``
    rounds a value at most 2^-8 of ``|g|``)."""
    hi = g.to(torch.bfloat16)
    return hi, (g - hi.float()).to(torch.bfloat16)


def mm_split(hi: torch.Tensor, lo: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(hi + lo) @ b`` in float32 for bf16 ``hi``, ``lo``, ``b``: two bf16 tensor-core products
    with float32 outputs, summed (exact products, float32 accumulation)."""
    return torch.mm(hi, b, out_dtype=torch.float32).add_(torch.mm(lo, b, out_dtype=torch.float32))


class _Bf16RouterLogits(torch.autograd.Function):
    """``hidden.float() @ weight.float().t()`` for bf16 operands, forward and backward on bf16
    tensor cores with float32 outputs (module docstring); saves the bf16 operands."""

    @staticmethod
    def forward(ctx, hidden, weight):
        ctx.save_for_backward(hidden, weight)
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, g):
        hidden, weight = ctx.saved_tensors
        hi, lo = split_bf16(g.contiguous())
        dh = mm_split(hi, lo, weight).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        dw = mm_split(hi.t(), lo.t(), hidden).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dh, dw


_OUT_DTYPE = torch.torch_version.TorchVersion(torch.__version__) >= "2.8"
"""``torch.mm(..., out_dtype=)`` (bf16 operands, float32 output on CUDA) exists from torch 2.8."""
_PLAIN = (torch.Tensor, torch.nn.Parameter)
"""Tensor types the tensor-core path takes: not DTensor, whose sharding rules may lack ``out_dtype``."""


def router_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 (float64 for float64 rows) logits ``hidden @ weight^T`` [N, E] (module docstring)."""
    if (
        _OUT_DTYPE
        and hidden.is_cuda
        and hidden.dim() == 2
        and hidden.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and type(hidden) in _PLAIN  # a DTensor (tensor parallelism outside a local region) keeps torch's path
        and type(weight) in _PLAIN
    ):
        return _Bf16RouterLogits.apply(hidden, weight)
    dt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    return hidden.to(dt) @ weight.to(dt).t()


def check_routes(routes, num_tokens: int, field: str = "routes") -> torch.Tensor:
    """``routes`` as int32 [S, M, k] (S = ``num_tokens``); :class:`InvalidInputError` naming
    ``field`` for another shape, a dtype that is not integer, or an id below -1 (the limit of
    ``num_experts`` is checked by the layer that knows it: :func:`resolve_routes`)."""
    t = routes if isinstance(routes, torch.Tensor) else torch.as_tensor(np.asarray(routes))
    if t.dim() != 3 or t.shape[0] != num_tokens:
        raise InvalidInputError(
            field, f"expected [S = {num_tokens} tokens, MoE layers, top_k] expert ids, got {tuple(t.shape)}"
        )
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise InvalidInputError(field, f"expert ids are integers, got dtype {t.dtype}")
    bad = t < -1
    if bool(bad.any()):
        s, layer, _ = (int(x) for x in bad.nonzero()[0])
        raise InvalidInputError(
            f"{field}[{s}][{layer}]", f"expert ids are >= 0 (-1: not known), got {t[s, layer].tolist()}"
        )
    return t.to(torch.int32)


def resolve_routes(routes: torch.Tensor, compact_map, num_rows: int, num_experts: int):
    """One route per compact row (module docstring).

    ``routes`` int [S, M, k] per semantic position, ``compact_map`` int [S] (its row), ``num_rows``
    C. Returns ``(row_routes int64 [C, M, k], conflicts, unrouted)``: -1 rows (every slot -1) keep
    the router's choice; ``conflicts`` counts (position, layer) pairs whose known route was
    overridden by the row's, ``unrouted`` the (row, layer) pairs without a known route.
    Raises :class:`InvalidInputError` (``routes[s][l]``) for an id at or above ``num_experts``, a
    route that names an expert twice, or one that mixes -1 with ids. O(S M k log k)."""
    r = routes.long().cpu()
    s_all, m, k = r.shape
    known = r >= 0
    some, every = known.any(-1), known.all(-1)
    bad = (some & ~every) | (r >= num_experts).any(-1)
    srt = r.sort(-1).values
    if k > 1:
        bad |= every & (srt[..., 1:] == srt[..., :-1]).any(-1)
    if bool(bad.any()):
        s, layer = (int(x) for x in bad.nonzero()[0])
        raise InvalidInputError(
            f"routes[{s}][{layer}]",
            f"a route is {k} distinct expert ids in [0, {num_experts}) or all -1 (not known), got {r[s, layer].tolist()}",
        )
    rows = torch.as_tensor(np.asarray(compact_map, dtype=np.int64))
    # the first known position of every (row, layer): lowest semantic index
    pos = torch.arange(s_all, dtype=torch.int64)[:, None].expand(s_all, m)
    first = torch.full((num_rows, m), s_all, dtype=torch.int64)
    first.scatter_reduce_(0, rows[:, None].expand(s_all, m), torch.where(every, pos, s_all), "amin")
    have = first < s_all
    pick = first.clamp(max=max(s_all - 1, 0))
    out = torch.full((num_rows, m, k), -1, dtype=torch.int64)
    layer = torch.arange(m)[None, :].expand(num_rows, m)
    out[have] = r[pick[have], layer[have]]
    chosen = srt[pick, layer]  # [C, M, k] sorted, valid where have
    conflicts = every & (srt != chosen[rows]).any(-1)
    return out, int(conflicts.sum()), int((~have).sum())


def microbatch_routes(step, mb, call_plan, layers) -> torch.Tensor:
    """The replayed routes of microbatch ``mb``'s rows (int64 [N, M, k], on the host): the step's
    ``routes`` resolved once per step to one route per batch compact row (:func:`resolve_routes`,
    cached on the step with its ``conflicts`` / ``unrouted`` counts), read at each row's batch row
    (compact: the call plan's ``physical_to_global``; trajectory-wise: the compact row of each
    expanded position, so both executions replay the same routes). ``layers``: the model's MoE
    layers in order. Raises :class:`InvalidInputError` (``routes``) when the step has none or their
    ``[M, k]`` is not the model's."""
    routes = step.routes
    m, k = len(layers), layers[0].config.top_k if layers else 0
    if routes is None:
        raise InvalidInputError(
            "routes", "routing_replay is on but the step has none (give Rollouts(routes=...))"
        )
    if tuple(routes.shape[1:]) != (m, k):
        raise InvalidInputError(
            "routes", f"expected [S, M = {m} MoE layers, k = {k}] expert ids, got {tuple(routes.shape)}"
        )
    batch = step.batch
    key = (id(routes), routes._version)
    if step._cache.get("routes_key") != key:
        experts = min(layer.config.num_experts for layer in layers)
        rows, conflicts, unrouted = resolve_routes(
            routes, batch.compact_map, int(batch.compact_tokens), experts
        )
        step._cache.update(routes_key=key, row_routes=rows, route_counts=(conflicts, unrouted))
    row_routes = step._cache["row_routes"]
    if mb.mode == "compact":
        g = np.asarray(call_plan.physical_to_global, dtype=np.int64)
    else:
        off = np.asarray(batch.offsets, dtype=np.int64)
        traj = np.asarray(mb.trajectories, dtype=np.int64)
        glob = (
            np.concatenate([np.arange(off[i], off[i + 1]) for i in traj])
            if len(traj)
            else np.zeros(0, np.int64)
        )
        g = np.asarray(batch.compact_map, dtype=np.int64)[glob]
    return row_routes[torch.from_numpy(g)]


def replay_metrics(step) -> dict:
    """``routing_replay/conflicts`` and ``routing_replay/unrouted`` of the step's resolved routes
    (:func:`resolve_routes`; empty before any microbatch resolved them)."""
    counts = step._cache.get("route_counts")
    if counts is None:
        return {}
    return {"routing_replay/conflicts": counts[0], "routing_replay/unrouted": counts[1]}
