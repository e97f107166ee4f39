"""Test-only code: random rollout trees, fresh tokens, and the decompositions and dense masks that
check the runtime's index views against the tree (also used by the benchmarks).

Nothing here is used by training. It builds small batches whose compact and expanded (trajectory-
wise) computations can be compared (:func:`random_batch`, :func:`synthetic_tree_batch`,
:class:`FreshTokens`, :class:`SimpleBatch`), the attention branch decompositions other than the
train step's one-branch-per-packed-sequence (:func:`segment_branches`, :func:`chain_branches`,
:func:`path_branches`, :func:`run_branches`, :func:`views_from_batch`), and dense ``[C, C]`` masks of
what views and tree orders define (:func:`tree_dense_mask`, :func:`views_dense_mask`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.layout.views import (
    AttentionViews,
    Branches,
    TreeOrder,
    _run_starts,
    build_views,
    expand_ranges,
)

__all__ = [
    "FreshTokens",
    "SimpleBatch",
    "chain_branches",
    "make_batch",
    "path_branches",
    "random_batch",
    "random_trajectories",
    "run_branches",
    "segment_branches",
    "synthetic_tree_batch",
    "trajectory_rows",
    "tree_dense_mask",
    "views_dense_mask",
    "views_from_batch",
]


class FreshTokens:
    """Hands out token ids never used before (1, 2, 3, ...), so that the only sharing between the
    trajectories a test builds is the prefixes it copies on purpose. With ``wrap`` the ids are
    ``x % wrap + 1`` (to stay inside a small vocabulary; ids then repeat every ``wrap`` tokens)."""

    def __init__(self, wrap: int | None = None):
        self.next = 1
        self.wrap = wrap

    def __call__(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out if self.wrap is None else [x % self.wrap + 1 for x in out]


class SimpleBatch:
    """Pure-Python stand-in for :class:`harts_planner.RolloutBatch` (the compact trie only), for
    machines without the compiled planner. Rows are numbered in the lexicographic DFS preorder of
    the token trie, as in RolloutBatch; there is no segment forest (build views with
    :func:`run_branches`).
    """

    def __init__(self, trajectories):
        trajectories = [list(map(int, t)) for t in trajectories]
        lengths = np.array([len(t) for t in trajectories], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.tokens = np.array([x for t in trajectories for x in t], dtype=np.int32)
        children: list[dict[int, int]] = [{}]  # node 0: virtual root
        node_parent, node_of = [-1], np.empty(len(self.tokens), dtype=np.int64)
        s = 0
        for t in trajectories:
            cur = 0
            for tok in t:
                nxt = children[cur].get(tok)
                if nxt is None:
                    nxt = len(children)
                    children[cur][tok] = nxt
                    children.append({})
                    node_parent.append(cur)
                cur = nxt
                node_of[s] = cur
                s += 1
        row_of = np.full(len(children), -1, dtype=np.int64)
        depth_of = np.zeros(len(children), dtype=np.int64)
        stack, counter = [(0, -1)], -1
        while stack:
            node, depth = stack.pop()
            row_of[node], depth_of[node] = counter, depth
            counter += 1
            stack.extend((children[node][k], depth + 1) for k in sorted(children[node], reverse=True))
        c = len(children) - 1
        parent_row = row_of[np.array(node_parent, dtype=np.int64)[1:]]
        self.row_parent = np.empty(c, dtype=np.int32)
        self.row_parent[row_of[1:]] = parent_row
        self.row_depth = np.empty(c, dtype=np.int32)
        self.row_depth[row_of[1:]] = depth_of[1:]
        self.compact_map = row_of[node_of].astype(np.int32)
        self.multiplicity = np.bincount(self.compact_map, minlength=c).astype(np.int32)
        self.num_trajectories, self.semantic_tokens, self.compact_tokens = len(trajectories), s, c

    @property
    def compression(self) -> float:
        return self.semantic_tokens / self.compact_tokens


def make_batch(trajectories):
    """A RolloutBatch when ``harts_planner`` is installed, else a :class:`SimpleBatch`."""
    try:
        from harts_planner.batch import RolloutBatch
    except ImportError:
        return SimpleBatch(trajectories)
    return RolloutBatch.from_token_lists(trajectories)


def random_trajectories(rng, num: int = 8, **kwargs) -> list[list[int]]:
    """The suites' one random-tree generator, :func:`harts_planner.synth.random_trajectories`
    (imported on call: importing this module needs no planner, see :class:`SimpleBatch`)."""
    from harts_planner.synth import random_trajectories as generate

    return generate(rng, num, **kwargs)


def random_batch(seed: int, **kwargs):
    """:func:`make_batch` of :func:`random_trajectories` with ``seed``."""
    return make_batch(random_trajectories(np.random.default_rng(seed), **kwargs))


def synthetic_tree_batch(
    seed: int,
    prompt: int,
    turns: int,
    turn_len: tuple[int, int],
    fork_prob: float,
    fanout: int,
    vocab: int = 32_000,
    max_tokens: int | None = None,
):
    """An agentic-looking tree (a prompt, then turns that fork into ``fanout`` children with
    probability ``fork_prob``), as :func:`make_batch`. Used by the benchmarks.

    Each node is a turn of uniform length in ``turn_len``; every root-to-leaf path is a trajectory.
    Trajectories are cut at ``max_tokens``.
    """
    rng = np.random.default_rng(seed)
    root = rng.integers(0, vocab, prompt).tolist()
    frontier = [root]
    for _ in range(turns):
        nxt = []
        for path in frontier:
            k = fanout if rng.random() < fork_prob else 1
            for _ in range(k):
                nxt.append(
                    path + rng.integers(0, vocab, int(rng.integers(turn_len[0], turn_len[1] + 1))).tolist()
                )
        frontier = nxt
    if max_tokens is not None:
        frontier = [p[:max_tokens] for p in frontier]
    return make_batch(frontier)


def trajectory_rows(batch) -> list[np.ndarray]:
    """Compact row of every position of every trajectory: ``compact_map`` split by ``offsets``."""
    m, off = batch.compact_map, batch.offsets
    return [np.asarray(m[off[i] : off[i + 1]], dtype=np.int64) for i in range(batch.num_trajectories)]


# ------------------------------------------------------------------ test decompositions of the views
def segment_branches(batch) -> Branches:
    """One branch per segment of a :class:`harts_planner.RolloutBatch` (its rows, in order)."""
    begin = np.asarray(batch.segment_row_begin, dtype=np.int64)
    lengths = np.asarray(batch.segment_end, dtype=np.int64) - np.asarray(batch.segment_start, dtype=np.int64)
    cu = np.zeros(len(begin) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    return Branches(expand_ranges(begin, begin + lengths), cu)


def chain_branches(batch, chains: Sequence[Sequence[int]]) -> Branches:
    """One branch per chain of segments (each a parent-to-child path of segment ids).

    The rows of a chain are its segments' rows in order; :func:`build_views` checks that the chains
    are root-to-node paths and that together they cover each row at most once.
    """
    begin = np.asarray(batch.segment_row_begin, dtype=np.int64)
    lengths = np.asarray(batch.segment_end, dtype=np.int64) - np.asarray(batch.segment_start, dtype=np.int64)
    segs = (
        np.concatenate([np.asarray(c, dtype=np.int64) for c in chains])
        if chains
        else np.zeros(0, dtype=np.int64)
    )
    per_chain = np.array([int(lengths[np.asarray(c, dtype=np.int64)].sum()) for c in chains], dtype=np.int64)
    cu = np.zeros(len(chains) + 1, dtype=np.int64)
    np.cumsum(per_chain, out=cu[1:])
    return Branches(expand_ranges(begin[segs], begin[segs] + lengths[segs]), cu)


def run_branches(row_parent) -> Branches:
    """Maximal runs of consecutive rows ``r, r + 1, ...`` with ``parent[r + 1] = r``, from the parent
    array alone. With rows in DFS preorder (a RolloutBatch) these are the direct-continuation chains
    of :func:`path_branches`; in any other row order they are still a valid (finer) decomposition.
    """
    parent = np.asarray(row_parent, dtype=np.int64)
    starts = np.unique(_run_starts(parent))
    return Branches(np.arange(len(parent), dtype=np.int64), np.append(starts, len(parent)).astype(np.int64))


def path_branches(batch) -> Branches:
    """Direct-continuation chains: a chain starts at every root and every non-first child segment and
    continues into the first child. Segments and rows are in preorder, so each chain is a contiguous
    row range and there is one branch per leaf segment.

    The packed KV length ``C + sum over forks v of (|ch(v)| - 1) * e_v`` does not depend on which
    child continues, so this choice is as good as any for attention.
    """
    parent = np.asarray(batch.segment_parent, dtype=np.int64)
    begin = np.asarray(batch.segment_row_begin, dtype=np.int64)
    is_start = parent != np.arange(len(parent)) - 1
    is_start[:1] = True
    starts = np.nonzero(is_start)[0]
    cu = np.append(begin[starts], batch.compact_tokens).astype(np.int64)
    return Branches(np.arange(batch.compact_tokens, dtype=np.int64), cu)


def views_from_batch(batch, decomposition: str = "paths", chains=None) -> AttentionViews:
    """Views of a whole :class:`harts_planner.RolloutBatch`.

    Parameters
    ----------
    decomposition : {"paths", "segments", "chains"}
        ``paths``: :func:`path_branches` (one branch per leaf, fewest branches); ``segments``: one
        branch per segment; ``chains``: the given ``chains`` of segment ids.
    """
    if not hasattr(batch, "segment_row_begin"):  # a trie without segments (testing.SimpleBatch)
        if decomposition != "paths":
            raise InvalidInputError(
                "decomposition", f"{decomposition!r} needs a RolloutBatch's segment forest"
            )
        return build_views(batch.row_parent, run_branches(batch.row_parent))
    if decomposition == "paths":
        branches = path_branches(batch)
    elif decomposition == "segments":
        branches = segment_branches(batch)
    elif decomposition == "chains":
        if chains is None:
            raise InvalidInputError("chains", "required for decomposition='chains'")
        branches = chain_branches(batch, chains)
    else:
        raise InvalidInputError(
            "decomposition", f"unknown {decomposition!r}; choose paths, segments or chains"
        )
    return build_views(batch.row_parent, branches, TreeOrder.from_batch(batch))


def tree_dense_mask(tree: TreeOrder) -> np.ndarray:
    """bool [C, C]: ``mask[q, k]`` iff row k is an ancestor of, or equal to, row q."""
    return (tree.pre[None, :] <= tree.pre[:, None]) & (tree.pre[:, None] < tree.end[None, :])


def views_dense_mask(views: AttentionViews) -> torch.Tensor:
    """bool [C, C]: ``mask[q_row, kv_row]`` as the views define it (Equation 22)."""
    c = views.num_rows
    mask = torch.zeros(c, c, dtype=torch.bool)
    cq, ck = views.cu_seqlens_q.tolist(), views.cu_seqlens_k.tolist()
    qi, ki = views.q_index.cpu(), views.kv_index.cpu()
    for b in range(views.num_branches):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        h = lk - lq
        allowed = torch.arange(lk)[None, :] <= h + torch.arange(lq)[:, None]  # [lq, lk]
        rows, cols = qi[cq[b] : cq[b + 1]], ki[ck[b] : ck[b + 1]]
        mask[rows[:, None].expand(lq, lk)[allowed], cols[None, :].expand(lq, lk)[allowed]] = True
    return mask
