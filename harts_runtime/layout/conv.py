"""Window tables of the causal short convolution on compact rows (Section 4.2).

A packed buffer must not let a convolution window cross into an adjacent sequence, and a side
branch's history is its true ancestors, not whatever precedes it in the buffer. Both are met by
gathering each row's window explicitly: ``conv_index [C, w]`` lists, for every output row, the
rows at positions ``p - w + 1 .. p`` on its own ancestry path (oldest first; -1 where the
position is negative, read as zeros). The convolution itself
(:class:`harts_runtime.modules.convolution.ShortConvolution`) then runs once per compact row, and
the gather's backward accumulates every consumer's gradient at the unique producer row.

Built on the host (numpy, int64) once per microbatch; O(C * w).
"""

from __future__ import annotations

import numpy as np

__all__ = ["sequence_conv_index", "trajectory_conv_index"]


def sequence_conv_index(row_ranges: np.ndarray, context: np.ndarray, num_rows: int) -> np.ndarray:
    """Window table for rows grouped into sequences with explicit left context.

    row_ranges: [Q, 2] int, sequence q owns rows ``[lo, hi)`` in position order (ranges disjoint,
    covering ``num_rows`` rows); context: [Q, w - 1] int (or flat), the rows before each sequence's
    first row (oldest first, -1 = none). Returns int64 [num_rows, w].
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
