"""Advantage estimators over a step's leaves (:data:`ESTIMATORS`).

``grpo`` (per leaf ``i`` of prompt ``g``, every action token alike)::

    A_i = (r_i - mean_{j in g} r_j) / (std_{j in g} r_j + eps)

``tree`` (uses each fork's siblings as the baseline). A node ``n`` of a prompt's tree is a path
prefix; its value ``V(n)`` is the mean reward of the leaves below it (a leaf's value is its reward).
The action tokens of turn ``t`` of a leaf lie below ``d(t)`` forks (the forks at turns ``<= t``);
with ``n_d`` the leaf's node at depth ``d``::

    A(turn t) = (V(n_{d(t)}) - V(n_{d(t) - 1})) / (std_{j in g} r_j + eps)     (0 when d(t) = 0)

so each segment is judged against the mean of its siblings' subtrees at the fork that created it,
and the advantages along a leaf's path telescope to GRPO's unnormalised ``r_i - mean_g r``. Tokens
above the first fork (no siblings) get 0. ``std`` is the population standard deviation.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from harts_runtime.errors import InvalidInputError
from harts_runtime.rl.sampler import Leaf

__all__ = ["ESTIMATORS", "advantages", "grpo_advantages", "tree_advantages"]

EPS = 1e-6


def _group_std(leaves: list[Leaf]) -> dict[int, float]:
    by = defaultdict(list)
    for lf in leaves:
        by[lf.prompt].append(lf.reward)
    return {g: float(np.std(v)) for g, v in by.items()}


def grpo_advantages(leaves: list[Leaf], forks: dict[int, int] | None = None) -> list[list[float]]:
    """Per leaf, one advantage per action token (module docstring)."""
    by = defaultdict(list)
    for lf in leaves:
        by[lf.prompt].append(lf.reward)
    stats = {g: (float(np.mean(v)), float(np.std(v))) for g, v in by.items()}
    out = []
    for lf in leaves:
        mean, std = stats[lf.prompt]
        a = (lf.reward - mean) / (std + EPS)
        out.append([a] * sum(b - s for _, s, b in lf.segments))
    return out


def tree_advantages(leaves: list[Leaf], forks: dict[int, int]) -> list[list[float]]:
    """Per leaf, one advantage per action token: each turn's segment against its fork's siblings."""
    sums: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0])
    for lf in leaves:
        for d in range(len(lf.path) + 1):
            s = sums[(lf.prompt, lf.path[:d])]
            s[0] += lf.reward
            s[1] += 1

    def value(prompt, path):
        s, n = sums[(prompt, path)]
        return s / n

    std = _group_std(leaves)
    fork_turns = sorted(t for t, k in forks.items() if int(k) > 1)
    out = []
    for lf in leaves:
        adv = []
        for turn, s, b in lf.segments:
            d = sum(1 for t in fork_turns if t <= turn)
            a = 0.0 if d == 0 else value(lf.prompt, lf.path[:d]) - value(lf.prompt, lf.path[: d - 1])
            adv.extend([a / (std[lf.prompt] + EPS)] * (b - s))
        out.append(adv)
    return out


ESTIMATORS = {"grpo": grpo_advantages, "tree": tree_advantages}


def advantages(name: str, leaves: list[Leaf], forks: dict[int, int]) -> list[list[float]]:
    """The estimator ``name``'s per-action-token advantages of every leaf."""
    if name not in ESTIMATORS:
        raise InvalidInputError("advantage", f"unknown estimator {name!r}; choose from {sorted(ESTIMATORS)}")
    return ESTIMATORS[name](leaves, forks)
