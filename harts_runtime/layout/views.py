"""Packed Q / ancestor-KV index views for full attention on compact tokens (Sections 3.4, 4.2).

Glossary
--------
* compact row ``c``: one unique token prefix; a compact tensor has one row per compact token
  ([C, ...]). Every row has a parent row (``row_parent``, -1 for a first token).
* chain: rows ``r_0, ..., r_{l-1}`` with ``parent[r_i] = r_{i-1}``; its *ancestors* are the rows on
  the path from the root to ``parent[r_0]`` (``h`` rows, root first).
* branch decomposition (:class:`Branches`): a partition of the compact rows into chains. Any
  partition works: one per input sequence of a call plan (non-replay rows, what the train step
  uses), one branch per segment, or one per direct-continuation chain (the last two, and the dense
  masks that check views against the tree, are test decompositions in :mod:`harts_runtime.testing`).
* branch view (Equation 21): packed Q holds the branch's ``l`` current rows; packed KV holds its
  ``h`` ancestors followed by the same ``l`` current rows: ``|Q| = l``, ``|KV| = h + l``.
* bottom-right causal alignment (Equation 22): query ``i`` reads KV entry ``j`` iff ``j <= h + i``.
  This is exactly "row ``kv`` is an ancestor of, or equal to, row ``q``" in the tree, which
  :class:`TreeOrder` states without views: ``pre[kv] <= pre[q] < end[kv]``.

All index arrays are int64 (torch indexing) except the ``cu_seqlens`` (int32, as packed attention
kernels take them). Views are built once per microbatch on the host (numpy) and shared by every
full-attention layer.

Complexity: building views is O(C + |KV| + B * d) where ``|KV| = C + sum_b h_b`` is the packed KV
length and ``d`` the segment depth of the tree (ancestor paths are walked a run of consecutive rows
at a time, never a row at a time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from harts_runtime.errors import InvalidInputError

__all__ = ["AttentionViews", "Branches", "TreeOrder", "build_views", "expand_ranges"]


def expand_ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(lo[i], hi[i])`` over i, int64, without a Python loop."""
    lo = np.asarray(lo, dtype=np.int64)
    lengths = np.asarray(hi, dtype=np.int64) - lo
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return np.arange(total, dtype=np.int64) - np.repeat(starts - lo, lengths)


def _run_starts(parent: np.ndarray) -> np.ndarray:
    """``run_start[r]``: first row of the maximal run ``s, s+1, ..., r`` with ``parent[t] = t - 1``."""
    idx = np.arange(len(parent), dtype=np.int64)
    breaks = parent != idx - 1
    if len(parent):
        breaks[0] = True
    return np.maximum.accumulate(np.where(breaks, idx, 0))


@dataclass(frozen=True)
class Branches:
    """A decomposition of compact rows into chains.

    Attributes
    ----------
    rows : np.ndarray, int64, shape [L]
        Current rows of all branches, concatenated; inside a branch each row's parent is the row
        before it.
    cu : np.ndarray, int64, shape [B + 1]
        Branch ``b`` owns ``rows[cu[b]:cu[b + 1]]`` (non-empty).
    """

    rows: np.ndarray
    cu: np.ndarray

    @classmethod
    def from_lists(cls, chains: Sequence[Sequence[int]]) -> Branches:
        """Branches from one list of rows per branch."""
        lengths = np.array([len(c) for c in chains], dtype=np.int64)
        cu = np.zeros(len(chains) + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu[1:])
        rows = (
            np.concatenate([np.asarray(c, dtype=np.int64) for c in chains])
            if chains
            else np.zeros(0, dtype=np.int64)
        )
        return cls(rows, cu)

    @property
    def num_branches(self) -> int:
        """B."""
        return len(self.cu) - 1


@dataclass(frozen=True)
class TreeOrder:
    """Preorder coordinates of the row forest: row ``k`` is an ancestor of, or equal to, row ``q``
    iff ``pre[k] <= pre[q] < end[k]``.

    Attributes
    ----------
    pre : np.ndarray, int64, shape [C]
        Preorder rank of each row.
    end : np.ndarray, int64, shape [C]
        One past the largest preorder rank in each row's subtree.
    """

    pre: np.ndarray
    end: np.ndarray

    @classmethod
    def from_batch(cls, batch) -> TreeOrder:
        """O(C) from a RolloutBatch, whose rows are already in preorder (segment subtrees are
        contiguous row ranges)."""
        c = batch.compact_tokens
        begin = np.append(np.asarray(batch.segment_row_begin, dtype=np.int64), c)
        seg_end = np.asarray(batch.segment_subtree_end, dtype=np.int64)
        end = begin[seg_end[np.asarray(batch.row_segment, dtype=np.int64)]]
        return cls(np.arange(c, dtype=np.int64), end)

    @classmethod
    def from_parent(cls, parent) -> TreeOrder:
        """From any parent array (rows in any order; children visited in row order). O(C)."""
        parent = np.asarray(parent, dtype=np.int64)
        c = len(parent)
        order = np.argsort(parent, kind="stable")
        n_roots = int((parent < 0).sum())
        child_offsets = np.zeros(c + 1, dtype=np.int64)
        np.cumsum(np.bincount(parent[parent >= 0], minlength=c), out=child_offsets[1:])
        children = order[n_roots:]
        pre = np.full(c, -1, dtype=np.int64)
        end = np.zeros(c, dtype=np.int64)
        counter = 0
        for root in order[:n_roots].tolist():
            stack = [(root, False)]
            while stack:
                r, done = stack.pop()
                if done:
                    end[r] = counter
                    continue
                pre[r] = counter
                counter += 1
                stack.append((r, True))
                kids = children[child_offsets[r] : child_offsets[r + 1]]
                stack.extend((int(k), False) for k in kids[::-1])
        if (pre < 0).any():
            raise InvalidInputError("row_parent", "contains a cycle (some rows are unreachable from a root)")
        return cls(pre, end)


@dataclass(frozen=True, eq=False)
class AttentionViews:
    """Index views of one microbatch for full attention on compact tokens.

    Attributes
    ----------
    q_index : Tensor, int64, shape [Lq]
        Compact row of each packed query, branch by branch.
    kv_index : Tensor, int64, shape [Lk]
        Compact row of each packed KV entry: branch ``b``'s ancestors (root first), then its current
        rows.
    cu_seqlens_q, cu_seqlens_k : Tensor, int32, shape [B + 1]
        Packed-sequence boundaries of Q and KV (separate, Equation 21).
    max_seqlen_q, max_seqlen_k : int
        Longest branch in Q and in KV.
    num_rows : int
        C, rows of the compact tensors the views index.
    q_inverse : Tensor, int64, shape [C], or None
        Packed-Q position of each row when ``q_index`` is a permutation of all rows (then the output
        scatter is a gather); None when some rows (padding) have no query.
    tree_pre, tree_end : Tensor, int32, shape [C]
        :class:`TreeOrder` of the rows, for tree-mask backends that read compact rows directly.
    """

    q_index: torch.Tensor
    kv_index: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    num_rows: int
    q_inverse: torch.Tensor | None
    tree_pre: torch.Tensor
    tree_end: torch.Tensor
    cache: dict = field(default_factory=dict, repr=False)
    """Per-device derived objects (padded indices, FlexAttention block masks)."""

    @property
    def num_branches(self) -> int:
        """B."""
        return self.cu_seqlens_q.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.q_index.device

    def stats(self) -> dict:
        """Sizes: rows C, branches B, packed Q and KV lengths, ancestor entries, KV expansion |KV|/C."""
        lq, lk = self.q_index.numel(), self.kv_index.numel()
        return {
            "rows": self.num_rows,
            "branches": self.num_branches,
            "q_len": lq,
            "kv_len": lk,
            "ancestor_entries": lk - lq,
            "kv_expansion": lk / max(self.num_rows, 1),
            "max_seqlen_q": self.max_seqlen_q,
            "max_seqlen_k": self.max_seqlen_k,
        }

    def to(self, device) -> AttentionViews:
        """The same views with every index tensor on ``device`` (a fresh cache)."""
        mv = lambda t: t.to(device, non_blocking=True)
        return AttentionViews(
            mv(self.q_index),
            mv(self.kv_index),
            mv(self.cu_seqlens_q),
            mv(self.cu_seqlens_k),
            self.max_seqlen_q,
            self.max_seqlen_k,
            self.num_rows,
            None if self.q_inverse is None else mv(self.q_inverse),
            mv(self.tree_pre),
            mv(self.tree_end),
        )

    def remap(self, row_map, num_rows: int) -> AttentionViews:
        """Views over a different row layout, e.g. a call plan's physical rows.

        Parameters
        ----------
        row_map : array_like of int, shape [C]
            New row (``< num_rows``) of every current row; injective.
        num_rows : int
            Rows of the new layout; rows not in ``row_map`` (padding) get no query and are their own
            singleton tree (they attend only to themselves in tree-mask backends).
        """
        if isinstance(row_map, torch.Tensor):
            row_map = row_map.to(device=self.device, dtype=torch.int64)
        else:
            row_map = torch.as_tensor(np.asarray(row_map, dtype=np.int64), device=self.device)
        if row_map.numel() != self.num_rows:
            raise InvalidInputError("row_map", f"needs {self.num_rows} entries, got {row_map.numel()}")
        q_index = row_map[self.q_index]
        q_inverse = None
        if num_rows == self.num_rows and self.q_inverse is not None:
            q_inverse = torch.empty_like(self.q_inverse)
            q_inverse[row_map] = self.q_inverse
        # Padding rows: singleton trees with ranks past every real row.
        pre = torch.arange(num_rows, device=self.device, dtype=torch.int32) + self.num_rows
        end = pre + 1
        pre[row_map] = self.tree_pre
        end[row_map] = self.tree_end
        return AttentionViews(
            q_index,
            row_map[self.kv_index],
            self.cu_seqlens_q,
            self.cu_seqlens_k,
            self.max_seqlen_q,
            self.max_seqlen_k,
            num_rows,
            q_inverse,
            pre,
            end,
        )


def build_views(row_parent, branches: Branches, tree: TreeOrder | None = None) -> AttentionViews:
    """Build packed Q / KV index views for a branch decomposition.

    Parameters
    ----------
    row_parent : array_like of int, shape [C]
        Parent row of each compact row, -1 for a first token.
    branches : Branches
        Chains of current rows; each row may be current in at most one branch.
    tree : TreeOrder, optional
        Preorder coordinates of the rows (computed from ``row_parent`` when omitted).

    Returns
    -------
    AttentionViews
        On the CPU; move with :meth:`AttentionViews.to`.

    Raises
    ------
    InvalidInputError
        ``field="branches"``: a row out of range, current in two branches, an empty branch, or a branch row whose parent
        is not the row before it; the message names the branch and row.
    """
    parent = np.asarray(row_parent, dtype=np.int64)
    c = len(parent)
    rows, cu = np.asarray(branches.rows, dtype=np.int64), np.asarray(branches.cu, dtype=np.int64)
    n_b = len(cu) - 1
    lengths = np.diff(cu)
    if n_b and (lengths <= 0).any():
        raise InvalidInputError("branches", f"branch {int(np.argmax(lengths <= 0))} is empty")
    if rows.size and (rows.min() < 0 or rows.max() >= c):
        raise InvalidInputError("branches", f"row out of range [0, {c})")
    uses = np.bincount(rows, minlength=c)
    if (uses > 1).any():
        raise InvalidInputError(
            "branches", f"row {int(np.argmax(uses > 1))} is a current row of two branches"
        )
    follows = np.ones(len(rows), dtype=bool)
    follows[cu[:-1]] = False
    bad = np.nonzero(follows & (parent[rows] != np.roll(rows, 1)))[0]
    if bad.size:
        i = int(bad[0])
        b = int(np.searchsorted(cu, i, side="right") - 1)
        raise InvalidInputError(
            "branches",
            f"branch {b} is not a chain: row {int(rows[i])} follows row "
            f"{int(rows[i - 1])} but its parent is {int(parent[rows[i]])}",
        )

    # Ancestor paths, a run of consecutive rows at a time.
    run_start = _run_starts(parent)
    lo: list[int] = []
    hi: list[int] = []
    h = np.zeros(n_b, dtype=np.int64)
    for b, first in enumerate(rows[cu[:-1]].tolist()):
        r = int(parent[first])
        b_lo, b_hi = [], []
        while r >= 0:
            s = int(run_start[r])
            b_lo.append(s)
            b_hi.append(r + 1)
            h[b] += r + 1 - s
            r = int(parent[s])
        lo.extend(reversed(b_lo))
        hi.extend(reversed(b_hi))
    ancestors = expand_ranges(np.array(lo, dtype=np.int64), np.array(hi, dtype=np.int64))

    kv_len = h + lengths
    cu_k = np.zeros(n_b + 1, dtype=np.int64)
    np.cumsum(kv_len, out=cu_k[1:])
    branch_of = np.repeat(np.arange(n_b), kv_len)
    is_ancestor = np.arange(int(cu_k[-1]), dtype=np.int64) - cu_k[branch_of] < h[branch_of]
    kv_index = np.empty(int(cu_k[-1]), dtype=np.int64)
    kv_index[is_ancestor] = ancestors
    kv_index[~is_ancestor] = rows

    q_inverse = None
    if len(rows) == c:
        q_inverse = np.empty(c, dtype=np.int64)
        q_inverse[rows] = np.arange(c, dtype=np.int64)
    if tree is None:
        tree = TreeOrder.from_parent(parent)
    as_t = lambda a, dt=torch.int64: torch.from_numpy(np.ascontiguousarray(a)).to(dt)
    return AttentionViews(
        q_index=as_t(rows),
        kv_index=as_t(kv_index),
        cu_seqlens_q=as_t(cu, torch.int32),
        cu_seqlens_k=as_t(cu_k, torch.int32),
        max_seqlen_q=int(lengths.max()) if n_b else 0,
        max_seqlen_k=int(kv_len.max()) if n_b else 0,
        num_rows=c,
        q_inverse=None if q_inverse is None else as_t(q_inverse),
        tree_pre=as_t(tree.pre, torch.int32),
        tree_end=as_t(tree.end, torch.int32),
    )
