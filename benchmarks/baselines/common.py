"""Shared pieces of the baselines: the plan type, exact work helpers and equalizing splits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from harts_planner import RolloutBatch


@dataclass
class BaselinePlan:
    """A step plan produced by a baseline.

    ``microbatches[m]`` holds trajectory indices; it runs on ``replica[m]`` in ``slot[m]``.
    ``planning_seconds`` covers the baseline's planning after ingestion (the same scope as
    ``StepPlan.planning_seconds``); ``details`` holds baseline-specific diagnostics.
    """

    name: str
    microbatches: list[np.ndarray]
    replica: np.ndarray
    slot: np.ndarray
    planning_seconds: float
    details: dict = field(default_factory=dict)


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start


def sorted_by_rank(batch: RolloutBatch, ids) -> np.ndarray:
    """``ids`` (trajectory indices) sorted lexicographically (by rank), as int32."""
    ids = np.asarray(ids, dtype=np.int32)
    return ids[np.argsort(batch.rank[ids], kind="stable")]


def member_work(batch: RolloutBatch, ids_by_rank: np.ndarray) -> int:
    """C(M) of lexicographically sorted trajectory indices (Equation 5), via the adjacent LCPs."""
    lengths = batch.lengths[ids_by_rank]
    if len(ids_by_rank) < 2:
        return int(lengths.sum())
    lcps = pair_lcps(batch, ids_by_rank)
    return int(lengths.sum() - lcps.sum())


def pair_lcps(batch: RolloutBatch, ids_by_rank: np.ndarray) -> np.ndarray:
    """LCP of each adjacent pair of lexicographically sorted trajectory indices."""
    ranks = np.asarray(batch.rank)[ids_by_rank].astype(np.int64)
    if len(ranks) < 2:
        return np.zeros(0, dtype=np.int64)
    # LCP of ranks a < b is the minimum adjacent LCP over (a, b].
    adj = np.append(np.asarray(batch.adjacent_lcp, dtype=np.int64), 0)
    idx = np.empty(2 * (len(ranks) - 1), dtype=np.int64)
    idx[0::2] = ranks[:-1] + 1
    idx[1::2] = ranks[1:] + 1
    return np.minimum.reduceat(adj, idx)[0::2]


def cheapest_split(batch: RolloutBatch, ids_by_rank: np.ndarray) -> tuple[int, int]:
    """The cut of a sorted microbatch into two non-empty lexicographic halves that adds the least
    compact work (Equation 6: the LCP at the cut). Returns ``(cost, position)``; ties go to the most
    even split."""
    lcps = pair_lcps(batch, ids_by_rank)
    n = len(ids_by_rank)
    best = None
    for t in range(1, n):
        key = (int(lcps[t - 1]), abs(n - 2 * t))
        if best is None or key < best[0]:
            best = (key, t)
    return best[0][0], best[1]


def equalize_by_splitting(batch: RolloutBatch, per_replica: list[list[np.ndarray]]) -> int:
    """Split microbatches until every replica has as many as the fullest one (in place).

    Each split takes, in a replica short of microbatches, the microbatch with at least two members
    whose cheapest lexicographic split adds the least compact work (ties: the heavier microbatch) and
    cuts it in two. Returns the number of splits. Raises ``ValueError`` when a replica has fewer
    trajectories than the target count.
    """
    target = max(len(mbs) for mbs in per_replica)
    splits = 0
    for mbs in per_replica:
        while len(mbs) < target:
            best = None
            for j, mb in enumerate(mbs):
                if len(mb) < 2:
                    continue
                cost, pos = cheapest_split(batch, mb)
                key = (cost, -member_work(batch, mb))
                if best is None or key < best[0]:
                    best = (key, j, pos)
            if best is None:
                raise ValueError("a replica has fewer trajectories than the common microbatch count")
            _, j, pos = best
            mb = mbs.pop(j)
            mbs.extend([mb[:pos], mb[pos:]])
            splits += 1
    return splits


def slots_by_descending_work(batch: RolloutBatch, per_replica: list[list[np.ndarray]]):
    """Flatten per-replica microbatch lists into (microbatches, replica, slot), each replica running
    its own microbatches heaviest first (slot j = its j-th heaviest). Precondition: equal counts."""
    microbatches, replica, slot = [], [], []
    for d, mbs in enumerate(per_replica):
        works = [member_work(batch, mb) for mb in mbs]
        for j, idx in enumerate(sorted(range(len(mbs)), key=lambda i: (-works[i], i))):
            microbatches.append(mbs[idx])
            replica.append(d)
            slot.append(j)
    return microbatches, np.asarray(replica, dtype=np.int32), np.asarray(slot, dtype=np.int32)


def tree_groups(batch: RolloutBatch) -> dict[int, np.ndarray]:
    """Trajectory indices of each rollout tree (``batch.tree_ids``), each sorted by rank."""
    tree_ids = np.asarray(batch.tree_ids)
    order = np.argsort(tree_ids, kind="stable")
    groups = {}
    bounds = np.flatnonzero(np.diff(tree_ids[order])) + 1
    for chunk in np.split(order, bounds):
        groups[int(tree_ids[chunk[0]])] = sorted_by_rank(batch, chunk)
    return groups
