"""Vocabulary-parallel mapped log-probs (paper Section 3.5, "With vocabulary parallelism ...").

Each TP rank holds the logit columns ``[vocab_start, vocab_start + V_r)`` of the C compact rows (the
output of a column-parallel LM head). Forward communicates only scalars:

1. ``all_reduce(MAX)`` of the local per-row maxima: C floats;
2. ``all_reduce(SUM)`` of the local per-row sum-exp below the global max: C floats;
3. ``all_reduce(SUM)`` of the target logit of every non-terminal semantic position, read by the rank
   that owns the label (zero elsewhere): P floats.

No rank ever sees another rank's vocabulary columns. Backward needs no communication: the incoming
gradient ``g`` [P] is the same on every TP rank (the objective is replicated), and each rank writes
its own columns of Equation (19), ``dz[c, v] = -(sum_{m(s)=c} g_s) softmax(z_c)_v + sum g_s [y_s=v]``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harts_runtime.logprobs import DEFAULT_CHUNK, LogProbTargets

__all__ = ["VocabParallelMappedLogProbs", "vocab_parallel_logprobs", "vocab_range"]


def vocab_range(vocab_size: int, rank: int, world: int) -> tuple[int, int]:
    """``[start, end)`` columns of rank ``rank`` (contiguous, sizes differ by at most one)."""
    base, extra = divmod(vocab_size, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class VocabParallelMappedLogProbs(torch.autograd.Function):
    """forward(local_logits [C, V_r], row_index [P], labels [P], vocab_start, group, chunk) -> [P].

    Labels are global vocabulary ids. The result is identical on every rank of ``group``.
    """

    @staticmethod
    def forward(ctx, logits, row_index, labels, vocab_start, group, chunk):
        c, v = logits.shape
        dt = _dtype(logits)
        m = torch.full((c,), float("-inf"), device=logits.device, dtype=dt)
        for a in range(0, v, chunk):
            m = torch.maximum(m, logits[:, a:a + chunk].to(dt).amax(1))
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)                       # C scalars
        acc = torch.zeros(c, device=logits.device, dtype=dt)
        for a in range(0, v, chunk):
            acc += torch.exp(logits[:, a:a + chunk].to(dt) - m[:, None]).sum(1)
        dist.all_reduce(acc, group=group)                                           # C scalars
        lse = m + acc.log()
        local = labels - vocab_start
        mine = (local >= 0) & (local < v)
        target = torch.where(mine, logits[row_index, local.clamp(0, max(v - 1, 0))].to(dt),
                             torch.zeros((), dtype=dt, device=logits.device))
        dist.all_reduce(target, group=group)                                        # P scalars
        ctx.save_for_backward(logits, row_index, local, mine, lse)
        ctx.chunk = chunk
        return target - lse[row_index]

    @staticmethod
    def backward(ctx, grad):
        logits, row_index, local, mine, lse = ctx.saved_tensors
        g = grad.to(lse.dtype)
        row_grad = torch.zeros_like(lse).index_add_(0, row_index, g)               # [C]
        dlogits = torch.empty_like(logits)
        chunk = ctx.chunk
        sel_rows, sel_cols, sel_g = row_index[mine], local[mine], g[mine]
        for a in range(0, logits.shape[1], chunk):
            z = logits[:, a:a + chunk].to(lse.dtype)
            d = torch.exp(z - lse[:, None]).mul_(-row_grad[:, None])
            inside = (sel_cols >= a) & (sel_cols < a + z.shape[1])
            if inside.any():
                d.index_put_((sel_rows[inside], sel_cols[inside] - a), sel_g[inside], accumulate=True)
            dlogits[:, a:a + chunk] = d
        return dlogits, None, None, None, None, None


def vocab_parallel_logprobs(local_logits: torch.Tensor, targets: LogProbTargets | tuple, vocab_start: int,
                            group, *, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Mapped log-probs from vocabulary-sharded compact logits.

    Parameters
    ----------
    local_logits : Tensor, shape [C, V_r]
        This rank's columns ``[vocab_start, vocab_start + V_r)`` of the compact logit rows.
    targets : LogProbTargets or (row_index [P], labels [P])
        As for :func:`harts_runtime.logprobs.mapped_logprobs` (labels are global ids).
    vocab_start : int
        First global vocabulary id of this rank's columns (:func:`vocab_range`).
    group : ProcessGroup
        The TP group.

    Returns
    -------
    Tensor, float32 (float64 for float64 logits), shape [P]
        Equal on every rank to ``mapped_logprobs`` of the full logits; differentiable in
        ``local_logits``.
    """
    row_index, labels = (targets.row_index, targets.labels) if isinstance(targets, LogProbTargets) else targets
    return VocabParallelMappedLogProbs.apply(local_logits, row_index, labels, int(vocab_start), group, int(chunk))
