"""Compact-to-semantic log-probabilities: mapped cross-entropy (paper Section 3.5, Eq. 17 and 19).

For every non-terminal semantic position ``s`` with next token ``y_s``::

    lambda_s = z[m(s), y_s] - logsumexp_v z[m(s), v]                          (Equation 17)

where ``z`` [C, V] are the compact logit rows and ``m(s)`` the compact row of ``s``. The
vocabulary-wide logsumexp runs once per compact row; each semantic position then reads one target
logit. Backward (Equation 19)::

    dz[c, :] = -(sum_{s: m(s)=c} g_s) softmax(z_c) + sum_{s: m(s)=c} g_s e_{y_s}

Nothing of size S x V is allocated; the semantic side is O(S) scalars. Positions sharing a row keep
their own labels and gradients (they are summed, never multiplied by a count). The log-probs come
back in the original batch order: the non-terminal positions of trajectory 0, then trajectory 1,
and so on (:class:`LogProbTargets`), attached to the autograd graph, so an unchanged objective
(:mod:`harts_runtime.loss.objectives`) can consume them.

Two implementations, each one function with an optional tensor-parallel (vocabulary) group:

* :func:`mapped_logprobs` on materialised logits [C, V] (an online logsumexp over vocabulary
  chunks, so no [C, V] float32 temporary; backward writes one [C, V] gradient chunk by chunk);
* :func:`lm_head_logprobs`, the fused LM head the model uses: ``z = hidden @ W^T`` a row chunk at a
  time, never keeping ``[N, V]`` logits, each chunk's logits recomputed in backward (a fused linear
  cross-entropy). Its per-chunk vocabulary work runs in PyTorch (float32 temporaries), or
  (``fla_kernels``, the model's choice on CUDA) in fla's cross-entropy kernels: one pass over
  the chunk's logits for the row logsumexps, and one in-place pass that turns them into their
  gradient (:class:`ChunkedLMHeadLogProbs`).

The entropy of the full distribution, ``H_s = lse(z_c) - sum_v softmax(z_c)_v z_{c,v}`` with
``c = m(s)`` (an entropy bonus, its metric), is :func:`lm_head_entropy`: once per compact row, a
second pass over the row chunks' logits (its own GEMM, forward and again in backward), then mapped
to the targets as the log-probs are; only when the objective asks for it (one process).

With ``group`` (vocabulary parallelism, Section 3.5) each TP rank holds the columns
``[vocab_start, vocab_start + V_r)`` (logits, or rows of the LM-head weight) and labels are global
ids. Each rank computes its local logsumexp ``l_r`` per row and the target logits it owns (zero
elsewhere); then exactly two collectives of scalars run, whatever the chunking:

1. ``all_reduce(MAX)`` of ``l_r`` (C floats): ``M``;
2. ``all_reduce(SUM)`` of ``[exp(l_r - M), target]`` (C + P floats): ``lse = M + log(sum)``.

No rank ever sees another rank's vocabulary columns. Backward needs no communication: the incoming
gradient ``g`` [P] is the same on every TP rank (the objective is replicated), and each rank writes
its own columns of Equation (19). Without a group the local logsumexp is the result (bit for bit
the single-process computation).

This module holds the fused LM-head path; the targets and the logits path (:func:`mapped_logprobs`,
:func:`expanded_logprobs`) are :mod:`harts_runtime.loss.logit_logprobs`, re-exported here.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from harts_kernels.device import on_device
from harts_runtime.loss.logit_logprobs import (
    DEFAULT_CHUNK,
    LogProbTargets,
    MappedLogProbs,
    _combine_over_group,
    _compute_dtype,
    _owned,
    expanded_logprobs,
    mapped_logprobs,
    targets_from_batch,
)

__all__ = [
    "DEFAULT_CHUNK",
    "ChunkedLMHeadLogProbs",
    "LogProbTargets",
    "MappedLogProbs",
    "ChunkedLMHeadEntropy",
    "expanded_logprobs",
    "lm_head_entropy",
    "lm_head_logprobs",
    "mapped_logprobs",
    "targets_from_batch",
]


class ChunkedLMHeadLogProbs(torch.autograd.Function):
    """``lp[i] = z[r_i, y_i] - logsumexp(z[r_i])`` with ``z = hidden @ W^T``, row chunk by row chunk.

    forward(hidden [N, D], weight [V_r, D], row_index [P], labels [P], order [P], bounds, rows,
    vocab_start, group) -> float32 (float64 for float64 hidden) [P]. ``order``/``bounds`` from
    :func:`harts_runtime.layout.rows.lm_chunks`. Logits are computed in the model dtype and reduced
    in float32 (as :class:`MappedLogProbs` on materialised logits); a first pass over row chunks
    keeps only each row's local logsumexp and the target logits this rank owns (``N + P`` scalars),
    then (with a group) the two collectives of the module docstring run once per microbatch.
    Backward recomputes each chunk's logits; ``dz = (onehot-sum - rowgrad * softmax)`` per chunk,
    then ``dhidden = dz @ W`` (partial over the vocabulary with a group) and ``dW += dz^T @ hidden``
    (fp32 accumulation); no collective.

    With a group, ``hidden`` holds *all* N rows of the microbatch on every rank (the caller enters
    the TP region with ``harts_runtime.parallel.comm.copy_to_tp``, or ``gather_rows`` under sequence
    parallelism, whose backward sums the partial ``dhidden`` of the ranks).
    """

    @staticmethod
    def forward(ctx, hidden, weight, row_index, labels, order, bounds, rows, vocab_start, group, fused=False):
        acc = _compute_dtype(hidden.dtype)
        n, v = hidden.shape[0], weight.shape[0]
        lse = torch.empty(n, device=hidden.device, dtype=acc)
        target = torch.zeros(row_index.numel(), device=hidden.device, dtype=acc)
        zero = torch.zeros((), dtype=acc, device=hidden.device)
        if fused:
            from fla.modules.fused_cross_entropy.ops import cross_entropy_fwd

            none = torch.full((min(rows, n),), _IGNORE, dtype=torch.long, device=hidden.device)
        with _device_guard(hidden, fused):  # fla launches on the current device: make it hidden's
            for i, a in enumerate(range(0, n, rows)):
                if fused:  # the row logsumexps in one pass over the model-dtype logits (fp32 math)
                    z = hidden[a : a + rows] @ weight.t()
                    lse[a : a + rows] = cross_entropy_fwd(z, none[: z.shape[0]])[2]
                else:
                    z = (hidden[a : a + rows] @ weight.t()).to(acc)  # [r, V_r]
                    lse[a : a + rows] = torch.logsumexp(z, -1)
                lo, hi = bounds[i], bounds[i + 1]
                if hi > lo:
                    sel = order[lo:hi]
                    r = row_index[sel] - a
                    if group is None:
                        target[sel] = z[r, labels[sel]].to(acc)
                    else:
                        local, mine = _owned(labels[sel], vocab_start, v)
                        target[sel] = torch.where(mine, z[r, local.clamp(0, v - 1)].to(acc), zero)
        if group is not None:
            lse, target = _combine_over_group(lse, target, group)
        ctx.save_for_backward(hidden, weight, row_index, labels, order, lse)
        ctx.bounds, ctx.rows, ctx.vocab_start, ctx.grouped = bounds, rows, vocab_start, group is not None
        ctx.fused = fused
        return target - lse[row_index]

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, row_index, labels, order, lse = ctx.saved_tensors
        bounds, rows = ctx.bounds, ctx.rows
        acc = lse.dtype
        g = grad.to(acc)  # identical on every TP rank (replicated objective)
        n, v = hidden.shape[0], weight.shape[0]
        row_grad = torch.zeros(n, device=hidden.device, dtype=acc).index_add_(0, row_index, g)
        dh = torch.empty_like(hidden)
        dw = torch.zeros(weight.shape, device=weight.device, dtype=acc)
        if ctx.fused:
            with _device_guard(hidden, True):
                dw = _fused_backward(
                    hidden, weight, row_index, labels, order, bounds, rows, lse, g, row_grad, dh, dw
                )
            return dh, dw.to(weight.dtype), None, None, None, None, None, None, None, None
        for i, a in enumerate(range(0, n, rows)):
            h = hidden[a : a + rows]
            z = (h @ weight.t()).to(acc)
            d = torch.exp(z - lse[a : a + rows, None]).mul_(-row_grad[a : a + rows, None])
            lo, hi = bounds[i], bounds[i + 1]
            if hi > lo:
                sel = order[lo:hi]
                if ctx.grouped:
                    local, mine = _owned(labels[sel], ctx.vocab_start, v)
                    d.index_put_((row_index[sel][mine] - a, local[mine]), g[sel][mine], accumulate=True)
                else:
                    d.index_put_((row_index[sel] - a, labels[sel]), g[sel], accumulate=True)
            d = d.to(hidden.dtype)
            dh[a : a + rows] = d @ weight
            dw.add_((d.t() @ h).to(acc))
        return dh, dw.to(weight.dtype), None, None, None, None, None, None, None, None


def _device_guard(t: torch.Tensor, fused: bool):
    """``torch.cuda.device(t.device)`` for fla's kernels on CUDA (they launch on the current
    device), else a no-op."""
    return on_device(t) if fused else contextlib.nullcontext()


_IGNORE = -100
"""fla's ``ignore_index``: a row without targets (its loss and gradient are zero)."""


def _fused_backward(hidden, weight, row_index, labels, order, bounds, rows, lse, g, row_grad, dh, dw):
    """The backward of :class:`ChunkedLMHeadLogProbs` through fla's cross-entropy kernel (no group).

    Equation (19) per row c with targets s: ``dz_c = -R_c softmax(z_c) + sum_s g_s e_{y_s}``,
    ``R_c = sum_s g_s``. fla's ``cross_entropy_bwd`` writes ``dloss (softmax - e_t)`` over the
    logits in place (fp32 math, one pass) for one label ``t`` per row: with ``dloss = -R_c`` and
    ``t`` the label of the row's first target, that is ``-R_c softmax(z_c) + R_c e_t``, which is
    the whole gradient when all of the row's targets share their label (every row but the forks
    of the tree). A target with another label then moves its ``g_s`` from ``e_t`` to ``e_{y_s}``:
    two accumulating writes, zero (an exact no-op) for the others. Rows without targets get a zero
    gradient (fla's ignore index). Returns ``dw`` with every chunk's ``dz^T h`` added."""
    from fla.modules.fused_cross_entropy.ops import cross_entropy_bwd

    n, p = hidden.shape[0], row_index.numel()
    first = torch.full((n,), p, dtype=torch.long, device=hidden.device)
    first.scatter_reduce_(0, row_index, torch.arange(p, device=hidden.device), "amin")
    row_label = (
        torch.where(first < p, labels[first.clamp_max(max(p - 1, 0))], _IGNORE) if p else first.fill_(_IGNORE)
    )
    moved = g * (labels != row_label[row_index])  # [P]: nonzero only for the forks' other labels
    for i, a in enumerate(range(0, n, rows)):
        h = hidden[a : a + rows]
        z = h @ weight.t()  # [r, V] model dtype, becomes its own gradient
        cross_entropy_bwd(
            z, row_label[a : a + rows], lse[a : a + rows], -row_grad[a : a + rows], inplace_backward=True
        )
        lo, hi = bounds[i], bounds[i + 1]
        if hi > lo:
            sel = order[lo:hi]
            r, m = row_index[sel] - a, moved[sel].to(z.dtype)
            z.index_put_((r, labels[sel]), m, accumulate=True)
            z.index_put_((r, row_label[row_index[sel]]), -m, accumulate=True)
        dh[a : a + rows] = z @ weight
        dw = _add_product(dw, z.t(), h)
    return dw


@functools.cache
def _float32_addmm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)`` adds a product of
    ``dtype`` operands into a float32 ``acc`` in place on ``device`` (a CUDA kernel of recent
    PyTorch); probed once, value checked."""
    try:
        a = torch.full((2, 2), 0.5, device=device, dtype=dtype)
        acc = torch.ones(2, 2, device=device)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        return bool((acc == 1.5).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc += a @ b`` in ``acc``'s dtype: one GEMM accumulating in float32 in place where
    :func:`_float32_addmm` allows (no model-dtype [V, D] partial, no cast, no new accumulator),
    else the product in the operands' dtype, cast and added."""
    if acc.dtype == a.dtype:
        return acc.addmm_(a, b)
    if acc.dtype == torch.float32 and a.is_cuda and _float32_addmm(a.device, a.dtype):
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    return acc.add_((a @ b).to(acc.dtype))


def lm_head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    row_index: torch.Tensor,
    labels: torch.Tensor,
    chunks: tuple,
    rows: int,
    *,
    vocab_start: int = 0,
    group=None,
    fla_kernels: bool = False,
) -> torch.Tensor:
    """Fused LM head + mapped log-probs (:class:`ChunkedLMHeadLogProbs`) of N rows.

    Parameters
    ----------
    hidden : Tensor [N, D]
        Final normed hidden rows (with ``group``: all N rows, on every rank).
    weight : Tensor [V, D] (with ``group``: [V_r, D], this rank's vocabulary rows)
    row_index, labels : Tensor int64 [P]
        Row and (global) next token of every target.
    chunks : (order Tensor [P], bounds list[int])
        From :func:`harts_runtime.layout.rows.lm_chunks` for N rows and ``rows`` rows per chunk.
    rows : int
        Rows per chunk (temporaries are ``[rows, V_r]`` fp32).
    vocab_start, group
        As for :func:`mapped_logprobs`.
    fla_kernels
        Run the per-chunk vocabulary work in fla's cross-entropy kernels (CUDA, or the CPU under
        ``TRITON_INTERPRET=1``; the model sets it from its fla-or-reference switch,
        :mod:`harts_runtime.modules.fused`) instead of PyTorch. They serve the single-process
        head in float32, bfloat16 and float16; float64 and a vocabulary group take PyTorch.

    Returns
    -------
    Tensor float32 (float64 for float64 hidden) [P], equal on every rank of ``group``.
    """
    fused = bool(fla_kernels) and group is None and hidden.dtype != torch.float64
    order, bounds = chunks[0].to(hidden.device), chunks[1]
    return ChunkedLMHeadLogProbs.apply(
        hidden, weight, row_index, labels, order, bounds, int(rows), int(vocab_start), group, fused
    )


class ChunkedLMHeadEntropy(torch.autograd.Function):
    """``H[c] = -sum_v p_{c,v} log p_{c,v}`` with ``log p = z - lse(z)``, ``z = hidden @ W^T``,
    row chunk by row chunk (temporaries ``[rows, V]`` in float32; float64 for float64 hidden).

    forward(hidden [N, D], weight [V, D], rows) -> [N]. Backward recomputes each chunk's logits:
    ``dH/dz_{c,v} = -p_{c,v} (log p_{c,v} + H_c)`` (``z - E_p[z]`` written without cancellation),
    so ``dz = -g_c p (log p + H)``, then ``dhidden = dz @ W`` and ``dW += dz^T @ hidden`` (fp32
    accumulation). One GEMM of ``N x D x V`` forward and three backward: the LM head's cost again.
    """

    @staticmethod
    def forward(ctx, hidden, weight, rows):
        acc = _compute_dtype(hidden.dtype)
        n = hidden.shape[0]
        ent = torch.empty(n, device=hidden.device, dtype=acc)
        lse = torch.empty(n, device=hidden.device, dtype=acc)
        for a in range(0, n, rows):
            z = (hidden[a : a + rows] @ weight.t()).to(acc)
            lse[a : a + rows] = torch.logsumexp(z, -1)
            logp = z.sub_(lse[a : a + rows, None])
            ent[a : a + rows] = torch.exp(logp).mul_(logp).sum(-1).neg_()  # two [rows, V] temporaries
        ctx.save_for_backward(hidden, weight, lse, ent)
        ctx.rows = rows
        return ent

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, lse, ent = ctx.saved_tensors
        acc, rows = lse.dtype, ctx.rows
        g = grad.to(acc)
        dh = torch.empty_like(hidden)
        dw = torch.zeros(weight.shape, device=weight.device, dtype=acc)
        for a in range(0, hidden.shape[0], rows):
            h = hidden[a : a + rows]
            logp = (h @ weight.t()).to(acc).sub_(lse[a : a + rows, None])
            d = torch.exp(logp).mul_(logp.add_(ent[a : a + rows, None])).mul_(-g[a : a + rows, None])
            d = d.to(hidden.dtype)
            dh[a : a + rows] = d @ weight
            dw = _add_product(dw, d.t(), h)
        return dh, dw.to(weight.dtype), None


def lm_head_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, row_index: torch.Tensor, rows: int = 1024
) -> torch.Tensor:
    """Full-vocabulary entropy of the LM head's distribution at every target, float32 (float64 for
    float64 hidden) ``[P]``: each compact row's entropy computed once
    (:class:`ChunkedLMHeadEntropy`) and read by its targets (``row_index`` [P]; a row shared by
    several targets gets their gradients summed). Differentiable in ``hidden`` and ``weight``.
    One process: ``weight`` is the whole ``[V, D]`` head and ``hidden`` every row of the
    microbatch."""
    return ChunkedLMHeadEntropy.apply(hidden, weight, int(rows))[row_index]
