"""Gated full attention on compact rows: the full-attention layer of Qwen3-Next and Qwen3.5
(transformers' ``Qwen3NextAttention`` / ``Qwen3_5MoeAttention``; their parameter names, so a state
dict loads as is).

Per row (once per compact row, as :class:`~harts_runtime.layers.attention.CompactAttention`):

* ``q_proj`` gives ``[Hq, 2 * Dh]`` per row; each head's first ``Dh`` values are its query, the
  last ``Dh`` its output gate (transformers: ``chunk(q_proj(x).view(..., Hq, 2 * Dh), 2, -1)``);
* ``q_norm`` / ``k_norm``: zero-centred RMSNorm over each head's ``Dh`` (``x * (1 + w)``), before RoPE;
* partial rotate-half RoPE at the row's absolute trajectory position on each head's first
  ``rotary_dim = int(Dh * partial_rotary_factor)`` dims (the rest pass through), frequencies
  ``theta ** (-2i / rotary_dim)``. Qwen3.5's interleaved M-RoPE reduces to this for text, where the
  three position components are equal;
* the core is :func:`harts_runtime.ops.attention.compact_attention` over the layout's ancestor-KV
  views (GQA: query head ``h`` reads KV head ``h // (Hq / Hkv)``), softmax scale ``Dh ** -0.5``;
* ``o_proj(attn * sigmoid(gate))``, the gate per query head and dim.

Head counts (Hq, Hkv) are read from the projection weights at forward time, never from the config:
a tensor-parallel rank runs the same forward on its local heads' shards
(:mod:`harts_runtime.parallel.plans`).

Not covered: the KV cache, attention dropout, RoPE scaling types other than the default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from harts_runtime.errors import InvalidInputError
from harts_runtime.layers.attention import AttentionConfig, CompactAttentionBase
from harts_runtime.layout.rows import RowLayout
from harts_runtime.modules.norms import RMSNorm
from harts_runtime.modules.rope import apply_rope, rope_cos_sin
from harts_runtime.ops.attention import compact_attention, trajectory_attention

__all__ = ["CompactGatedAttention", "GatedAttentionConfig"]


@dataclass(kw_only=True)
class GatedAttentionConfig(AttentionConfig):
    """Gated GQA with per-head zero-centred q/k norms and partial RoPE (Qwen3-Next, Qwen3.5).

    From a transformers ``Qwen3NextConfig`` ``c``: ``hidden_size=c.hidden_size,
    num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
    rope_theta=c.rope_parameters["rope_theta"],
    partial_rotary_factor=c.rope_parameters["partial_rotary_factor"], rms_norm_eps=c.rms_norm_eps,
    attention_bias=c.attention_bias``.
    """

    partial_rotary_factor: float = 0.25
    """Fraction of each head's dims that RoPE rotates (Qwen3-Next and Qwen3.5: 0.25)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of ``q_norm`` and ``k_norm``."""
    attention_bias: bool = False
    """Biases on q/k/v/o projections (transformers' ``attention_bias``)."""

    def __post_init__(self):
        super().__post_init__()
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise InvalidInputError(
                "partial_rotary_factor",
                f"{self.partial_rotary_factor} of head_dim={self.head_dim} gives rotary_dim={self.rotary_dim}; "
                "need an even rotary_dim in (0, head_dim]",
            )

    @property
    def rotary_dim(self) -> int:
        """Rotated dims per head: ``int(head_dim * partial_rotary_factor)`` (transformers' rule)."""
        return int(self.head_dim * self.partial_rotary_factor)


class CompactGatedAttention(CompactAttentionBase):
    """Qwen3-Next / Qwen3.5 gated full attention on compact rows (``forward(x [N, D], layout)``)."""

    def __init__(self, config: GatedAttentionConfig):
        super().__init__()
        c = config
        self.config, self.backend = c, c.backend
        bias = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, zero_centered=True)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, zero_centered=True)
        self.scale = c.head_dim**-0.5
        self.head_dims = (c.head_dim, c.head_dim)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.config.rotary_dim
        if r == x.shape[-1]:
            return apply_rope(x, cos, sin)
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def project_gated(self, hidden: torch.Tensor, positions: torch.Tensor):
        """hidden [N, D], positions [N] -> q [N, Hq, Dh], k, v [N, Hkv, Dh], gate [N, Hq * Dh].

        Hq and Hkv are the weights' (a tensor-parallel rank's local heads), not the config's."""
        c, n, dh = self.config, hidden.shape[0], self.config.head_dim
        hq, hkv = self.q_proj.weight.shape[0] // (2 * dh), self.k_proj.weight.shape[0] // dh
        q, gate = self.q_proj(hidden).view(n, hq, 2 * dh).chunk(2, dim=-1)
        cos, sin = rope_cos_sin(positions, c.rotary_dim, c.rope_theta)
        q = self._rope(self.q_norm(q), cos, sin)
        k = self._rope(self.k_norm(self.k_proj(hidden).view(n, hkv, dh)), cos, sin)
        v = self.v_proj(hidden).view(n, hkv, dh)
        return q, k, v, gate.flatten(1)

    def project(self, hidden: torch.Tensor, positions: torch.Tensor):
        """The base's per-row projection (q, k, v after norms and RoPE); the gate is dropped."""
        return self.project_gated(hidden, positions)[:3]

    def _output(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.o_proj(o.flatten(1) * torch.sigmoid(gate))

    def forward(self, hidden: torch.Tensor, layout: RowLayout, backend: str | None = None) -> torch.Tensor:
        """hidden [C, D] rows of ``layout`` (its ``views`` and ``positions``) -> [C, D]."""
        q, k, v, gate = self.project_gated(hidden, layout.need("positions"))
        o = compact_attention(
            q, k, v, layout.need("views"), backend=backend or self.backend, scale=self.scale
        )
        return self._output(o, gate)

    def forward_trajectory(self, hidden: torch.Tensor) -> torch.Tensor:
        """Trajectory-wise reference: hidden [L, D] of one trajectory -> [L, D], plain causal."""
        positions = torch.arange(hidden.shape[0], device=hidden.device)
        q, k, v, gate = self.project_gated(hidden, positions)
        return self._output(trajectory_attention(q, k, v, self.scale), gate)
