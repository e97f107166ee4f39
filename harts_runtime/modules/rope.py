"""Rotary position embedding (RoPE) at each compact token's original trajectory position.

A compact row stands for every semantic position that shares its token prefix, and all of them sit
at the same absolute position in their trajectories (``RolloutBatch.row_depth``). RoPE therefore runs
once per compact row with that position, before any ancestor-KV view is gathered (paper Section 4.2,
"MLA execution with asymmetric packed Q/KV views"); the gathered keys carry their own positions, so
no per-view position bookkeeping is needed.

Convention: "rotate half" (GPT-NeoX / Llama / Megatron non-interleaved): the rotary dimension is
split into two halves ``x = [x1, x2]`` and rotated as ``[x1 cos - x2 sin, x2 cos + x1 sin]`` with
frequency ``theta ** (-2i / dim)`` for pair ``i``.

Interleaved (:func:`apply_rope_interleaved`, DeepSeek-V3 / Ling-3.0 MLA): pair ``i`` is
``(x[2i], x[2i+1])``, rotated by the same frequency; the result is laid out de-interleaved,
``[x_even cos - x_odd sin, x_odd cos + x_even sin]`` (transformers'
``apply_rotary_pos_emb_interleave``). Queries and keys get the same layout, so their dot products
are those of the interleaved rotation.
"""

from __future__ import annotations

import torch

from harts_runtime.errors import InvalidInputError

__all__ = ["apply_rope", "apply_rope_interleaved", "rope_cos_sin"]


def rope_cos_sin(
    positions: torch.Tensor, dim: int, theta: float = 10_000.0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables for the given positions.

    Parameters
    ----------
    positions : Tensor, int, shape [N]
        Absolute position of every row (compact rows: ``row_depth``; a trajectory: ``arange(L)``).
    dim : int
        Rotary dimension (even).
    theta : float
        RoPE base.
    dtype : torch.dtype
        dtype of the returned tables (the angles are computed in float32).

    Returns
    -------
    (cos, sin) : Tensor, shape [N, dim] each, on ``positions.device``.
    """
    if dim % 2:
        raise InvalidInputError("dim", f"the rotary dimension must be even, got {dim}")
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [N, dim / 2]
    angles = torch.cat([angles, angles], dim=-1)  # [N, dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [N, H, dim] by the tables ``cos``, ``sin`` [N, dim] (rotate-half convention).

    Returns a new tensor [N, H, dim] of ``x.dtype``; differentiable in ``x``.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return x * cos + rotated * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the interleaved pairs ``(x[2i], x[2i+1])`` of ``x`` [N, H, dim] by the tables of
    :func:`rope_cos_sin` (their first half holds pair ``i``'s angle); returns [N, H, dim] of
    ``x.dtype``, laid out ``[evens rotated | odds rotated]`` (module docstring)."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :half].to(x.dtype), sin[:, None, :half].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
