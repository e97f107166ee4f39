"""Ops the layers call: :mod:`~harts_runtime.ops.attention` (compact attention and its backends)."""

from harts_runtime.ops.attention import BACKENDS, available_backends, compact_attention, trajectory_attention

__all__ = ["BACKENDS", "available_backends", "compact_attention", "trajectory_attention"]
