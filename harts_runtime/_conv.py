"""Causal depthwise short convolution on compact rows through an index table (Section 4.2).

A packed buffer must not let a convolution window cross into an adjacent sequence, and a side
branch's history is its true ancestors, not whatever precedes it in the buffer. Both are met by
gathering each row's window explicitly: ``conv_index [C, w]`` lists, for every output row, the
rows at positions ``p - w + 1 .. p`` on its own ancestry path (oldest first; -1 where the
position is negative, read as zeros). The convolution then runs once per compact row, and the
gather's backward accumulates every consumer's gradient at the unique producer row.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, conv_index: torch.Tensor, activation: str | None = "silu"
) -> torch.Tensor:
    """``y[c] = act(sum_i weight[:, i] * x[conv_index[c, i]])`` (zeros where the index is -1).

    x: [C, D]; weight: [D, w] (depthwise, no bias; ``weight[:, -1]`` multiplies the row itself);
    conv_index: [C_out, w] int64. Returns [C_out, D].
    """
    xp = torch.cat([x, x.new_zeros(1, x.shape[1])], 0)  # row C = zero pad
    idx = torch.where(conv_index < 0, torch.full_like(conv_index, x.shape[0]), conv_index)
    windows = xp[idx]  # [C_out, w, D]
    y = torch.einsum("cwd,dw->cd", windows, weight.to(x.dtype))
    return F.silu(y) if activation == "silu" else y


def sequence_conv_index(row_ranges: np.ndarray, context: np.ndarray, num_rows: int) -> np.ndarray:
    """Window table for rows grouped into sequences with explicit left context.

    row_ranges: [Q, 2] int, sequence q owns rows ``[lo, hi)`` in position order (ranges disjoint,
    covering ``num_rows`` rows); context: [Q, w - 1] int, the rows before each sequence's first
    row (oldest first, -1 = none). Returns int64 [num_rows, w].
    """
    row_ranges = np.asarray(row_ranges, dtype=np.int64).reshape(-1, 2)
    context = np.asarray(context, dtype=np.int64).reshape(len(row_ranges), -1)
    w = context.shape[1] + 1
    out = np.full((num_rows, w), -1, dtype=np.int64)
    lengths = row_ranges[:, 1] - row_ranges[:, 0]
    # ext[q] = context[q] ++ arange(lo, hi); out[lo + t] = ext[q][t : t + w]
    rows = (
        np.concatenate([np.arange(lo, hi) for lo, hi in row_ranges])
        if len(row_ranges)
        else np.zeros(0, np.int64)
    )
    seq = np.repeat(np.arange(len(row_ranges)), lengths)
    t = rows - row_ranges[seq, 0]  # offset inside the sequence
    for i in range(w):
        e = t + i  # index into ext
        from_ctx = e < w - 1
        val = np.where(
            from_ctx, context[seq, np.minimum(e, w - 2)] if w > 1 else -1, row_ranges[seq, 0] + e - (w - 1)
        )
        out[rows, i] = val
    return out


def trajectory_conv_index(offsets: np.ndarray, width: int) -> np.ndarray:
    """Window table for plain packed trajectories (no shared history): int64 [S, width]."""
    offsets = np.asarray(offsets, dtype=np.int64)
    ranges = np.stack([offsets[:-1], offsets[1:]], 1)
    ctx = np.full((len(ranges), width - 1), -1, dtype=np.int64)
    return sequence_conv_index(ranges, ctx, int(offsets[-1]))
