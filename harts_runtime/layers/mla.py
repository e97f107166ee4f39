"""Multi-head latent attention on compact rows (DeepSeek-V2/V3; paper Sections 3.4 and 4.2).

Latent projections and RoPE run once per row; the core is the same compact-attention op as MHA's
(:class:`harts_runtime.layers.attention.CompactAttentionBase`). Simplifications: the rotary key part
is shared by all heads; RMSNorm on the latents; no YaRN / mscale; the rotate-half RoPE convention
(:mod:`harts_runtime.modules.rope`); no weight absorption (that only matters for decoding); no
dropout. The attention core sees ``Dqk = qk_nope + qk_rope`` against ``Dv = v_head_dim``, exactly
the asymmetric case the backends must support.

Ling-3.0's MLA (transformers ``BailingHybridAttention``): ``rope_interleave=True`` rotates the
interleaved pairs (:func:`~harts_runtime.modules.rope.apply_rope_interleaved`, DeepSeek-V3's
layout) and ``output_gate=True`` adds ``g_proj`` [H, D], a sigmoid gate per row and head on the
core output before ``o_proj``: ``o_proj(o * sigmoid(g_proj(x))[:, :, None])``.

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
from harts_runtime.modules.rope import apply_rope, apply_rope_interleaved, rope_cos_sin

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
    rope_interleave: bool = False
    """Rotate interleaved pairs (DeepSeek-V3, Ling-3.0) instead of halves."""
    output_gate: bool = False
    """Ling-3.0's head-wise sigmoid output gate ``g_proj`` [H, D]."""
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
        if c.output_gate:
            self.g_proj = nn.Linear(c.hidden_size, c.num_heads, bias=False)
        self.scale = dqk**-0.5
        self.head_dims = (dqk, c.v_head_dim)

    def _rotate(self, positions: torch.Tensor):
        c = self.config
        if not c.use_rope:
            return lambda t: t
        cos, sin = rope_cos_sin(positions, c.qk_rope_head_dim, c.rope_theta)
        turn = apply_rope_interleaved if c.rope_interleave else apply_rope
        return lambda t: turn(t, cos, sin)

    def queries(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """hidden [N, D], positions [N] -> q [N, H, Dqk] (the RoPE part rotated). H is the query
        weights' (a tensor-parallel rank's local heads)."""
        c, n = self.config, hidden.shape[0]
        nope, rope = c.qk_nope_head_dim, c.qk_rope_head_dim
        if c.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(hidden)))
        q = q.view(n, q.shape[-1] // (nope + rope), nope + rope)
        return torch.cat([q[..., :nope], self._rotate(positions)(q[..., nope:])], dim=-1)

    def latent(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> the compressed KV latent and the shared rotary key, [N, r_kv + rope]
        (what context parallelism gathers instead of K / V)."""
        return self.kv_a_proj(hidden)

    def keys_values(self, kv_a: torch.Tensor, positions: torch.Tensor):
        """The latent rows ``kv_a`` [N, r_kv + rope] (:meth:`latent`), positions [N] -> k [N, H,
        Dqk], v [N, H, Dv]. H is ``kv_b_proj``'s rows' (local heads under TP or CP)."""
        c, n = self.config, kv_a.shape[0]
        nope, rope = c.qk_nope_head_dim, c.qk_rope_head_dim
        h = self.kv_b_proj.weight.shape[0] // (nope + c.v_head_dim)
        k_rope = self._rotate(positions)(kv_a[:, None, c.kv_lora_rank :])  # [N, 1, rope]
        kv = self.kv_b_proj(self.kv_a_norm(kv_a[:, : c.kv_lora_rank])).view(n, h, nope + c.v_head_dim)
        k = torch.cat([kv[..., :nope], k_rope.expand(n, h, rope)], dim=-1)  # [N, H, Dqk]
        return k, kv[..., nope:]

    def project(self, hidden: torch.Tensor, positions: torch.Tensor):
        """hidden [N, D], positions [N] -> q [N, H, Dqk], k [N, H, Dqk], v [N, H, Dv]
        (:meth:`queries`, :meth:`keys_values` of :meth:`latent`)."""
        return self.queries(hidden, positions), *self.keys_values(self.latent(hidden), positions)

    def out_project(self, o: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """o [N, H, Dv] -> [N, D]: ``o_proj``, after the head-wise gate ``sigmoid(g_proj(hidden))``
        (float32 sigmoid, as transformers) when ``output_gate``."""
        if self.config.output_gate:
            gate = torch.sigmoid(self.g_proj(hidden).float()).to(o.dtype)
            o = o * gate[:, :, None]
        return self.o_proj(o.flatten(1))
