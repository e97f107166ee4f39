"""Gated DeltaNet layer on compact rows (Qwen3-Next / Qwen3.5 linear attention), executed over the
same minimum-call plan as :class:`~harts_runtime.layers.kda.KDALayer` (Sections 3.3, 3.4, 4.2).

The parameters are transformers' ``Qwen3NextGatedDeltaNet`` (``projection="fused"``) or
``Qwen3_5MoeGatedDeltaNet`` (``projection="split"``), under the same names and shapes but for
transformers' ``in_proj_qkv`` and ``conv1d``, whose q, k and v row blocks are three tensors here
(as torchtitan's Qwen3.5, so that every tensor is a contiguous block of key heads and a
tensor-parallel rank holds one block: :mod:`harts_runtime.parallel.plans`). A load-state-dict
pre-hook splits those two transformers tensors, so an HF layer's state dict still loads with
``strict=True`` and no key map; :meth:`CompactGatedDeltaNet.as_hf` maps ours (or their gradients)
back (``Hk`` = ``num_k_heads``, ``Hv`` = ``num_v_heads``, ``r = Hv / Hk``, ``K`` / ``V`` the head
dims):

=================================  =======================  ======================================
name                               shape                    role
=================================  =======================  ======================================
``in_proj_qkvz`` (fused)           [2 Hk K + 2 Hv V, D]     per key head g: [q_g, k_g, v_g (r V), z_g (r V)]
``in_proj_ba`` (fused)             [2 Hv, D]                per key head g: [b_g (r), a_g (r)]
``in_proj_q``, ``in_proj_k``,      [Hk K, D], [Hk K, D],    q, k, v (transformers' ``in_proj_qkv``
``in_proj_v`` (split)              [Hv V, D]                is their concatenation)
``in_proj_z``, ``in_proj_b``,      [Hv V, D], [Hv, D],      output gate, beta, decay input
``in_proj_a`` (split)              [Hv, D]
``q_conv1d``, ``k_conv1d``         ``.weight`` [Hk K, 1, w]  causal convolutions of q, k, v (SiLU;
``v_conv1d``                       ``.weight`` [Hv V, 1, w]  transformers' ``conv1d``, concatenated)
``dt_bias``, ``A_log``             [Hv], [Hv]               ``g = -exp(A_log) softplus(a + dt_bias)``
``norm``                           ``.weight`` [V]          SiLU-gated RMS norm per value head (gate z)
``out_proj``                       [D, Hv V]                output projection
=================================  =======================  ======================================

The fused layout is transformers' ``fix_query_key_value_ordering``: value head ``h`` belongs to
key head ``h // r`` (q and k are repeated with ``repeat_interleave``, as in transformers' kernel).

Math, per row: the causal convolution of q, k and v (window from the row's true ancestors through
the plan's ``ConvWindows``; one call over the three concatenated, as transformers' single
``conv1d``), q and k L2-normalised (eps 1e-6, as ``use_qk_l2norm_in_kernel``), beta =
sigmoid(b), one scalar decay per (row, value head). The recurrence is the KDA core's (:mod:`harts_kernels.kda`)
with that decay broadcast over the key dimension, which is exactly the gated delta rule; the core
scales q by ``K ** -0.5`` as transformers' kernel does. Rounds, replay rows and differentiable
boundary-state handoffs are :func:`~harts_runtime.layers.kda.run_kda_schedule`, shared with the KDA
layer; recomputation is block-level as there.

:meth:`CompactGatedDeltaNet.forward_trajectories` is the slow reference: every trajectory through
the same layer, unshared.

Head counts are read from the weights at forward time (``Hk`` from ``q_conv1d``, ``Hv`` from
``A_log``), never from the config: a tensor-parallel rank runs the same forward on its local
shards.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from harts_runtime.errors import InvalidInputError
from harts_runtime.layers import kda as _kda
from harts_runtime.layout.conv import ConvWindows
from harts_runtime.layout.rows import RowLayout
from harts_runtime.modules.convolution import ShortConvolution, varlen_causal_conv
from harts_runtime.modules.fused import use_fla
from harts_runtime.modules.norms import GatedRMSNorm, l2_norm
from harts_runtime.options import DEFAULT_CHUNK_SIZE

__all__ = ["HF_CONCATENATED", "CompactGatedDeltaNet", "GatedDeltaNetConfig"]

_PROJECTIONS = ("fused", "split")


@dataclass(kw_only=True)
class GatedDeltaNetConfig:
    """Shape and execution options of a :class:`CompactGatedDeltaNet` (HF names in brackets)."""

    hidden_size: int
    """D, model width."""
    num_k_heads: int
    """Hk, query/key heads (``linear_num_key_heads``)."""
    num_v_heads: int
    """Hv, value heads (``linear_num_value_heads``), a multiple of ``num_k_heads``."""
    head_k_dim: int
    """K (``linear_key_head_dim``); the state is K x V per value head."""
    head_v_dim: int
    """V (``linear_value_head_dim``)."""
    conv_kernel_size: int = 4
    """w, width of the causal convolution over q, k, v (``linear_conv_kernel_dim``); must match the plan's."""
    norm_eps: float = 1e-6
    """epsilon of the gated RMS norm (``rms_norm_eps``)."""
    projection: str = "fused"
    """``"fused"``: ``in_proj_qkvz`` + ``in_proj_ba`` (Qwen3-Next); ``"split"``: ``in_proj_q``,
    ``in_proj_k``, ``in_proj_v`` (transformers' ``in_proj_qkv``), ``in_proj_z``, ``in_proj_b``,
    ``in_proj_a`` (Qwen3.5)."""
    chunk_size: int | None = None
    """B of the core. None: the plan's chunk size in :meth:`~CompactGatedDeltaNet.forward` and 64
    in :meth:`~CompactGatedDeltaNet.forward_trajectories`; an int must match the plan's."""
    backend: str = "auto"
    """core and token-wise kernels: "auto" (Triton / fla's fused kernels on CUDA, the PyTorch
    reference on CPU), "triton" or "naive"."""


HF_CONCATENATED = {
    "in_proj_qkv.weight": ("in_proj_q.weight", "in_proj_k.weight", "in_proj_v.weight"),
    "conv1d.weight": ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"),
}
"""transformers' tensors that concatenate ours on dim 0: name -> our names, its q, k and v row
blocks in order (``in_proj_qkv`` only in the split projection variant)."""


class CompactGatedDeltaNet(nn.Module):
    """Gated DeltaNet (transformers' Qwen3-Next / Qwen3.5 parameters) on compact rows."""

    def __init__(self, config: GatedDeltaNetConfig):
        super().__init__()
        c = self.config = config
        if c.projection not in _PROJECTIONS:
            raise InvalidInputError("projection", f"{c.projection!r}; choose one of {list(_PROJECTIONS)}")
        if c.num_k_heads <= 0 or c.num_v_heads % c.num_k_heads != 0:
            raise InvalidInputError(
                "num_v_heads", f"{c.num_v_heads} is not a positive multiple of num_k_heads {c.num_k_heads}"
            )
        D, Hk, Hv, K, V = c.hidden_size, c.num_k_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim
        self.key_dim, self.value_dim = Hk * K, Hv * V
        self.conv_dim = 2 * self.key_dim + self.value_dim
        if c.projection == "fused":
            self.in_proj_qkvz = nn.Linear(D, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(D, 2 * Hv, bias=False)
        else:
            self.in_proj_q = nn.Linear(D, self.key_dim, bias=False)
            self.in_proj_k = nn.Linear(D, self.key_dim, bias=False)
            self.in_proj_v = nn.Linear(D, self.value_dim, bias=False)
            self.in_proj_z = nn.Linear(D, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(D, Hv, bias=False)
            self.in_proj_a = nn.Linear(D, Hv, bias=False)
        w = c.conv_kernel_size
        self.q_conv1d = ShortConvolution(self.key_dim, w, backend=c.backend)
        self.k_conv1d = ShortConvolution(self.key_dim, w, backend=c.backend)
        self.v_conv1d = ShortConvolution(self.value_dim, w, backend=c.backend)
        self.dt_bias = nn.Parameter(torch.ones(Hv))
        self.A_log = nn.Parameter(torch.log(torch.empty(Hv).uniform_(0.01, 16)))
        self.norm = GatedRMSNorm(V, eps=c.norm_eps, activation="silu", backend=c.backend)
        self.out_proj = nn.Linear(self.value_dim, D, bias=False)
        self.register_load_state_dict_pre_hook(CompactGatedDeltaNet._split_hf_tensors)

    # ---------------------------------------------------------------- transformers' names
    @staticmethod
    def _split_hf_tensors(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        """Load-state-dict pre-hook: transformers' ``in_proj_qkv.weight`` / ``conv1d.weight`` under
        ``prefix`` -> our q, k and v tensors (views; the config's sizes)."""
        sizes = [module.key_dim, module.key_dim, module.value_dim]
        for hf, ours in HF_CONCATENATED.items():
            t = state_dict.get(prefix + hf)
            if t is None:
                continue
            if t.dim() == 0 or t.shape[0] != sum(sizes):
                errors.append(f"{prefix}{hf}: {tuple(t.shape)} has not the {sum(sizes)} rows q, k, v")
                continue
            del state_dict[prefix + hf]
            for name, part in zip(ours, torch.split(t, sizes)):
                state_dict[prefix + name] = part

    @staticmethod
    def as_hf(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensors keyed by our names (a state dict, gradients) -> keyed by transformers' (the q, k
        and v tensors concatenated into ``in_proj_qkv.weight`` / ``conv1d.weight``); other names as
        they are. A ``prefix.`` before the names is kept."""
        out = dict(tensors)
        for hf, ours in HF_CONCATENATED.items():
            for key in tensors:
                if key == ours[0] or key.endswith("." + ours[0]):
                    pre = key[: len(key) - len(ours[0])]
                    out[pre + hf] = torch.cat([out.pop(pre + n) for n in ours])
        return out

    # ---------------------------------------------------------------- token-wise parts
    def _heads(self) -> tuple[int, int]:
        """(Hk, Hv) of the weights this forward runs with (a tensor-parallel rank's local heads)."""
        return self.q_conv1d.weight.shape[0] // self.config.head_k_dim, self.A_log.shape[0]

    def _projections(self, x: torch.Tensor):
        """x [R, D] -> qkv [R, 2 Hk K + Hv V] (q, k, v channels concatenated), z [R, Hv, V],
        b [R, Hv], a [R, Hv]."""
        c = self.config
        (Hk, Hv), R, K, V = self._heads(), x.shape[0], c.head_k_dim, c.head_v_dim
        if c.projection == "split":
            # one GEMM over the three weights, as transformers' in_proj_qkv
            w = torch.cat([self.in_proj_q.weight, self.in_proj_k.weight, self.in_proj_v.weight])
            return F.linear(x, w), self.in_proj_z(x).view(R, Hv, V), self.in_proj_b(x), self.in_proj_a(x)
        r = Hv // Hk
        qkvz = self.in_proj_qkvz(x).view(R, Hk, 2 * K + 2 * r * V)
        q, k, v, z = torch.split(qkvz, [K, K, r * V, r * V], dim=2)
        b, a = torch.split(self.in_proj_ba(x).view(R, Hk, 2 * r), [r, r], dim=2)
        mixed = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)
        return mixed, z.reshape(R, Hv, V), b.reshape(R, Hv), a.reshape(R, Hv)

    def _features(self, x: torch.Tensor, windows: ConvWindows):
        """Per-row core inputs. x: [R, D] -> q, k [R, Hv, K] (L2-normalised, repeated to the value
        heads); v [R, Hv, V]; g [R, Hv] (fp32 log decay, <= 0); beta [R, Hv]; z [R, Hv, V]."""
        c = self.config
        (Hk, Hv), R, K, V = self._heads(), x.shape[0], c.head_k_dim, c.head_v_dim
        mixed, z, b, a = self._projections(x)
        # one convolution over the q, k, v channels (the three weights concatenated)
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        weight = torch.cat([m.weight[:, 0, :] for m in convs])
        mixed = varlen_causal_conv(mixed, weight, windows, "silu", c.backend)
        q, k, v = torch.split(mixed, [Hk * K, Hk * K, Hv * V], dim=1)
        q, k = (l2_norm(t.reshape(R, Hk, K), backend=c.backend) for t in (q, k))
        if Hv != Hk:
            q, k = (t.repeat_interleave(Hv // Hk, dim=1) for t in (q, k))
        if use_fla(x, c.backend):
            from fla.ops.gated_delta_rule.gate import fused_gdn_gate

            g = fused_gdn_gate(a, self.A_log, self.dt_bias)
        else:
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        beta = torch.sigmoid(b)
        return q, k, v.reshape(R, Hv, V), g, beta, z

    def _output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Gated RMS norm per value head, then the output projection. o: [R, Hv, V] -> [R, D]."""
        return self.out_proj(self.norm(o, z).flatten(1))

    # ---------------------------------------------------------------- execution
    def forward(self, x: torch.Tensor, layout: RowLayout) -> torch.Tensor:
        """x: [C, D] compact hidden states in physical order -> [C, D] layer output.

        Reads ``layout.kda`` (its replay schedule, or its no-replay schedule when
        ``layout.no_replay``). Raises :class:`InvalidInputError` when the plan's convolution width
        (or a configured chunk size) is not the layer's, or ``x`` has not the plan's row count.
        """
        c = self.config
        plan = _kda.checked_plan(layout, x, c.chunk_size, ("conv_kernel_size", c.conv_kernel_size))
        q, k, v, g, beta, z = self._features(x, plan.conv)
        sched = plan.no_replay if layout.no_replay else plan.replay
        o = _kda.run_kda_schedule(sched, q, k, v, g, beta, chunk_size=plan.chunk_size, backend=c.backend)
        return self._output(o, z)

    def forward_trajectories(
        self, x: torch.Tensor, offsets, *, chunk_size: int | None = None
    ) -> torch.Tensor:
        """Reference: every trajectory unshared. x: [S, D] semantic rows, trajectories at
        ``[offsets[j], offsets[j+1])`` -> [S, D]. One packed call from zero states, with chunk size
        ``chunk_size`` (default: the config's, else :data:`~harts_runtime.options.DEFAULT_CHUNK_SIZE`)."""
        c = self.config
        B = chunk_size or c.chunk_size or DEFAULT_CHUNK_SIZE
        offsets = np.asarray(offsets, dtype=np.int64)
        windows = ConvWindows.trajectories(offsets, c.conv_kernel_size, x.device)
        q, k, v, g, beta, z = self._features(x, windows)
        g = g.unsqueeze(-1).expand(-1, -1, c.head_k_dim)
        o, _, _ = _kda.chunk_kda_with_states(
            *(t.unsqueeze(0) for t in (q, k, v, g, beta)),
            cu_seqlens=offsets.tolist(),
            chunk_size=B,
            output_final_state=False,
            backend=c.backend,
        )
        return self._output(o.squeeze(0), z)
