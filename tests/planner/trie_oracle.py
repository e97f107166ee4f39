"""Brute-force pure-Python oracle for rollout-batch ingestion: a dict trie over token prefixes.

Slow and obviously correct; used by the property tests on small batches only.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class NaiveBatch:
    order: list[int]  # stable lexicographic order
    adjacent_lcp: list[int]
    prefix_count: dict[tuple, int]  # distinct prefix -> multiplicity
    segment_ends: set[tuple]  # prefixes at which a segment ends

    @property
    def compact_tokens(self) -> int:
        return len(self.prefix_count)


def lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def naive_ingest(trajs: list[list[int]]) -> NaiveBatch:
    order = sorted(range(len(trajs)), key=lambda i: (list(trajs[i]), i))
    adj = [0] + [lcp(trajs[order[r - 1]], trajs[order[r]]) for r in range(1, len(order))]
    counts: dict[tuple, int] = {}
    children: dict[tuple, set] = {}
    for t in trajs:
        for p in range(1, len(t) + 1):
            pre = tuple(t[:p])
            counts[pre] = counts.get(pre, 0) + 1
            if p < len(t):
                children.setdefault(pre, set()).add(t[p])
    ends = {tuple(t) for t in trajs}
    seg_ends = {pre for pre in counts if len(children.get(pre, ())) != 1 or pre in ends}
    return NaiveBatch(order, adj, counts, seg_ends)


def subset_work(trajs: list[list[int]], subset) -> int:
    return len({tuple(trajs[i][:p]) for i in subset for p in range(1, len(trajs[i]) + 1)})
