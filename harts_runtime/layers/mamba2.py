"""Mamba2 (SSD) mixer on compact rows (Nemotron-H), executed over the same minimum-call plan as
:class:`~harts_runtime.layers.kda.KDALayer` (Sections 3.3, 3.4, 4.2).

The parameters are transformers' ``NemotronHMamba2Mixer`` under the same names and shapes but for
its fused ``in_proj`` and ``conv1d``, whose row blocks are separate tensors here (as the Gated
DeltaNet layer keeps Qwen's ``in_proj_qkv`` apart), so that every tensor is a contiguous block of
heads (or of groups) and a tensor- or context-parallel rank holds one block
(:mod:`harts_runtime.parallel.plans`). A load-state-dict pre-hook splits those transformers
tensors, so an HF mixer's state dict still loads with ``strict=True`` and no key map;
:meth:`Mamba2Mixer.as_hf` maps ours (or their gradients) back (``H`` = ``mamba_num_heads``, ``P`` =
``mamba_head_dim``, ``N`` = ``ssm_state_size``, ``G`` = ``n_groups``, ``I = H P``, ``E = I + 2 G N``
the convolved channels):

=================================  =======================  ======================================
name                               shape                    role
=================================  =======================  ======================================
``in_proj_z``, ``in_proj_x``       [I, D], [I, D]           gate z and input x (+ bias each)
``in_proj_B``, ``in_proj_C``       [G N, D], [G N, D]       B and C, one block of N rows per group
``in_proj_dt``                     [H, D]                   dt (transformers' ``in_proj`` is the
                                                            concatenation [z, x, B, C, dt])
``x_conv1d``, ``B_conv1d``,        ``.weight`` [I | G N,    causal convolutions of x, B, C (SiLU
``C_conv1d``                       1, w] (``.bias``)        after the bias; window from the row's
                                                            true ancestors; transformers'
                                                            ``conv1d``, concatenated)
``dt_bias``, ``A_log``, ``D``      [H], [H], [H]            ``dt = clamp(softplus(dt + dt_bias), limits)``,
                                                            ``A = -exp(A_log)``, ``D`` the skip
``norm``                           ``.weight`` [I]          ``rmsnorm_group(y * silu(z)) * weight``
                                                            (groups of ``I / G`` channels)
``out_proj``                       [D, I] (+ bias)          output projection
=================================  =======================  ======================================

The forward still runs one GEMM over the five projection weights and one convolution over the
three convolution weights (concatenated), as transformers' fused tensors do. Head and group counts
are read from the weights at forward time (``H`` from ``A_log``, ``G`` from ``in_proj_B``), never
from the config, so a parallel rank runs the same forward on its local blocks (whole groups: the
gated norm's groups then stay on one rank).

Math per row: the SSD recurrence is chunkwise linear attention with one scalar decay per head,
``S_t = exp(dt_t A) S_{t-1} + B_t (dt_t x_t)^T``, ``y_t = S_t^T C_t + D x_t`` (state [N, P] per
head; B and C shared by the ``H / G`` heads of a group), i.e. the ChunkLA operator
:func:`harts_kernels.ssd.chunk_ssd_with_states` with ``q = C``, ``k = B``, ``v = dt x``,
``g = dt A`` and scale 1. Its rounds, replay rows (trajectory-wise chunk partitions kept),
differentiable boundary-state handoffs across forks and the causal convolution's context are
the KDA plan's (:func:`run_ssd_schedule`: the round executor :mod:`harts_runtime.ops.rounds`
with the SSD core); the core runs in fp32 as transformers' torch path (``mamba2_chunk_scan``)
does. Recomputation is block-level as for KDA; the schedule is the kept region
``"linear_attention"``.

:meth:`Mamba2Mixer.forward_trajectories` is the slow reference: every trajectory through the
same layer, unshared.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from harts_kernels.ssd import chunk_ssd_with_states
from harts_runtime.errors import InvalidInputError
from harts_runtime.layers.kda import checked_plan
from harts_runtime.layout.conv import ConvWindows
from harts_runtime.layout.kda_plan import KDASchedule
from harts_runtime.layout.rows import RowLayout
from harts_runtime.modules.convolution import varlen_causal_conv
from harts_runtime.ops.keep import kept
from harts_runtime.ops.rounds import run_rounds
from harts_runtime.options import DEFAULT_CHUNK_SIZE

__all__ = ["HF_CONCATENATED", "Mamba2Config", "Mamba2GatedRMSNorm", "Mamba2Mixer", "run_ssd_schedule"]


@dataclass(kw_only=True)
class Mamba2Config:
    """Shape and execution options of a :class:`Mamba2Mixer` (transformers' names in brackets)."""

    hidden_size: int
    """D, model width."""
    num_heads: int
    """H (``mamba_num_heads``)."""
    head_dim: int
    """P (``mamba_head_dim``); the state is N x P per head."""
    state_size: int
    """N (``ssm_state_size``)."""
    n_groups: int = 1
    """G (``n_groups``): B and C are shared by the H / G heads of a group; H % G == 0."""
    conv_kernel_size: int = 4
    """w (``conv_kernel``); must match the plan's convolution width."""
    use_conv_bias: bool = True
    """``conv1d`` has a bias (``use_conv_bias``)."""
    use_bias: bool = False
    """``in_proj`` and ``out_proj`` have biases (``use_bias``)."""
    norm_eps: float = 1e-5
    """epsilon of the gated group RMS norm (``layer_norm_epsilon``)."""
    time_step_limit: tuple = (0.0, float("inf"))
    """clamp of dt after the softplus (``time_step_limit``)."""
    chunk_size: int | None = None
    """B of the core. None: the plan's chunk size in :meth:`~Mamba2Mixer.forward` and
    :data:`~harts_runtime.options.DEFAULT_CHUNK_SIZE` in :meth:`~Mamba2Mixer.forward_trajectories`;
    an int must match the plan's."""
    backend: str = "auto"
    """core: "auto" (fla's Triton simple-GLA kernel on CUDA, the PyTorch reference on CPU),
    "triton" or "naive"."""

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "head_dim", "state_size", "n_groups", "conv_kernel_size"):
            if getattr(self, name) < 1:
                raise InvalidInputError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.n_groups:
            raise InvalidInputError("n_groups", f"{self.n_groups} does not divide num_heads {self.num_heads}")
        lo, hi = (float(t) for t in self.time_step_limit)
        if not 0.0 <= lo <= hi:
            raise InvalidInputError("time_step_limit", f"needs 0 <= min <= max, got {self.time_step_limit}")
        self.time_step_limit = (lo, hi)


def run_ssd_schedule(
    sched: KDASchedule, q, k, v, g, *, chunk_size: int, backend: str = "auto"
) -> torch.Tensor:
    """Execute a KDA plan's schedule with the SSD core over per-row inputs (q, k [C, H, K]; v
    [C, H, V]; g [C, H] fp32 log decay): :func:`~harts_runtime.ops.rounds.run_rounds` with
    :func:`~harts_kernels.ssd.chunk_ssd_with_states` (the packed rows of all rounds gathered once,
    one packed call per round with initial states from earlier rounds' boundary states, outputs
    scattered to physical order). Returns [C, H, V]. The kept region ``"linear_attention"``
    (:mod:`harts_runtime.ops.keep`)."""
    return kept("linear_attention", _run_rounds, sched, q, k, v, g, chunk_size, backend)


def _run_rounds(sched: KDASchedule, q, k, v, g, chunk_size: int, backend: str) -> torch.Tensor:
    """The body of :func:`run_ssd_schedule`."""
    rows = (q, k, v, g)
    return run_rounds(
        sched, chunk_ssd_with_states, rows, chunk_size=chunk_size, backend=backend, label="ssd"
    ).o


def _has(module: nn.Module, name: str) -> bool:
    sub, _, leaf = name.rpartition(".")
    return getattr(module.get_submodule(sub), leaf, None) is not None


class Mamba2GatedRMSNorm(nn.Module):
    """``weight * rmsnorm_groups(x * silu(gate))`` over groups of ``group_size`` channels of the
    last dim (gate before the norm), float32 inside, as transformers' ``NemotronHRMSNormGated``."""

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-5):
        super().__init__()
        if hidden_size % group_size:
            raise InvalidInputError("group_size", f"{group_size} does not divide {hidden_size}")
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size, self.eps = group_size, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() * F.silu(gate.float())
        hg = h.view(*h.shape[:-1], -1, self.group_size)
        hg = hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * hg.view_as(h).to(dtype)


_PROJ = ("in_proj_z", "in_proj_x", "in_proj_B", "in_proj_C", "in_proj_dt")
_CONV = ("x_conv1d", "B_conv1d", "C_conv1d")

HF_CONCATENATED = {
    "in_proj.weight": tuple(f"{n}.weight" for n in _PROJ),
    "in_proj.bias": tuple(f"{n}.bias" for n in _PROJ),
    "conv1d.weight": tuple(f"{n}.weight" for n in _CONV),
    "conv1d.bias": tuple(f"{n}.bias" for n in _CONV),
}
"""transformers' tensors that concatenate ours on dim 0: name -> our names, its row blocks in order
(the biases only where the config has them: ``use_bias``, ``use_conv_bias``)."""


class Mamba2Mixer(nn.Module):
    """Mamba2 mixer (transformers' ``NemotronHMamba2Mixer`` parameters, its fused ``in_proj`` and
    ``conv1d`` split by block) on compact rows."""

    def __init__(self, config: Mamba2Config):
        super().__init__()
        c = self.config = config
        H, P, N, G, D = c.num_heads, c.head_dim, c.state_size, c.n_groups, c.hidden_size
        self.intermediate_size = I = H * P  # noqa: E741
        self.conv_dim = I + 2 * G * N
        for name, rows in zip(_PROJ, (I, I, G * N, G * N, H)):
            setattr(self, name, nn.Linear(D, rows, bias=c.use_bias))
        for name, ch in zip(_CONV, (I, G * N, G * N)):
            conv = nn.Conv1d(ch, ch, c.conv_kernel_size, groups=ch, padding=c.conv_kernel_size - 1)
            if not c.use_conv_bias:
                conv.bias = None
            setattr(self, name, conv)
        self.dt_bias = nn.Parameter(torch.ones(H))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, H + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(H))
        self.norm = Mamba2GatedRMSNorm(I, I // G, eps=c.norm_eps)
        self.out_proj = nn.Linear(I, D, bias=c.use_bias)
        self.register_load_state_dict_pre_hook(Mamba2Mixer._split_hf_tensors)

    # ---------------------------------------------------------------- transformers' names
    @staticmethod
    def _split_hf_tensors(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        """Load-state-dict pre-hook: transformers' fused ``in_proj`` / ``conv1d`` tensors under
        ``prefix`` -> our blocks (views; the config's sizes)."""
        for hf, ours in HF_CONCATENATED.items():
            t = state_dict.get(prefix + hf)
            if t is None:
                continue
            sizes = [module.get_parameter(n).shape[0] for n in ours if _has(module, n)]
            if len(sizes) != len(ours) or t.dim() == 0 or t.shape[0] != sum(sizes):
                errors.append(f"{prefix}{hf}: {tuple(t.shape)} has not this layer's {sum(sizes)} rows")
                continue
            del state_dict[prefix + hf]
            for name, part in zip(ours, torch.split(t, sizes)):
                state_dict[prefix + name] = part

    @staticmethod
    def as_hf(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensors keyed by our names (a state dict, gradients) -> keyed by transformers' (our blocks
        concatenated into ``in_proj`` / ``conv1d``); other names as they are. A ``prefix.`` before
        the names is kept."""
        out = dict(tensors)
        for hf, ours in HF_CONCATENATED.items():
            for key in tensors:
                if key == ours[0] or key.endswith("." + ours[0]):
                    pre = key[: len(key) - len(ours[0])]
                    out[pre + hf] = torch.cat([out.pop(pre + n) for n in ours])
        return out

    # ---------------------------------------------------------------- token-wise parts
    def _local(self) -> tuple[int, int, int]:
        """(H, G, I) of the weights this forward runs with (a parallel rank's local blocks). Raises
        :class:`InvalidInputError` (``n_groups``) unless they hold whole groups of heads."""
        c = self.config
        H, G = self.A_log.shape[0], self.in_proj_B.weight.shape[0] // c.state_size
        if G < 1 or H * c.n_groups != G * c.num_heads:
            raise InvalidInputError(
                "n_groups",
                f"the layer's weights hold {H} heads and {G} groups of B / C; a block of whole groups "
                f"({c.num_heads // c.n_groups} heads each) is needed",
            )
        return H, G, H * c.head_dim

    def _features(self, x: torch.Tensor, windows: ConvWindows):
        """Per-row core inputs. x [R, D] -> q (C), k (B) [R, H, N] fp32; v (dt x) [R, H, P] fp32;
        g (dt A) [R, H] fp32; xs [R, H, P] (the skip's input); z [R, I] (the gate)."""
        c = self.config
        (H, G, I), R, P, N = self._local(), x.shape[0], c.head_dim, c.state_size  # noqa: E741
        projs = [getattr(self, n) for n in _PROJ]
        bias = torch.cat([m.bias for m in projs]) if c.use_bias else None
        # one GEMM over the five blocks and one convolution over x, B, C, as transformers' fused tensors
        zxbcdt = F.linear(x, torch.cat([m.weight for m in projs]), bias)
        z, xbc, dt = torch.split(zxbcdt, [I, I + 2 * G * N, H], dim=1)
        convs = [getattr(self, n) for n in _CONV]
        xbc = varlen_causal_conv(xbc, torch.cat([m.weight[:, 0, :] for m in convs]), windows, None, c.backend)
        if c.use_conv_bias:
            xbc = xbc + torch.cat([m.bias for m in convs])
        xbc = F.silu(xbc)
        xs, b, cm = torch.split(xbc, [I, G * N, G * N], dim=1)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        lo, hi = c.time_step_limit
        dt = dt.clamp(min=lo, max=hi if math.isfinite(hi) else None)
        A = -torch.exp(self.A_log.float())
        xs = xs.view(R, H, P)
        v = xs.float() * dt[..., None]
        k, q = (t.float().view(R, G, N).repeat_interleave(H // G, dim=1) for t in (b, cm))
        return q, k, v, dt * A, xs, z

    def _output(self, o: torch.Tensor, xs: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The ``D`` skip, the gated group norm and the output projection. o [R, H, P] -> [R, D]."""
        y = o + self.D.float()[:, None] * xs.float()
        y = self.norm(y.flatten(1), z)
        return self.out_proj(y.to(z.dtype))

    # ---------------------------------------------------------------- execution
    def forward(self, x: torch.Tensor, layout: RowLayout) -> torch.Tensor:
        """x: [C, D] compact hidden states in physical order -> [C, D] layer output.

        Reads ``layout.kda`` (its replay schedule, or its no-replay schedule when
        ``layout.no_replay``). Raises :class:`InvalidInputError` when the plan's convolution width
        (or a configured chunk size) is not the layer's, or ``x`` has not the plan's row count."""
        c = self.config
        plan = checked_plan(layout, x, c.chunk_size, ("conv_kernel_size", c.conv_kernel_size))
        q, k, v, g, xs, z = self._features(x, plan.conv)
        sched = plan.no_replay if layout.no_replay else plan.replay
        o = run_ssd_schedule(sched, q, k, v, g, chunk_size=plan.chunk_size, backend=c.backend)
        return self._output(o, xs, z)

    def forward_trajectories(
        self, x: torch.Tensor, offsets, *, chunk_size: int | None = None
    ) -> torch.Tensor:
        """Reference: every trajectory unshared. x: [S, D] semantic rows, trajectories at
        ``[offsets[j], offsets[j+1])`` -> [S, D]. One packed call from zero states with chunk size
        ``chunk_size`` (default: the config's, else :data:`~harts_runtime.options.DEFAULT_CHUNK_SIZE`)."""
        c = self.config
        offsets = np.asarray(offsets, dtype=np.int64)
        windows = ConvWindows.trajectories(offsets, c.conv_kernel_size, x.device)
        q, k, v, g, xs, z = self._features(x, windows)
        o, _, _ = chunk_ssd_with_states(
            *(t.unsqueeze(0) for t in (q, k, v, g)),
            cu_seqlens=offsets.tolist(),
            chunk_size=chunk_size or c.chunk_size or DEFAULT_CHUNK_SIZE,
            output_final_state=False,
            backend=c.backend,
        )
        return self._output(o.squeeze(0), xs, z)
