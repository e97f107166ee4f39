"""Window tables of the causal short convolution on compact rows (Section 4.2).

A packed buffer must not let a convolution window cross into an adjacent sequence, and a side
branch's history is its true ancestors, not whatever precedes it in the buffer. Both are met by
gathering each row's window explicitly: ``conv_index [C, w]`` lists, for every output row, the
rows at positions ``p - w + 1 .. p`` on its own ancestry path (oldest first; -1 where the
position is negative, read as zeros). The convolution itself
(:class:`harts_runtime.modules.convolution.ShortConvolution`) then runs once per compact row, and
the gather's backward accumulates every consumer's gradient at the unique producer row.

Built on the host (numpy, int64) once per microbatch; O(C * w).

The fused GPU path reads the same windows in the form of fla's varlen convolution kernel:
:class:`ConvWindows` keeps the rows grouped into sequences that are contiguous in physical order
(``cu_seqlens``) and, per sequence, its ``w - 1`` context rows (the true-ancestor rows before its
first own row), which become the kernel's per-sequence initial state. Both forms describe the
same windows (:meth:`ConvWindows.index` is the table of the other).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from harts_runtime.errors import InvalidInputError

__all__ = ["ConvWindows", "sequence_conv_index"]

_TRAJECTORY_WINDOWS: dict = {}


@dataclass
class ConvWindows:
    """The short convolution's windows of one microbatch, in both forms (host-built, then moved).

    * ``index`` [C, w] int64: the window table (:func:`sequence_conv_index`), read by the
      reference gather path; built on first use (the fused path never needs it);
    * ``cu_seqlens`` [N + 1] int32 (device) and ``cu_seqlens_cpu`` (host): sequences of rows
      contiguous in physical order covering all C rows; ``context`` [N, w - 1] int64: the rows
      before each sequence's first row (oldest first, -1 = zeros), or None when no sequence has
      context (plain trajectories); read by the fused kernel path.
    """

    width: int
    num_rows: int
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    context: torch.Tensor | None
    context_cpu: np.ndarray | None = None
    _index: torch.Tensor | None = None
    _padded: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def index(self) -> torch.Tensor:
        if self._index is None:
            cu = self.cu_seqlens_cpu.numpy().astype(np.int64)
            ranges = np.stack([cu[:-1], cu[1:]], 1)
            ctx = self.context_cpu
            if ctx is None:
                ctx = np.full((len(ranges), self.width - 1), -1, dtype=np.int64)
            if len(ranges):
                table = torch.from_numpy(sequence_conv_index(ranges, ctx, self.num_rows))
            else:  # no rows (an empty microbatch: DP padding)
                table = torch.zeros((0, self.width), dtype=torch.int64)
            self._index = table.to(self.cu_seqlens.device)
        return self._index

    @classmethod
    def from_sequences(cls, row_ranges, context, num_rows: int, width: int) -> ConvWindows:
        """``row_ranges`` [N, 2] (disjoint, covering ``num_rows`` rows), ``context`` [N, w - 1]
        (-1 = none). Raises :class:`InvalidInputError` (``field="conv"``) when the ranges do not
        tile the rows."""
        rr = np.asarray(row_ranges, dtype=np.int64).reshape(-1, 2)
        ctx = np.asarray(context, dtype=np.int64).reshape(len(rr), width - 1)
        order = np.argsort(rr[:, 0], kind="stable")
        rr, ctx = rr[order], ctx[order]
        keep = rr[:, 1] != rr[:, 0]  # empty sequences have no windows
        rr, ctx = rr[keep], ctx[keep]
        cu = np.concatenate([rr[:, 0], [num_rows]]) if len(rr) else np.zeros(1, np.int64)
        if len(rr) and (cu[0] != 0 or not np.array_equal(rr[:, 1], cu[1:]) or np.any(rr[:, 1] < rr[:, 0])):
            raise InvalidInputError("conv", "the sequences' row ranges must tile the physical rows")
        if len(ctx) and (ctx.min(initial=-1) < -1 or ctx.max(initial=-1) >= num_rows):
            raise InvalidInputError("conv", f"context rows must lie in [-1, {num_rows})")
        cu_cpu = torch.from_numpy(cu.astype(np.int32))
        has_ctx = bool((ctx >= 0).any())
        return cls(
            width,
            num_rows,
            cu_cpu.clone(),
            cu_cpu,
            torch.from_numpy(ctx) if has_ctx else None,
            ctx if has_ctx else None,
        )

    @classmethod
    def from_offsets(cls, offsets, width: int) -> ConvWindows:
        """Plain packed trajectories ``[offsets[j], offsets[j + 1])``: no context."""
        offsets = np.asarray(offsets, dtype=np.int64)
        ranges = np.stack([offsets[:-1], offsets[1:]], 1)
        ctx = np.full((len(ranges), width - 1), -1, dtype=np.int64)
        return cls.from_sequences(ranges, ctx, int(offsets[-1]), width)

    @classmethod
    def trajectories(cls, offsets, width: int, device=None) -> ConvWindows:
        """:meth:`from_offsets` on ``device``, cached per (offsets, width, device): every layer of
        a step asks for the same windows."""
        key = (tuple(int(o) for o in np.asarray(offsets).reshape(-1)), int(width), str(device))
        win = _TRAJECTORY_WINDOWS.get(key)
        if win is None:
            win = cls.from_offsets(key[0], width)
            win = win.to(device) if device is not None else win
            _TRAJECTORY_WINDOWS[key] = win
            while len(_TRAJECTORY_WINDOWS) > 16:
                _TRAJECTORY_WINDOWS.pop(next(iter(_TRAJECTORY_WINDOWS)))
        return win

    def padded(self, bucket: int) -> ConvWindows:
        """These windows over ``ceil(num_rows / bucket) * bucket`` rows: the rows past
        ``num_rows`` form one extra sequence without context (itself when nothing is added).
        Cached per bucket: every layer of a microbatch pads alike."""
        pad = -self.num_rows % bucket
        if pad == 0 or self.num_rows == 0:
            return self
        win = self._padded.get(bucket)
        if win is None:
            n = self.num_rows + pad
            cu_cpu = torch.cat([self.cu_seqlens_cpu, torch.tensor([n], dtype=self.cu_seqlens_cpu.dtype)])
            ctx, ctx_cpu = self.context, self.context_cpu
            if ctx is not None:
                assert ctx_cpu is not None  # the host copy of ctx
                none = np.full((1, self.width - 1), -1, dtype=np.int64)
                ctx_cpu = np.concatenate([ctx_cpu, none])
                ctx = torch.cat([ctx, torch.from_numpy(none).to(ctx.device)])
            win = ConvWindows(self.width, n, cu_cpu.to(self.cu_seqlens.device), cu_cpu, ctx, ctx_cpu)
            self._padded[bucket] = win
        return win

    def to(self, device) -> ConvWindows:
        return ConvWindows(
            self.width,
            self.num_rows,
            self.cu_seqlens.to(device),
            self.cu_seqlens_cpu,
            None if self.context is None else self.context.to(device),
            self.context_cpu,
            None if self._index is None else self._index.to(device),
        )


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
