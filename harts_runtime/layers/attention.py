"""MHA / GQA self-attention on compact rows (paper Sections 3.4 and 4.2).

Projections and RoPE run once per row (RoPE at the row's absolute trajectory position,
``layout.positions``), the core is :func:`harts_runtime.ops.attention.compact_attention` over the
layout's ancestor-KV views (``layout.views``), and the output projection runs once per row. No
bias; rotate-half RoPE on all head dims. :class:`CompactAttentionBase` is shared with MLA.

Head counts (Hq, Hkv) are read from the projection weights at forward time, never from the config:
a tensor-parallel rank runs the same forward on its local heads' shards
(:mod:`harts_runtime.parallel.plans`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from harts_runtime.errors import InvalidInputError
from harts_runtime.layout.rows import RowLayout
from harts_runtime.modules.rope import apply_rope, rope_cos_sin
from harts_runtime.ops.attention import compact_attention, trajectory_attention

__all__ = ["AttentionConfig", "CompactAttention", "CompactAttentionBase"]


@dataclass(kw_only=True)
class AttentionConfig:
    """Multi-head / grouped-query self-attention."""

    hidden_size: int
    """Model width D."""
    num_heads: int
    """Query heads Hq."""
    num_kv_heads: int | None = None
    """KV heads Hkv (None: MHA, ``Hkv = Hq``; fewer: GQA; 1: MQA)."""
    head_dim: int | None = None
    """Per-head dim (None: ``hidden_size // num_heads``)."""
    rope_theta: float = 10_000.0
    """RoPE base."""
    use_rope: bool = True
    """Rotate q and k (False: no positional encoding in the layer, as Nemotron-H's attention)."""
    backend: str = "reference"
    """Default key of :data:`harts_runtime.ops.attention.BACKENDS`."""

    def __post_init__(self):
        self.num_kv_heads = self.num_kv_heads or self.num_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise InvalidInputError(
                "num_kv_heads", f"{self.num_kv_heads} does not divide num_heads={self.num_heads}"
            )


class CompactAttentionBase(nn.Module):
    """Shared forward: ``project`` (per row) -> core -> ``o_proj`` (per row)."""

    backend: str
    head_dims: tuple[int, int]
    """The core's (Dqk, Dv): what ``backend="auto"`` is resolved for."""

    def project(self, hidden: torch.Tensor, positions: torch.Tensor):
        raise NotImplementedError

    def forward(self, hidden: torch.Tensor, layout: RowLayout, backend: str | None = None) -> torch.Tensor:
        """hidden [C, D] rows of ``layout`` (its ``views`` and ``positions``) -> [C, D]."""
        q, k, v = self.project(hidden, layout.need("positions"))
        o = compact_attention(
            q, k, v, layout.need("views"), backend=backend or self.backend, scale=self.scale
        )
        return self.out_project(o, hidden)

    def forward_trajectory(self, hidden: torch.Tensor) -> torch.Tensor:
        """Trajectory-wise reference: hidden [L, D] of one trajectory -> [L, D], plain causal."""
        positions = torch.arange(hidden.shape[0], device=hidden.device)
        q, k, v = self.project(hidden, positions)
        o = trajectory_attention(q, k, v, self.scale)
        return self.out_project(o, hidden)

    def out_project(self, o: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Core output o [N, H, Dv] of the rows ``hidden`` [N, D] -> [N, D]: ``o_proj`` (a layer
        with an output gate on ``hidden`` overrides it)."""
        return self.o_proj(o.flatten(1))


class CompactAttention(CompactAttentionBase):
    """MHA / GQA self-attention on compact rows (no bias; rotate-half RoPE on all head dims, or none)."""

    def __init__(self, config: AttentionConfig):
        super().__init__()
        c = config
        self.config, self.backend = c, c.backend
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.scale = c.head_dim**-0.5
        self.head_dims = (c.head_dim, c.head_dim)

    def project(self, hidden: torch.Tensor, positions: torch.Tensor):
        """hidden [N, D], positions [N] -> q [N, Hq, Dh], k [N, Hkv, Dh], v [N, Hkv, Dh].

        Hq and Hkv are the weights' (a tensor-parallel rank's local heads), not the config's."""
        c, n, dh = self.config, hidden.shape[0], self.config.head_dim
        hq, hkv = self.q_proj.weight.shape[0] // dh, self.k_proj.weight.shape[0] // dh
        q, k = self.q_proj(hidden).view(n, hq, dh), self.k_proj(hidden).view(n, hkv, dh)
        if c.use_rope:
            cos, sin = rope_cos_sin(positions, dh, c.rope_theta)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = self.v_proj(hidden).view(n, hkv, dh)
        return q, k, v
