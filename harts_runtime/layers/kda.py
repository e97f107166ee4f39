"""KDA layer on compact rows, executed over a minimum-call plan (Sections 3.3, 3.4, 4.2, 4.3).

The parameters are those of ``fla.layers.kda.KimiDeltaAttention`` (flash-linear-attention 0.6.0,
``num_v_heads == num_heads``, short convolutions without bias), under the same names, so an fla
state dict loads with ``strict=True`` and no key map:

=================================  ====================  =========================================
name                               shape                 role
=================================  ====================  =========================================
``q_proj``, ``k_proj``             [H K, D]              query / key projections
``v_proj``                         [H V, D]              value projection
``q_conv1d``, ``k_conv1d``         ``.weight`` [H K, 1, w]  causal short convolutions (SiLU, no bias)
``v_conv1d``                       ``.weight`` [H V, 1, w]
``f_proj.0``, ``f_proj.1``         [V, D], [H K, V]      low-rank decay projection
``b_proj``                         [H, D]                beta (sigmoid) projection
``A_log``                          [H]                   decay rate: ``g = -exp(A_log) softplus(f + dt_bias)``
                                                         (bounded gate: ``lb sigmoid(exp(A_log) (f + dt_bias))``)
``dt_bias``                        [H K]
``g_proj.0``, ``g_proj.1``         [V, D], [H V, V] (+ bias [H V])  output-gate projection (bias:
                                                         ``KDAConfig.output_gate_bias``, fla's default)
``o_norm``                         ``.weight`` [V]       sigmoid-gated RMS norm per head
``o_proj``                         [D, H V]              output projection
=================================  ====================  =========================================

Ling-3.0's KDA (transformers ``BailingHybridDeltaAttention``) is two options away:

* ``KDAConfig.gate_lower_bound`` = ``kda_lower_bound`` (-5; ``kda_safe_gate``): the bounded
  forget gate ``g = lb * sigmoid(exp(A_log) * (f + dt_bias))`` in ``[lb, 0)`` instead of
  ``-exp(A_log) * softplus(f + dt_bias)`` (the reference path in PyTorch, autograd's backward; the
  fused path through fla's ``fused_kda_gate(..., lower_bound=lb)``, forward and backward);
* ``KDAConfig.low_rank_gates=False``: ``f_proj`` and ``g_proj`` are one full projection each
  (``f_proj.0`` [H K, D], ``g_proj.0`` [H V, D]) instead of fla's low-rank pairs through V.

Its q/k/v projections are separate as here; its one depthwise ``conv1d`` over ``[q | k | v]`` is
our three short convolutions stacked (a depthwise convolution acts per channel), split by the
state-dict adapter.

What runs where (the glossary of rounds, sequences and state slots is in
:mod:`harts_runtime.layout.kda_plan`):

* once per compact row: q/k/v/gate/beta projections, the causal short convolution (width ``w``,
  window from the row's true ancestors: :class:`~harts_runtime.layout.conv.ConvWindows`), the L2
  norm of q and k, the decay gate, the gated output norm and the output projection;
* once per round: one packed KDA call over the round's sequences, replay rows gathered from the
  already computed activations, initial states from earlier rounds' returned boundary states,
  requested states returned in fp32 (differentiable);
* every non-replay core output is written to its physical row exactly once.

Recomputation is block-level (:func:`harts_runtime.recompute.apply_recompute`): backward
re-executes the same rounds from the fixed plan; no activation or state outlives the layer call.
With ``keep=("linear_attention",)`` the rounds (the core and its gathers) keep their activations
instead and only the token-wise parts are re-executed. Without it, the recomputed core saves its
intermediates (``save_intermediates``: their memory is transient there,
:func:`~harts_runtime.ops.keep.saves_are_transient`), so its backward does not recompute them.
``layout.no_replay`` selects the Section 5.4 ablation's schedule instead of the replay rounds.

Two paths of the token-wise parts, chosen by ``KDAConfig.backend`` (:mod:`harts_runtime.modules.fused`):

* fused (CUDA): fla's varlen convolution on q, k and v with each sequence's context rows as its
  initial state (outputs contiguous, so nothing is copied before the core), one GEMM for the
  low-rank decay / output-gate inputs and beta (the three weights concatenated); fla's
  ``fused_kda_gate``; the L2 norm and the gated RMSNorm of :mod:`harts_kernels.norm` (fla's math,
  no compile per row count);
* reference (CPU): the same math module by module in PyTorch (float32 statistics).

:meth:`KDALayer.forward_trajectories` is the slow reference: every trajectory through the same
layer, unshared.

The head count H is read from the weights at forward time (``b_proj``'s rows), never from the
config: a tensor-parallel rank runs the same forward on its local heads' shards
(:mod:`harts_runtime.parallel.plans`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from harts_kernels.kda import chunk_kda_with_states
from harts_runtime.errors import InvalidInputError
from harts_runtime.layout.conv import ConvWindows
from harts_runtime.layout.kda_plan import KDASchedule
from harts_runtime.layout.rows import RowLayout
from harts_runtime.modules.convolution import ShortConvolution, varlen_causal_conv
from harts_runtime.modules.fused import use_fla
from harts_runtime.modules.norms import GatedRMSNorm, l2_norm
from harts_runtime.ops.keep import kept
from harts_runtime.ops.rounds import run_rounds
from harts_runtime.options import DEFAULT_CHUNK_SIZE

__all__ = ["KDAConfig", "KDALayer", "checked_plan", "kda_core", "kda_gate", "run_kda_schedule"]


@dataclass(kw_only=True)
class KDAConfig:
    """Shape and execution options of a :class:`KDALayer`."""

    hidden_size: int = 64
    """D, model width."""
    num_heads: int = 2
    """H (query/key heads = value heads)."""
    head_k_dim: int = 16
    """K, key/query head dim (the state is K x V per head)."""
    head_v_dim: int = 16
    """V, value head dim."""
    conv_size: int = 4
    """w, width of the causal short convolution on q, k and v (SiLU, no bias)."""
    chunk_size: int = DEFAULT_CHUNK_SIZE
    """B, the chunk size of the KDA core; must match the plan's."""
    norm_eps: float = 1e-5
    """epsilon of the gated RMS norm on the core output."""
    backend: str = "auto"
    """KDA core and token-wise kernels: "auto" (Triton / fla's fused kernels on CUDA, the
    PyTorch reference on CPU), "triton" or "naive"."""
    output_gate_bias: bool = True
    """Whether the output-gate up-projection ``g_proj.1`` has a bias: fla's ``KimiDeltaAttention``
    has one, transformers' Kimi-Linear (``g_b_proj``) has none (its ``from_hf_config`` sets False)."""
    gate_lower_bound: float | None = None
    """None: the decay gate ``-exp(A_log) softplus(f + dt_bias)`` (fla, Kimi-Linear); a negative
    number ``lb``: the bounded gate ``lb * sigmoid(exp(A_log) (f + dt_bias))`` (Ling-3.0's
    ``kda_safe_gate`` with ``kda_lower_bound``, -5)."""
    low_rank_gates: bool = True
    """True: the decay and output-gate projections are low-rank through V (``f_proj.0`` [V, D],
    ``f_proj.1`` [H K, V]; ``g_proj.0`` [V, D], ``g_proj.1`` [H V, V]), as fla and Kimi-Linear;
    False: one full projection each (``f_proj.0`` [H K, D]; ``g_proj.0`` [H V, D], with the bias
    of ``output_gate_bias``), as Ling-3.0."""

    def __post_init__(self):
        lb = self.gate_lower_bound
        if lb is not None and not (lb < 0 and math.isfinite(lb)):
            raise InvalidInputError("gate_lower_bound", f"must be a finite negative number or None, got {lb}")


def kda_gate(
    f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None = None
) -> torch.Tensor:
    """The KDA decay gate, the PyTorch reference (float32 math): ``f`` [R, H, K] (the decay
    projection's output), ``A_log`` [H], ``dt_bias`` [H K] -> log decay [R, H, K] float32, ``<= 0``:

    * ``lower_bound`` None: ``-exp(A_log) * softplus(f + dt_bias)`` (fla's ``naive_kda_gate``);
    * ``lower_bound`` lb < 0: ``lb * sigmoid(exp(A_log) * (f + dt_bias))`` in ``[lb, 0)`` (fla's
      ``naive_kda_lowerbound_gate``, transformers' ``BailingHybridForgetGate`` with ``safe_gate``).
    """
    H, K = f.shape[-2], f.shape[-1]
    z = f.float() + dt_bias.float().view(H, K)
    rate = A_log.float().exp().view(H, 1)
    if lower_bound is None:
        return -rate * F.softplus(z)
    return lower_bound * torch.sigmoid(rate * z)


def checked_plan(layout: RowLayout, x: torch.Tensor, chunk_size: int | None, conv: tuple[str, int]):
    """``layout.kda`` after checking it against a layer: its chunk size (unless ``chunk_size`` is
    None), its convolution width (``conv``: the layer's field name and value) and ``x``'s row
    count. Raises :class:`InvalidInputError` naming the mismatched field. Shared by
    :class:`KDALayer` and the gated delta net."""
    plan = layout.need("kda")
    if chunk_size is not None and plan.chunk_size != chunk_size:
        raise InvalidInputError(
            "layout.kda.chunk_size", f"{plan.chunk_size} != layer chunk_size {chunk_size}"
        )
    name, width = conv
    if plan.conv_width != width:
        raise InvalidInputError("layout.kda.conv_width", f"{plan.conv_width} != layer {name} {width}")
    if x.shape[0] != plan.num_rows:
        raise InvalidInputError("x", f"expected {plan.num_rows} compact rows, got {x.shape[0]}")
    return plan


def kda_core(q, k, v, g, beta, **kw):
    """The KDA core in the round executor's contract (:data:`~harts_runtime.ops.rounds.ChunkCore`):
    :func:`chunk_kda_with_states`, a decay of one value per head (g ``[1, n, H]``: the gated delta
    net's) broadcast over the key dim first (exact)."""
    if g.dim() == 3:
        g = g.unsqueeze(-1).expand(-1, -1, -1, q.shape[-1])
    return chunk_kda_with_states(q, k, v, g, beta, **kw)


def run_kda_schedule(
    sched: KDASchedule, q, k, v, g, beta, *, chunk_size: int, backend: str = "auto"
) -> torch.Tensor:
    """Execute a KDA schedule's rounds over per-row inputs (q, k [C, H, K]; v [C, H, V]; g
    [C, H, K] fp32 log decay, or [C, H] for one decay per head, broadcast over K after the gather;
    beta [C, H]): :func:`~harts_runtime.ops.rounds.run_rounds` with :func:`kda_core` (the packed rows
    of all rounds gathered once, one packed :func:`chunk_kda_with_states` call per round, initial
    states from earlier rounds' boundary states). Returns the core output [C, H, V] in physical
    order. Shared by :class:`KDALayer` and the gated delta net.

    The whole schedule (gathers, rounds, state handoffs, scatter) is the kept region
    ``"linear_attention"`` (:mod:`harts_runtime.ops.keep`): under
    ``apply_recompute(model, keep=("linear_attention",))`` it keeps its activations and is not
    re-run in backward."""
    return kept("linear_attention", _run_rounds, sched, q, k, v, g, beta, chunk_size, backend)


def _run_rounds(sched: KDASchedule, q, k, v, g, beta, chunk_size: int, backend: str) -> torch.Tensor:
    """The body of :func:`run_kda_schedule`."""
    rows = (q, k, v, g, beta)
    return run_rounds(sched, kda_core, rows, chunk_size=chunk_size, backend=backend, label="kda").o


class KDALayer(nn.Module):
    """Kimi Delta Attention (fla's ``KimiDeltaAttention`` parameters, H == HV) on compact rows."""

    def __init__(self, config: KDAConfig):
        super().__init__()
        c = self.config = config
        D, H, K, Vd, w = c.hidden_size, c.num_heads, c.head_k_dim, c.head_v_dim, c.conv_size
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * Vd, bias=False)
        self.q_conv1d = ShortConvolution(H * K, w, backend=c.backend)
        self.k_conv1d = ShortConvolution(H * K, w, backend=c.backend)
        self.v_conv1d = ShortConvolution(H * Vd, w, backend=c.backend)
        if c.low_rank_gates:
            self.f_proj = nn.Sequential(nn.Linear(D, Vd, bias=False), nn.Linear(Vd, H * K, bias=False))
        else:
            self.f_proj = nn.Sequential(nn.Linear(D, H * K, bias=False))
        self.b_proj = nn.Linear(D, H, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(H).uniform_(1, 16)))
        dt = torch.exp(torch.rand(H * K) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp(
            min=1e-4
        )
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        if c.low_rank_gates:
            self.g_proj = nn.Sequential(
                nn.Linear(D, Vd, bias=False), nn.Linear(Vd, H * Vd, bias=c.output_gate_bias)
            )
        else:
            self.g_proj = nn.Sequential(nn.Linear(D, H * Vd, bias=c.output_gate_bias))
        self.o_norm = GatedRMSNorm(Vd, eps=c.norm_eps, backend=c.backend)
        self.o_proj = nn.Linear(H * Vd, D, bias=False)

    # ---------------------------------------------------------------- token-wise parts
    def _features(self, x: torch.Tensor, windows: ConvWindows):
        """Per-row KDA inputs. x: [R, D] -> q, k [R, H, K]; v [R, H, V]; g [R, H, K] (fp32 log
        decay); beta [R, H]; out_gate [R, H, V]. H is the weights' (``b_proj``'s rows: a
        tensor-parallel rank's local heads), not the config's."""
        if use_fla(x, self.config.backend):
            return self._features_fused(x, windows)
        c = self.config
        R, H, K, Vd = x.shape[0], self.b_proj.weight.shape[0], c.head_k_dim, c.head_v_dim
        q = l2_norm(self.q_conv1d(self.q_proj(x), windows).view(R, H, K))
        k = l2_norm(self.k_conv1d(self.k_proj(x), windows).view(R, H, K))
        v = self.v_conv1d(self.v_proj(x), windows).view(R, H, Vd)
        g = kda_gate(self.f_proj(x).view(R, H, K), self.A_log, self.dt_bias, c.gate_lower_bound)  # <= 0
        beta = torch.sigmoid(self.b_proj(x).float()).to(x.dtype)
        out_gate = self.g_proj(x).view(R, H, Vd)
        return q, k, v, g, beta, out_gate

    def _features_fused(self, x: torch.Tensor, windows: ConvWindows):
        """:meth:`_features` through fla's kernels (same math, same outputs)."""
        from fla.ops.kda.gate import fused_kda_gate

        from harts_kernels.norm import l2norm  # fla's math, no compile per row count

        c = self.config
        R, H, K, Vd = x.shape[0], self.b_proj.weight.shape[0], c.head_k_dim, c.head_v_dim
        conv = lambda proj, conv1d: varlen_causal_conv(  # noqa: E731
            proj(x), conv1d.weight[:, 0, :], windows, "silu", c.backend
        )
        q = l2norm(conv(self.q_proj, self.q_conv1d).view(R, H, K))
        k = l2norm(conv(self.k_proj, self.k_conv1d).view(R, H, K))
        v = conv(self.v_proj, self.v_conv1d)
        w_low = torch.cat([self.f_proj[0].weight, self.g_proj[0].weight, self.b_proj.weight])
        widths = [self.f_proj[0].weight.shape[0], self.g_proj[0].weight.shape[0], H]
        f_low, g_low, b = torch.split(F.linear(x, w_low), widths, dim=1)
        if c.low_rank_gates:
            f_low, g_low = self.f_proj[1](f_low), self.g_proj[1](g_low)
        elif self.g_proj[0].bias is not None:
            g_low = g_low + self.g_proj[0].bias
        g = fused_kda_gate(f_low.view(R, H, K), self.A_log, self.dt_bias, lower_bound=c.gate_lower_bound)
        beta = torch.sigmoid(b.float()).to(x.dtype)
        out_gate = g_low.view(R, H, Vd)
        return q, k, v.reshape(R, H, Vd), g, beta, out_gate

    def _output(self, o: torch.Tensor, out_gate: torch.Tensor) -> torch.Tensor:
        """Gated RMS norm per head, then the output projection. o: [R, H, V] -> [R, D]."""
        return self.o_proj(self.o_norm(o, out_gate).flatten(1))

    # ---------------------------------------------------------------- execution
    def forward(self, x: torch.Tensor, layout: RowLayout) -> torch.Tensor:
        """x: [C, D] compact hidden states in physical order -> [C, D] layer output.

        Reads ``layout.kda`` (its replay schedule, or its no-replay schedule when
        ``layout.no_replay``). Raises :class:`InvalidInputError` when the plan's chunk size or
        convolution width is not the layer's, or ``x`` has not the plan's row count.
        """
        c = self.config
        plan = checked_plan(layout, x, c.chunk_size, ("conv_size", c.conv_size))
        q, k, v, g, beta, out_gate = self._features(x, plan.conv)
        sched = plan.no_replay if layout.no_replay else plan.replay
        o = run_kda_schedule(sched, q, k, v, g, beta, chunk_size=c.chunk_size, backend=c.backend)
        return self._output(o, out_gate)

    def forward_trajectories(self, x: torch.Tensor, offsets) -> torch.Tensor:
        """Reference: every trajectory unshared. x: [S, D] semantic rows, trajectories at
        ``[offsets[j], offsets[j+1])`` -> [S, D]. One packed call from zero states."""
        offsets = np.asarray(offsets, dtype=np.int64)
        windows = ConvWindows.trajectories(offsets, self.config.conv_size, x.device)
        q, k, v, g, beta, out_gate = self._features(x, windows)
        o, _, _ = chunk_kda_with_states(
            *(t.unsqueeze(0) for t in (q, k, v, g, beta)),
            cu_seqlens=offsets.tolist(),
            chunk_size=self.config.chunk_size,
            output_final_state=False,
            backend=self.config.backend,
        )
        return self._output(o.squeeze(0), out_gate)
