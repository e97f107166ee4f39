"""Vocabulary parallelism: the embedding and the LM head split by vocabulary rows over the TP group
(paper Section 3.5, "With vocabulary parallelism ...").

The log-prob math lives in :mod:`harts_runtime.loss.logprobs` (one implementation for one process
and for a TP group: the local logsumexp of each rank's columns, then an ``all_reduce(MAX)`` of C
scalars and an ``all_reduce(SUM)`` of C + P scalars; no rank sees another rank's columns, backward
needs no collective). This module holds the modules that call it:

* :class:`VocabParallelLMHead` (installed by ``apply_tp``): its :meth:`~VocabParallelLMHead.mapped_logprobs`
  is the fused, row-chunked LM head over the ``[V_r, D]`` weight shard
  (:func:`harts_runtime.loss.logprobs.lm_head_logprobs` with the TP group), never keeping
  ``[C, V_r]`` logits;
* :class:`VocabParallelEmbedding`: Megatron's masked lookup + all-reduce (reduce-scatter under
  sequence parallelism);
* :func:`vocab_parallel_logprobs`: mapped log-probs of materialised local logits [C, V_r].
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from harts_runtime.layout.rows import lm_chunks
from harts_runtime.loss.logprobs import DEFAULT_CHUNK, LogProbTargets, lm_head_logprobs, mapped_logprobs
from harts_runtime.parallel.comm import copy_to_tp, gather_rows, reduce_from_tp, scatter_rows_sum
from harts_runtime.parallel.dims import ParallelConfigError

__all__ = ["VocabParallelEmbedding", "VocabParallelLMHead", "vocab_parallel_logprobs", "vocab_range"]


def vocab_range(vocab_size: int, rank: int, world: int) -> tuple[int, int]:
    """``[start, end)`` columns of rank ``rank`` (contiguous, sizes differ by at most one)."""
    base, extra = divmod(vocab_size, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


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
        As for :func:`harts_runtime.loss.logprobs.mapped_logprobs` (labels are global ids).
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
    return mapped_logprobs(local_logits, targets, chunk=chunk, vocab_start=vocab_start, group=group)


# ------------------------------------------------------------------ the model's vocab-parallel LM head
def _check_shards(vocab_size: int, world: int) -> None:
    if vocab_size < world:
        raise ParallelConfigError(
            "vocab_size", f"{vocab_size} < tp={world}: a rank would hold no vocabulary rows"
        )


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
    (:meth:`harts_runtime.models.HybridModel.logprobs`): the fused chunked log-probs of
    :func:`harts_runtime.loss.logprobs.lm_head_logprobs` with the TP group, whose only collectives
    are N + (N + P) scalars forward, plus the region entry: ``copy_to_tp`` (backward all-reduce of ``dhidden`` [N, D]) or,
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
        ``chunks``: ``(order, bounds)`` from :func:`harts_runtime.layout.rows.lm_chunks` for N rows
        and ``rows`` rows per chunk, or None to compute them here.
        """
        h = gather_rows(hidden, self.group) if self.sequence_parallel else copy_to_tp(hidden, self.group)
        if chunks is None:
            chunks = lm_chunks(row_index.cpu().numpy(), h.shape[0], rows)
        return lm_head_logprobs(
            h, self.weight, row_index, labels, chunks, rows, vocab_start=self.vocab_start, group=self.group
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
