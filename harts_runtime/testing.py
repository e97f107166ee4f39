"""Random rollout trees and trajectory-wise expansion helpers for tests and benchmarks.

Nothing here is used by training; it builds small batches whose compact and expanded (trajectory-
wise) computations can be compared.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "FreshTokens",
    "SimpleBatch",
    "make_batch",
    "random_batch",
    "random_trajectories",
    "synthetic_tree_batch",
    "trajectory_rows",
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
    :func:`harts_runtime.views.run_branches`).
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
        from harts_planner import RolloutBatch
    except ImportError:
        return SimpleBatch(trajectories)
    return RolloutBatch.from_token_lists(trajectories)


def random_trajectories(
    rng: np.random.Generator, num: int = 8, vocab: int = 5, max_new: int = 6, new_tree_prob: float = 0.15
) -> list[list[int]]:
    """Trajectories of a random forest: each one copies a random prefix of an earlier one and appends
    0..``max_new`` random tokens (so forks, prefix trajectories and exact duplicates all occur), or
    starts a new tree. A small ``vocab`` adds accidental sharing.
    """
    trajs = [rng.integers(0, vocab, int(rng.integers(2, 2 + max_new))).tolist()]
    while len(trajs) < num:
        if rng.random() < new_tree_prob:
            trajs.append(rng.integers(0, vocab, int(rng.integers(1, 2 + max_new))).tolist())
            continue
        base = trajs[int(rng.integers(len(trajs)))]
        cut = int(rng.integers(1, len(base) + 1))
        extra = rng.integers(0, vocab, int(rng.integers(0, max_new + 1))).tolist()
        trajs.append(base[:cut] + extra)
    rng.shuffle(trajs)
    return trajs


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
