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

:func:`vocab_parallel_logprobs` works on materialised local logits. The model uses the fused form:
:class:`VocabParallelLMHead` (installed by ``apply_tp``) computes the same three reductions row chunk
by row chunk from ``hidden`` and its ``[V_r, D]`` weight without keeping ``[C, V_r]`` logits
(:class:`VocabParallelChunkedLMHeadLogProbs`, two collectives per microbatch), and
:class:`VocabParallelEmbedding` does Megatron's masked lookup + all-reduce (reduce-scatter under
sequence parallelism).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from harts_runtime.logprobs import DEFAULT_CHUNK, LogProbTargets
from harts_runtime.parallel.comm import copy_to_tp, gather_rows, reduce_from_tp, scatter_rows_sum
from harts_runtime.parallel.dims import ParallelConfigError

__all__ = [
    "VocabParallelChunkedLMHeadLogProbs",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "VocabParallelMappedLogProbs",
    "vocab_parallel_logprobs",
    "vocab_range",
]


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
            m = torch.maximum(m, logits[:, a : a + chunk].to(dt).amax(1))
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)  # C scalars
        acc = torch.zeros(c, device=logits.device, dtype=dt)
        for a in range(0, v, chunk):
            acc += torch.exp(logits[:, a : a + chunk].to(dt) - m[:, None]).sum(1)
        dist.all_reduce(acc, group=group)  # C scalars
        lse = m + acc.log()
        local = labels - vocab_start
        mine = (local >= 0) & (local < v)
        target = torch.where(
            mine,
            logits[row_index, local.clamp(0, max(v - 1, 0))].to(dt),
            torch.zeros((), dtype=dt, device=logits.device),
        )
        dist.all_reduce(target, group=group)  # P scalars
        ctx.save_for_backward(logits, row_index, local, mine, lse)
        ctx.chunk = chunk
        return target - lse[row_index]

    @staticmethod
    def backward(ctx, grad):
        logits, row_index, local, mine, lse = ctx.saved_tensors
        g = grad.to(lse.dtype)
        row_grad = torch.zeros_like(lse).index_add_(0, row_index, g)  # [C]
        dlogits = torch.empty_like(logits)
        chunk = ctx.chunk
        sel_rows, sel_cols, sel_g = row_index[mine], local[mine], g[mine]
        for a in range(0, logits.shape[1], chunk):
            z = logits[:, a : a + chunk].to(lse.dtype)
            d = torch.exp(z - lse[:, None]).mul_(-row_grad[:, None])
            inside = (sel_cols >= a) & (sel_cols < a + z.shape[1])
            if inside.any():
                d.index_put_((sel_rows[inside], sel_cols[inside] - a), sel_g[inside], accumulate=True)
            dlogits[:, a : a + chunk] = d
        return dlogits, None, None, None, None, None


def vocab_parallel_logprobs(
    local_logits: torch.Tensor,
    targets: LogProbTargets | tuple,
    vocab_start: int,
    group,
    *,
    chunk: int = DEFAULT_CHUNK,
) -> torch.Tensor:
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
    row_index, labels = (
        (targets.row_index, targets.labels) if isinstance(targets, LogProbTargets) else targets
    )
    return VocabParallelMappedLogProbs.apply(
        local_logits, row_index, labels, int(vocab_start), group, int(chunk)
    )


# ------------------------------------------------------------------ the model's vocab-parallel LM head
def _check_shards(vocab_size: int, world: int) -> None:
    if vocab_size < world:
        raise ParallelConfigError(
            "vocab_size", f"{vocab_size} < tp={world}: a rank would hold no vocabulary rows"
        )


class VocabParallelChunkedLMHeadLogProbs(torch.autograd.Function):
    """The fused, row-chunked LM head + mapped log-probs of
    :class:`harts_runtime.model.ChunkedLMHeadLogProbs` over a vocabulary-sharded weight.

    forward(hidden [N, D], weight [V_r, D], row_index [P], labels [P], order [P], bounds, rows,
    vocab_start, group) -> float32 (float64 for float64 hidden) [P], equal on every rank of ``group``.

    ``hidden`` holds *all* N rows of the microbatch on every rank (the caller enters the TP region with
    :func:`~harts_runtime.parallel.comm.copy_to_tp`, or :func:`~harts_runtime.parallel.comm.gather_rows`
    under sequence parallelism, whose backward sums the partial ``dhidden`` of the ranks). Why two
    passes instead of one all-reduce per chunk: a first pass over row chunks computes this rank's
    per-row max ``m_r``, sum-exp below it ``s_r`` and the target logits it owns, keeping only those
    ``2N + P`` scalars; then exactly two collectives run for the whole microbatch:

    1. ``all_reduce(MAX)`` of ``m`` (N scalars);
    2. ``all_reduce(SUM)`` of ``[s_r * exp(m_r - m), target]`` (N + P scalars).

    No ``[rows, V]`` logit block ever leaves its rank and none is kept: backward recomputes each chunk's
    local logits, writes this rank's columns of Equation (19), and needs no collective of its own.
    """

    @staticmethod
    def forward(ctx, hidden, weight, row_index, labels, order, bounds, rows, vocab_start, group):
        acc = _dtype(hidden)
        n, v, p = hidden.shape[0], weight.shape[0], row_index.numel()
        m = torch.full((n,), float("-inf"), device=hidden.device, dtype=acc)
        s = torch.zeros(n, device=hidden.device, dtype=acc)
        target = torch.zeros(p, device=hidden.device, dtype=acc)
        for i, a in enumerate(range(0, n, rows)):
            z = (hidden[a : a + rows] @ weight.t()).to(acc)  # [r, V_r] local
            mc = z.amax(1)
            m[a : a + rows] = mc
            s[a : a + rows] = torch.exp(z - mc[:, None]).sum(1)
            lo, hi = bounds[i], bounds[i + 1]
            if hi > lo:
                sel = order[lo:hi]
                local = labels[sel] - vocab_start
                mine = (local >= 0) & (local < v)
                picked = z[row_index[sel] - a, local.clamp(0, v - 1)]
                target[sel] = torch.where(mine, picked, torch.zeros((), dtype=acc, device=z.device))
        gm = m.clone()
        dist.all_reduce(gm, op=dist.ReduceOp.MAX, group=group)  # N scalars
        buf = torch.cat([s * torch.exp(m - gm), target])
        dist.all_reduce(buf, group=group)  # N + P scalars
        lse = gm + buf[:n].log()
        ctx.save_for_backward(hidden, weight, row_index, labels, order, lse)
        ctx.bounds, ctx.rows, ctx.vocab_start = bounds, rows, vocab_start
        return buf[n:] - lse[row_index]

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, row_index, labels, order, lse = ctx.saved_tensors
        bounds, rows, vocab_start = ctx.bounds, ctx.rows, ctx.vocab_start
        g = grad.to(lse.dtype)  # identical on every TP rank (replicated objective)
        n, v = hidden.shape[0], weight.shape[0]
        row_grad = torch.zeros(n, device=hidden.device, dtype=lse.dtype).index_add_(0, row_index, g)
        dh = torch.empty_like(hidden)
        dw = torch.zeros(weight.shape, device=weight.device, dtype=lse.dtype)
        for i, a in enumerate(range(0, n, rows)):
            h = hidden[a : a + rows]
            z = (h @ weight.t()).to(lse.dtype)
            d = torch.exp(z - lse[a : a + rows, None]).mul_(-row_grad[a : a + rows, None])
            lo, hi = bounds[i], bounds[i + 1]
            if hi > lo:
                sel = order[lo:hi]
                local = labels[sel] - vocab_start
                mine = (local >= 0) & (local < v)
                d.index_put_((row_index[sel][mine] - a, local[mine]), g[sel][mine], accumulate=True)
            d = d.to(hidden.dtype)
            dh[a : a + rows] = d @ weight  # partial over V
            dw.add_((d.t() @ h).to(lse.dtype))
        return dh, dw.to(weight.dtype), None, None, None, None, None, None, None


def _shard_rows_of(weight: torch.Tensor, rank: int, world: int) -> tuple[nn.Parameter, int, int]:
    start, end = vocab_range(weight.shape[0], rank, world)
    p = nn.Parameter(weight.detach()[start:end].clone().contiguous(), requires_grad=weight.requires_grad)
    p._harts_vocab_range = (start, end)  # which rows of the full [V, D] weight this shard holds
    return p, start, end


class VocabParallelEmbedding(nn.Module):
    """An ``nn.Embedding`` whose rows (vocabulary ids) are split over the TP group (Megatron's
    ``VocabParallelEmbedding``): ``weight`` [V_r, D] holds ids ``[vocab_start, vocab_start + V_r)``.

    forward(ids [N]) looks up the ids this rank owns, zeroes the others, and sums over the group:
    an all-reduce (``reduce_from_tp``, every rank gets all N rows), or under sequence parallelism a
    reduce-scatter (``scatter_rows_sum``, this rank gets its :func:`row_split` block of rows). Exactly
    one rank contributes a non-zero row per id, so the sum is exact in any dtype. Backward needs no
    collective (all-reduce) or one all-gather (SP): the hidden-row gradient is the same on every rank.
    """

    def __init__(
        self, weight: nn.Parameter, vocab_start: int, vocab_size: int, group, sequence_parallel: bool
    ):
        super().__init__()
        self.weight = weight
        self.vocab_start, self.vocab_size = int(vocab_start), int(vocab_size)
        self.embedding_dim = weight.shape[1]
        self.group, self.sequence_parallel = group, bool(sequence_parallel)

    @classmethod
    def from_dense(
        cls, embed: nn.Embedding, group, rank: int, world: int, sequence_parallel: bool = False
    ) -> VocabParallelEmbedding:
        """Keep rank ``rank``'s rows (:func:`vocab_range`) of ``embed`` (left unchanged)."""
        v = embed.weight.shape[0]
        _check_shards(v, world)
        w, start, _ = _shard_rows_of(embed.weight, rank, world)
        return cls(w, start, v, group, sequence_parallel)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.weight)
        x = x.masked_fill(~mine[..., None], 0)
        if self.sequence_parallel:
            return scatter_rows_sum(x, self.group)
        return reduce_from_tp(x, self.group)

    def extra_repr(self) -> str:
        return (
            f"rows=[{self.vocab_start}, {self.vocab_start + self.weight.shape[0]}) of {self.vocab_size}, "
            f"dim={self.embedding_dim}, sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelLMHead(nn.Module):
    """An untied, bias-free LM head ``[V, D]`` split by vocabulary rows over the TP group
    (column-parallel logits); ``weight`` [V_r, D] scores ids ``[vocab_start, vocab_start + V_r)``.

    :meth:`mapped_logprobs` is what the model's training path calls
    (:meth:`harts_runtime.model.HybridModel.logprobs`): the fused chunked log-probs of
    :class:`VocabParallelChunkedLMHeadLogProbs`, whose only collectives are N + (N + P) scalars
    forward, plus the region entry: ``copy_to_tp`` (backward all-reduce of ``dhidden`` [N, D]) or,
    under sequence parallelism, ``gather_rows`` (forward all-gather of the row blocks, backward
    reduce-scatter), exactly as Megatron's output layer.
    """

    def __init__(
        self, weight: nn.Parameter, vocab_start: int, vocab_size: int, group, sequence_parallel: bool
    ):
        super().__init__()
        self.weight = weight
        self.vocab_start, self.vocab_size = int(vocab_start), int(vocab_size)
        self.in_features = weight.shape[1]
        self.group, self.sequence_parallel = group, bool(sequence_parallel)

    @classmethod
    def from_dense(
        cls, head: nn.Linear, group, rank: int, world: int, sequence_parallel: bool = False
    ) -> VocabParallelLMHead:
        """Keep rank ``rank``'s rows (:func:`vocab_range`) of ``head`` (left unchanged)."""
        if head.bias is not None:
            raise ParallelConfigError("lm_head", "a vocabulary-parallel LM head with a bias is not supported")
        v = head.weight.shape[0]
        _check_shards(v, world)
        w, start, _ = _shard_rows_of(head.weight, rank, world)
        return cls(w, start, v, group, sequence_parallel)

    def mapped_logprobs(
        self, hidden: torch.Tensor, row_index: torch.Tensor, labels: torch.Tensor, chunks, rows: int
    ) -> torch.Tensor:
        """Mapped log-probs [P] (Equation 17) of the microbatch, equal on every TP rank.

        ``hidden``: all N rows, or this rank's row block under sequence parallelism (gathered here).
        ``chunks``: ``(order, bounds)`` from :func:`harts_runtime.model.lm_chunks` for N rows and
        ``rows`` rows per chunk, or None to compute them here.
        """
        h = gather_rows(hidden, self.group) if self.sequence_parallel else copy_to_tp(hidden, self.group)
        if chunks is None:
            from harts_runtime.model import lm_chunks

            chunks = lm_chunks(row_index.cpu().numpy(), h.shape[0], rows)
        order, bounds = chunks[0].to(h.device), chunks[1]
        return VocabParallelChunkedLMHeadLogProbs.apply(
            h, self.weight, row_index, labels, order, bounds, int(rows), self.vocab_start, self.group
        )

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [n, V] of rows replicated on every TP rank (evaluation only, not
        differentiable): an all-gather of the ranks' column blocks. Training never calls this."""
        local = hidden @ self.weight.t()  # [n, V_r]
        w = dist.get_world_size(self.group)
        sizes = [b - a for a, b in (vocab_range(self.vocab_size, r, w) for r in range(w))]
        pad = max(sizes)
        buf = [local.new_empty(local.shape[:-1] + (pad,)) for _ in sizes]
        padded = F.pad(local, (0, pad - local.shape[-1])).contiguous()
        dist.all_gather(buf, padded, group=self.group)
        return torch.cat([b[..., :s] for b, s in zip(buf, sizes)], dim=-1)

    def extra_repr(self) -> str:
        return (
            f"rows=[{self.vocab_start}, {self.vocab_start + self.weight.shape[0]}) of {self.vocab_size}, "
            f"in_features={self.in_features}, sequence_parallel={self.sequence_parallel}"
        )
