"""Log-probabilities of materialised compact logits ``[C, V]`` (:mod:`harts_runtime.loss.logprobs`
states the mapped cross-entropy): the targets (:class:`LogProbTargets`), :func:`mapped_logprobs`
(with an optional tensor-parallel vocabulary group) and the expanded reference
:func:`expanded_logprobs`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_CHUNK",
    "LogProbTargets",
    "MappedLogProbs",
    "expanded_logprobs",
    "mapped_logprobs",
    "targets_from_batch",
]

DEFAULT_CHUNK = 8192
"""Vocabulary columns per chunk of :func:`mapped_logprobs`: temporaries are [C, chunk] float32."""


@dataclass(frozen=True)
class LogProbTargets:
    """The semantic side of mapped log-probs, in original batch order (O(S) integers).

    Attributes
    ----------
    row_index : Tensor, int64, shape [P]
        Compact logit row ``m(s)`` of every non-terminal semantic position.
    labels : Tensor, int64, shape [P]
        Next token ``y_s``.
    positions : Tensor, int64, shape [P]
        Flat semantic index ``s`` (``offsets[i] + p``) of each entry.
    cu_seqlens : Tensor, int64, shape [N + 1]
        Trajectory ``i`` owns entries ``[cu_seqlens[i], cu_seqlens[i + 1])`` (its ``len - 1``
        positions).
    num_semantic : int
        S.
    """

    row_index: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    num_semantic: int

    def to(self, device) -> LogProbTargets:
        return LogProbTargets(
            self.row_index.to(device),
            self.labels.to(device),
            self.positions.to(device),
            self.cu_seqlens.to(device),
            self.num_semantic,
        )

    def to_semantic(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Scatter [P] values to [S] semantic positions (terminal positions get ``fill``)."""
        out = values.new_full((self.num_semantic,), fill)
        return out.index_copy(0, self.positions, values)


def targets_from_batch(batch) -> LogProbTargets:
    """Next-token targets of a :class:`harts_planner.RolloutBatch`: for each trajectory, positions
    ``0 .. len - 2`` with the row ``compact_map[s]`` and label ``tokens[s + 1]``."""
    off = np.asarray(batch.offsets, dtype=np.int64)
    s = int(off[-1])
    terminal = np.zeros(s, dtype=bool)
    terminal[off[1:] - 1] = True
    positions = np.nonzero(~terminal)[0]
    rows = np.asarray(batch.compact_map, dtype=np.int64)[positions]
    labels = np.asarray(batch.tokens, dtype=np.int64)[positions + 1]
    cu = off - np.arange(len(off), dtype=np.int64)
    t = torch.from_numpy
    return LogProbTargets(t(rows), t(labels), t(positions), t(cu), s)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _owned(labels: torch.Tensor, vocab_start: int, v: int):
    """Local column of every label and whether this rank's ``[vocab_start, vocab_start + v)`` has it."""
    local = labels - vocab_start
    return local, (local >= 0) & (local < v)


def _combine_over_group(lse_local: torch.Tensor, target: torch.Tensor, group):
    """The two collectives of the module docstring: ``(global lse [C], summed target [P])``."""
    n = lse_local.numel()
    top = lse_local.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)  # C scalars
    buf = torch.cat([torch.exp(lse_local - top), target])
    dist.all_reduce(buf, group=group)  # C + P scalars
    return top + buf[:n].log(), buf[n:]


def _row_logsumexp(logits: torch.Tensor, chunk: int) -> torch.Tensor:
    """[C] logsumexp over the columns (float32; float64 for float64 logits), an online max/sum-exp
    over column chunks."""
    c, v = logits.shape
    dt = _compute_dtype(logits.dtype)
    m = torch.full((c,), float("-inf"), device=logits.device, dtype=dt)
    acc = torch.zeros(c, device=logits.device, dtype=dt)
    for a in range(0, v, chunk):
        z = logits[:, a : a + chunk].to(dt)  # [C, chunk]
        m_new = torch.maximum(m, z.amax(1))
        acc = acc * torch.exp(m - m_new) + torch.exp(z - m_new[:, None]).sum(1)
        m = m_new
    return m + acc.log()


class MappedLogProbs(torch.autograd.Function):
    """``lambda = logits[row_index, labels] - logsumexp(logits)[row_index]`` without S x V tensors.

    forward(logits [C, V_r], row_index int64 [P], labels int64 [P], chunk int, vocab_start int,
    group ProcessGroup | None) -> float32 (float64 for float64 logits) [P], equal on every rank of
    ``group``. backward: d logits [C, V_r] (``logits.dtype``), chunked; nothing for the other inputs.
    """

    @staticmethod
    def forward(ctx, logits, row_index, labels, chunk, vocab_start, group):
        v = logits.shape[1]
        lse = _row_logsumexp(logits, chunk)  # [C] local
        local, mine = _owned(labels, vocab_start, v)
        if group is None:
            target = logits[row_index, local].to(lse.dtype)  # [P]
        else:
            picked = logits[row_index, local.clamp(0, max(v - 1, 0))].to(lse.dtype)
            target = torch.where(mine, picked, torch.zeros((), dtype=lse.dtype, device=logits.device))
            lse, target = _combine_over_group(lse, target, group)
        ctx.save_for_backward(logits, row_index, local, mine, lse)
        ctx.chunk, ctx.grouped = chunk, group is not None
        return target - lse[row_index]

    @staticmethod
    def backward(ctx, grad):
        logits, row_index, local, mine, lse = ctx.saved_tensors
        g = grad.to(lse.dtype)
        row_grad = torch.zeros_like(lse).index_add_(0, row_index, g)  # [C] sum_s g_s
        rows, cols, gs = (row_index[mine], local[mine], g[mine]) if ctx.grouped else (row_index, local, g)
        # Target terms grouped by vocabulary chunk, so each chunk is finished in float32 and
        # rounded to the logits' dtype once.
        by_label = torch.argsort(cols)
        sorted_cols = cols[by_label]
        dlogits = torch.empty_like(logits)
        chunk = ctx.chunk
        bounds = torch.searchsorted(
            sorted_cols, torch.arange(0, logits.shape[1] + chunk, chunk, device=cols.device)
        ).tolist()
        for i, a in enumerate(range(0, logits.shape[1], chunk)):
            z = logits[:, a : a + chunk].to(lse.dtype)  # [C, chunk]
            d = torch.exp(z - lse[:, None]).mul_(-row_grad[:, None])
            sel = by_label[bounds[i] : bounds[i + 1]]
            if sel.numel():
                d.index_put_((rows[sel], cols[sel] - a), gs[sel], accumulate=True)
            dlogits[:, a : a + chunk] = d
        return dlogits, None, None, None, None, None


def _targets(targets: LogProbTargets | tuple):
    return (targets.row_index, targets.labels) if isinstance(targets, LogProbTargets) else targets


def mapped_logprobs(
    logits: torch.Tensor,
    targets: LogProbTargets | tuple,
    *,
    chunk: int = DEFAULT_CHUNK,
    vocab_start: int = 0,
    group=None,
) -> torch.Tensor:
    """Current log-probs of every non-terminal semantic position, in original batch order.

    Parameters
    ----------
    logits : Tensor, shape [C, V] (with ``group``: [C, V_r], this rank's columns)
        Compact logit rows (any float dtype; math in float32).
    targets : LogProbTargets or (row_index [P], labels [P])
        Semantic -> compact row map of the non-terminal positions and their next tokens (global
        vocabulary ids).
    chunk : int
        Vocabulary columns per chunk.
    vocab_start : int
        First global vocabulary id of ``logits``' columns (0 without a group).
    group : ProcessGroup, optional
        The TP group over which the vocabulary is split (module docstring); None: single process.

    Returns
    -------
    Tensor, float32 (float64 for float64 logits), shape [P]
        ``log_softmax(logits[row_index[i]])[labels[i]]`` of the full vocabulary, equal on every rank
        of ``group``; differentiable in ``logits``.
    """
    row_index, labels = _targets(targets)
    return MappedLogProbs.apply(logits, row_index, labels, int(chunk), int(vocab_start), group)


def expanded_logprobs(logits: torch.Tensor, targets: LogProbTargets | tuple) -> torch.Tensor:
    """Trajectory-wise baseline: expand to [P, V] rows, ``log_softmax``, gather (allocates P x V)."""
    row_index, labels = _targets(targets)
    expanded = logits.index_select(0, row_index).float()  # [P, V]
    return expanded.log_softmax(-1).gather(1, labels[:, None])[:, 0]
