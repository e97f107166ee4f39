"""AReaL-DTA's DP load balancer (``areal/experimental/dta/dp.py``, ``LB_by_DFS_and_TM``), adapted.

What AReaL-DTA does (``shared/references/peers.md`` section 2): sort the sequences lexicographically,
take the DFS order of the compressed trie's leaves, and binary-search the smallest max-cost threshold
for which contiguous cuts of that order (each cut itself found by binary search) give at most one
group per DP rank; at rollout redistribution the cost of a group is its tree tokens
(``_TreeTokenOnlyTimeModel``).

DTA itself runs each rank's whole group with its DFS stack engine and has no microbatch capacity or
slot schedule, so HARTS's guarantees need an adaptation, ours:

1. Replicas: the DFS leaf order is the lexicographic trajectory order (ranks); a group's cost is its
   compact work ``W(lo, hi)`` (tree tokens). Binary search on the threshold ``theta`` over
   ``[max_r len(r), G]``; for each ``theta`` the greedy cuts take the longest prefix of the remaining
   ranks with ``W <= theta`` (binary search, ``W`` is monotone). The smallest ``theta`` needing at
   most ``D`` groups wins; an empty tail group cannot occur when ``N >= D`` because groups are then
   split at their cheapest cut (Equation 6) until there are ``D``.
2. Microbatches: every replica is cut the same way into ``m`` contiguous microbatches with the
   smallest max work, ``m`` = the largest per-replica count needed to keep every part ``<= T``; when
   the greedy cuts give fewer than ``m`` parts, the part with the cheapest cut is split until there
   are ``m``.
3. Slots: replica ``d`` runs its parts in DFS order (slot ``j`` = its ``j``-th part), as DTA's engine
   walks its leaves.
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from baselines.common import BaselinePlan, cheapest_split
from harts_planner import RolloutBatch


class _Work:
    """O(1) W(lo, hi) over ranks from prefix sums (Equation 5)."""

    def __init__(self, batch: RolloutBatch):
        lengths = np.asarray(batch.lengths, dtype=np.int64)[np.asarray(batch.order)]
        lcp = np.asarray(batch.adjacent_lcp, dtype=np.int64)
        self.pl = np.concatenate(([0], np.cumsum(lengths)))
        self.pc = np.concatenate(([0], np.cumsum(lcp)))
        self.n = len(lengths)
        self.max_len = int(lengths.max())

    def __call__(self, lo: int, hi: int) -> int:
        return int(self.pl[hi] - self.pl[lo] - (self.pc[hi] - self.pc[lo + 1]))

    def longest(self, lo: int, hi_max: int, theta: int) -> int:
        """Largest hi in (lo, hi_max] with W(lo, hi) <= theta (at least lo + 1)."""
        a, b = lo + 1, hi_max
        while a < b:
            mid = (a + b + 1) // 2
            if self(lo, mid) <= theta:
                a = mid
            else:
                b = mid - 1
        return a


def greedy_cuts(w: _Work, lo: int, hi: int, theta: int) -> list[int]:
    cuts = [lo]
    while cuts[-1] < hi:
        cuts.append(w.longest(cuts[-1], hi, theta))
    return cuts


def minimax_cuts(w: _Work, lo: int, hi: int, parts: int) -> list[int]:
    """Contiguous cuts of ranks [lo, hi) into at most ``parts`` groups with the smallest max work."""
    a, b = max(w(r, r + 1) for r in range(lo, hi)), w(lo, hi)
    while a < b:
        mid = (a + b) // 2
        if len(greedy_cuts(w, lo, hi, mid)) - 1 <= parts:
            b = mid
        else:
            a = mid + 1
    return greedy_cuts(w, lo, hi, a)


def _split_to(batch: RolloutBatch, order: np.ndarray, cuts: list[int], parts: int) -> list[int]:
    """Split parts at their cheapest cut until there are ``parts`` of them."""
    cuts = list(cuts)
    while len(cuts) - 1 < parts:
        best = None
        for j in range(len(cuts) - 1):
            if cuts[j + 1] - cuts[j] < 2:
                continue
            cost, pos = cheapest_split(batch, order[cuts[j] : cuts[j + 1]])
            if best is None or cost < best[0]:
                best = (cost, j, cuts[j] + pos)
        if best is None:
            raise ValueError(f"cannot make {parts} non-empty parts")
        cuts.insert(best[1] + 1, best[2])
    return cuts


def plan(batch: RolloutBatch, dp_size: int, capacity: int) -> BaselinePlan:
    start = time.perf_counter()
    w = _Work(batch)
    order = np.asarray(batch.order, dtype=np.int32)
    n = w.n
    replica_cuts = _split_to(batch, order, minimax_cuts(w, 0, n, dp_size), dp_size)
    ranges = list(itertools.pairwise(replica_cuts))
    m = max(len(greedy_cuts(w, lo, hi, capacity)) - 1 for lo, hi in ranges)
    microbatches, replica, slot = [], [], []
    for d, (lo, hi) in enumerate(ranges):
        cuts = _split_to(batch, order[lo:hi], [c - lo for c in minimax_cuts(w, lo, hi, m)], m)
        for j in range(m):
            microbatches.append(order[lo + cuts[j] : lo + cuts[j + 1]])
            replica.append(d)
            slot.append(j)
    seconds = time.perf_counter() - start
    return BaselinePlan(
        "areal-dta",
        microbatches,
        np.asarray(replica, dtype=np.int32),
        np.asarray(slot, dtype=np.int32),
        seconds,
        {"replica_work": [w(lo, hi) for lo, hi in ranges], "microbatches_per_replica": m},
    )
