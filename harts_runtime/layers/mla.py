"""Multi-head latent attention on compact rows (DeepSeek-V2/V3; paper Sections 3.4 and 4.2).

Latent projections and RoPE run once per row; the core is the same compact-attention op as MHA's
(:class:`harts_runtime.layers.attention.CompactAttentionBase`). Simplifications: the rotary key part
is shared by all heads; RMSNorm on the latents; no YaRN / mscale; the rotate-half RoPE convention
(:mod:`harts_runtime.modules.rope`); no weight absorption (that only matters for decoding); no
dropout. The attention core sees ``Dqk = qk_nope + qk_rope`` against ``Dv = v_head_dim``, exactly
the asymmetric case the backends must support.

``use_rope=False`` is Kimi-Linear's MLA (NoPE): the same projections and split, the
``qk_rope_head_dim`` part of the queries and of the shared key is used as projected, unrotated.

The head count is read from ``kv_b_proj``'s rows at forward time, never from the config: a
tensor-parallel rank runs the same forward on its local heads' shards
(:mod:`harts_runtime.parallel.plans`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from harts_runtime.layers.attention import CompactAttentionBase
from harts_runtime.modules.rope import apply_rope, rope_cos_sin

__all__ = ["CompactMLA", "MLAConfig"]


@dataclass(kw_only=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3 style; simplifications in the module docstring)."""

    hidden_size: int
    """Model width D."""
    num_heads: int
    """Heads H (queries and keys/values alike)."""
    kv_lora_rank: int
    """Width of the compressed KV latent."""
    qk_nope_head_dim: int
    """Per-head query/key dims without RoPE."""
    qk_rope_head_dim: int
    """Per-head query/key dims with RoPE (the key part is shared by all heads)."""
    v_head_dim: int
    """Per-head value dim (may differ from ``qk_nope + qk_rope``)."""
    q_lora_rank: int | None = None
    """Width of the compressed query latent (None: a direct query projection)."""
    rope_theta: float = 10_000.0
    """RoPE base."""
    use_rope: bool = True
    """Rotate the ``qk_rope_head_dim`` parts (False: NoPE, as Kimi-Linear; positions unused)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon on the latents."""
    backend: str = "reference"
    """Default key of :data:`harts_runtime.ops.attention.BACKENDS`."""


class CompactMLA(CompactAttentionBase):
    """MLA on compact rows: latent projections and RoPE per row, asymmetric Q/K vs V head dims."""

    def __init__(self, config: MLAConfig):
        super().__init__()
        c = config
        self.config, self.backend = c, c.backend
        dqk = c.qk_nope_head_dim + c.qk_rope_head_dim
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, c.num_heads * dqk, bias=False)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
            self.q_a_norm = nn.RMSNorm(c.q_lora_rank, eps=c.norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, c.num_heads * dqk, bias=False)
        self.kv_a_proj = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_norm = nn.RMSNorm(c.kv_lora_rank, eps=c.norm_eps)
        self.kv_b_proj = nn.Linear(
            c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(c.num_heads * c.v_head_dim, c.hidden_size, bias=False)
        self.scale = dqk**-0.5
        self.head_dims = (dqk, c.v_head_dim)

    def project(self, hidden: torch.Tensor, positions: torch.Tensor):
        """hidden [N, D], positions [N] -> q [N, H, Dqk], k [N, H, Dqk], v [N, H, Dv].

        H is the weights' (a tensor-parallel rank's local heads), not the config's."""
        c, n = self.config, hidden.shape[0]
        nope, rope = c.qk_nope_head_dim, c.qk_rope_head_dim
        h = self.kv_b_proj.weight.shape[0] // (nope + c.v_head_dim)
        if c.use_rope:
            cos, sin = rope_cos_sin(positions, rope, c.rope_theta)
            rotate = lambda t: apply_rope(t, cos, sin)
        else:
            rotate = lambda t: t
        if c.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(hidden)))
        q = q.view(n, h, nope + rope)
        q = torch.cat([q[..., :nope], rotate(q[..., nope:])], dim=-1)
        kv_a = self.kv_a_proj(hidden)  # [N, r_kv + rope]
        k_rope = rotate(kv_a[:, None, c.kv_lora_rank :])  # [N, 1, rope]
        kv = self.kv_b_proj(self.kv_a_norm(kv_a[:, : c.kv_lora_rank])).view(n, h, nope + c.v_head_dim)
        k = torch.cat([kv[..., :nope], k_rope.expand(n, h, rope)], dim=-1)  # [N, H, Dqk]
        v = kv[..., nope:]  # [N, H, Dv]
        return q, k, v
