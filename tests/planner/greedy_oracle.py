"""Brute-force oracle of the trie-aware greedy candidate (``harts/greedy.h``: RunGreedy): every
placement probes every microbatch, elimination probes every surviving one, alignment rescans every
member. Quadratic and plain Python, for batches of tens of trajectories; the C++ planner's greedy
candidate (its PlacementIndex and step budget) must match it, tie rules included."""

from __future__ import annotations

import numpy as np

from harts_planner import RolloutBatch

ORDERS = ("lex-ascending", "lex-descending", "length-descending", "unique-suffix")
POLICIES = ("best-fit", "max-shared")


class _Ranks:
    """Lengths and LCPs by lexicographic rank."""

    def __init__(self, batch: RolloutBatch, capacity: int):
        self.n = n = batch.num_trajectories
        self.length = [int(x) for x in np.asarray(batch.lengths)[np.asarray(batch.order)]]
        self.adjacent = [int(x) for x in np.asarray(batch.adjacent_lcp)]
        self.capacity = capacity
        adjacent = np.asarray(batch.adjacent_lcp, dtype=np.int64)
        table = np.zeros((n, n), dtype=np.int64)  # LCP of every pair of ranks, by running minima
        for a in range(n):
            table[a, a] = self.length[a]
            table[a, a + 1 :] = np.minimum.accumulate(adjacent[a + 1 :])
        self.table = np.maximum(table, table.T).tolist()

    def lcp(self, a: int, b: int) -> int:
        return self.table[a][b]

    def shared(self, members: list[int], r: int, exclude: int = -1) -> int:
        """max(LCP(p, r), LCP(r, q)) for p / q the members just below / above r (skipping r and
        ``exclude``)."""
        below = [m for m in members if m < r and m != exclude]
        above = [m for m in members if m > r and m != exclude]
        return max(self.lcp(below[-1], r) if below else 0, self.lcp(r, above[0]) if above else 0)

    def work(self, members: list[int]) -> int:
        return sum(self.length[m] - (self.lcp(members[i - 1], m) if i else 0) for i, m in enumerate(members))


def processing_order(rk: _Ranks, order: str) -> list[int]:
    ranks = list(range(rk.n))
    if order == "lex-descending":
        return ranks[::-1]
    if order == "length-descending":
        return sorted(ranks, key=lambda r: -rk.length[r])  # stable: ties by rank
    if order == "unique-suffix":

        def unique(r: int) -> int:
            lp = rk.adjacent[r] if r > 0 else 0
            lq = rk.adjacent[r + 1] if r + 1 < rk.n else 0
            return rk.length[r] - max(lp, lq)

        return sorted(ranks, key=lambda r: -unique(r))
    return ranks


def place(rk: _Ranks, seq: list[int], policy: str) -> list[list[int]]:
    groups: list[list[int]] = []
    works: list[int] = []
    for r in seq:
        best, best_key, best_after = -1, -1, -1
        for k, m in enumerate(groups):
            shared = rk.shared(m, r)
            after = works[k] + rk.length[r] - shared
            if after > rk.capacity:
                continue
            key = after if policy == "best-fit" else shared
            if key > best_key or (key == best_key and after > best_after):
                best, best_key, best_after = k, key, after
        if best < 0:
            groups.append([r])
            works.append(rk.length[r])
        else:
            groups[best] = sorted([*groups[best], r])
            works[best] = best_after
    return groups


def eliminate(rk: _Ranks, groups: list[list[int]]) -> list[list[int]]:
    works = [rk.work(m) for m in groups]
    visit = sorted(range(len(groups)), key=lambda c: works[c])  # stable: ties by index
    removed = [False] * len(groups)
    for c in visit:
        saved = ([list(m) for m in groups], list(works))
        ok = True
        for r in saved[0][c]:
            best, best_delta, best_after = -1, 0, 0
            for d in range(len(groups)):
                if d == c or removed[d]:
                    continue
                delta = rk.length[r] - rk.shared(groups[d], r)
                after = works[d] + delta
                if after > rk.capacity:
                    continue
                if best < 0 or delta < best_delta or (delta == best_delta and after > best_after):
                    best, best_delta, best_after = d, delta, after
            if best < 0:
                ok = False
                break
            groups[best] = sorted([*groups[best], r])
            works[best] = best_after
        if ok:
            removed[c] = True
        else:
            groups, works = saved
    return [m for c, m in enumerate(groups) if not removed[c]]


def align(rk: _Ranks, groups: list[list[int]], dp_size: int) -> list[list[int]] | None:
    target = -(-len(groups) // dp_size) * dp_size
    if target > rk.n:
        return None
    groups = [list(m) for m in groups]
    while len(groups) < target:
        best = None  # (cost, rank, group)
        for k, m in enumerate(groups):
            if len(m) < 2:
                continue
            for r in m:
                cost = rk.shared(m, r, exclude=r)
                if best is None or (cost, r) < best[:2]:
                    best = (cost, r, k)
        _, r, k = best
        groups[k].remove(r)
        groups.append([r])
    return groups


def greedy_candidate(batch: RolloutBatch, dp_size: int, capacity: int) -> tuple[str, int, int] | None:
    """(name, K, total work) of RunGreedy's plan, or None when no plan aligns to D."""
    rk = _Ranks(batch, capacity)
    best = None
    for order in ORDERS:
        seq = processing_order(rk, order)
        for policy in POLICIES:
            groups = align(rk, eliminate(rk, place(rk, seq, policy)), dp_size)
            if groups is None:
                continue
            key = (len(groups), sum(rk.work(m) for m in groups))
            if best is None or key < best[0]:
                best = (key, f"{order}/{policy}")
    return None if best is None else (best[1], best[0][0], best[0][1])
