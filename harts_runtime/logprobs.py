"""Compact-to-semantic log-probabilities: mapped cross-entropy (paper Section 3.5, Eq. 17 and 19).

For every non-terminal semantic position ``s`` with next token ``y_s``::

    lambda_s = z[m(s), y_s] - logsumexp_v z[m(s), v]                          (Equation 17)

where ``z`` [C, V] are the compact logit rows and ``m(s)`` the compact row of ``s``. The
vocabulary-wide max and sum-exp run once per compact row, chunked over the vocabulary (an online
logsumexp, so no [C, V] float32 temporary either); each semantic position then reads one target
logit. Backward (Equation 19)::

    dz[c, :] = -(sum_{s: m(s)=c} g_s) softmax(z_c) + sum_{s: m(s)=c} g_s e_{y_s}

is written chunk by chunk into one [C, V] gradient: the only vocabulary-sized tensor of the whole
computation. Nothing of size S x V is allocated; the semantic side is O(S) scalars. Positions
sharing a row keep their own labels and gradients (they are summed, never multiplied by a count).

The log-probs come back in the original batch order: the non-terminal positions of trajectory 0,
then trajectory 1, and so on (:class:`LogProbTargets`), attached to the autograd graph, so an
unchanged objective (:mod:`harts_runtime.objectives`) can consume them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["LogProbTargets", "MappedLogProbs", "expanded_logprobs", "mapped_logprobs", "targets_from_batch"]

DEFAULT_CHUNK = 8192
"""Vocabulary columns per chunk: temporaries are [C, chunk] float32."""


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


def _row_logsumexp(logits: torch.Tensor, chunk: int) -> torch.Tensor:
    """[C] logsumexp over the vocabulary (float32; float64 for float64 logits), an online
    max/sum-exp over column chunks."""
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

    forward(logits [C, V], row_index int64 [P], labels int64 [P], chunk int) -> float32 [P]
    backward: d logits [C, V] (``logits.dtype``), chunked; nothing for the index inputs.
    """

    @staticmethod
    def forward(ctx, logits, row_index, labels, chunk):
        lse = _row_logsumexp(logits, chunk)  # [C]
        target = logits[row_index, labels].to(lse.dtype)  # [P]
        ctx.save_for_backward(logits, row_index, labels, lse)
        ctx.chunk = chunk
        return target - lse[row_index]

    @staticmethod
    def backward(ctx, grad):
        logits, row_index, labels, lse = ctx.saved_tensors
        g = grad.to(lse.dtype)
        row_grad = torch.zeros_like(lse).index_add_(0, row_index, g)  # [C] sum_s g_s
        # Target terms grouped by vocabulary chunk, so each chunk is finished in float32 and
        # rounded to the logits' dtype once.
        by_label = torch.argsort(labels)
        sorted_labels = labels[by_label]
        dlogits = torch.empty_like(logits)
        chunk = ctx.chunk
        bounds = torch.searchsorted(
            sorted_labels, torch.arange(0, logits.shape[1] + chunk, chunk, device=labels.device)
        ).tolist()
        for i, a in enumerate(range(0, logits.shape[1], chunk)):
            z = logits[:, a : a + chunk].to(lse.dtype)  # [C, chunk]
            d = torch.exp(z - lse[:, None]).mul_(-row_grad[:, None])
            sel = by_label[bounds[i] : bounds[i + 1]]
            if sel.numel():
                d.index_put_((row_index[sel], labels[sel] - a), g[sel], accumulate=True)
            dlogits[:, a : a + chunk] = d
        return dlogits, None, None, None


def mapped_logprobs(
    logits: torch.Tensor, targets: LogProbTargets | tuple, *, chunk: int = DEFAULT_CHUNK
) -> torch.Tensor:
    """Current log-probs of every non-terminal semantic position, in original batch order.

    Parameters
    ----------
    logits : Tensor, shape [C, V]
        Compact logit rows (any float dtype; math in float32).
    targets : LogProbTargets or (row_index [P], labels [P])
        Semantic -> compact row map of the non-terminal positions and their next tokens.
    chunk : int
        Vocabulary columns per chunk.

    Returns
    -------
    Tensor, float32, shape [P]
        ``log_softmax(logits[row_index[i]])[labels[i]]``, differentiable in ``logits``.
    """
    row_index, labels = (
        (targets.row_index, targets.labels) if isinstance(targets, LogProbTargets) else targets
    )
    return MappedLogProbs.apply(logits, row_index, labels, int(chunk))


def expanded_logprobs(logits: torch.Tensor, targets: LogProbTargets | tuple) -> torch.Tensor:
    """Trajectory-wise baseline: expand to [P, V] rows, ``log_softmax``, gather (allocates P x V)."""
    row_index, labels = (
        (targets.row_index, targets.labels) if isinstance(targets, LogProbTargets) else targets
    )
    expanded = logits.index_select(0, row_index).float()  # [P, V]
    return expanded.log_softmax(-1).gather(1, labels[:, None])[:, 0]
