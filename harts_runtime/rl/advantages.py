"""Advantage estimators over a step's leaves (:data:`ESTIMATORS`), for per-leaf and per-turn rewards.

Returns. A leaf's action tokens, all turns in order, are ``k = 0 .. K-1``. Its rewards sit on them:
a per-leaf reward ``r`` on the last action token; per-turn rewards ``r_t`` each on the last action
token of turn ``t`` (of the last non-empty turn at or before ``t``; the first action token when
there is none). With ``R_k`` the reward on token ``k`` and the discount ``gamma`` in ``[0, 1]``,
token ``k``'s return is ``G_k = sum_{k' >= k} gamma^(k' - k) R_{k'}``, and ``G_t``, turn ``t``'s
return, is ``G`` at its first action token. Per-leaf rewards with ``gamma = 1`` give ``G_k = r``
for every token.

``grpo`` (per leaf ``i`` of prompt ``g``; each action token ``k`` of turn ``t``)::

    A_{i,k} = (G_{i,k} - mean_{j in g} G_{j,t}) / (std_{j in g} G_{j,t} + eps)

the group baseline of each turn over the leaves' returns from that turn on. With per-leaf rewards
and ``gamma = 1`` this is GRPO's ``(r_i - mean_g r) / (std_g r + eps)`` on every action token.

``tree`` (uses each fork's siblings as the baseline). A node ``n`` of a prompt's tree is a path
prefix; ``V_t(n)`` is the mean of ``G_t`` over the leaves below it. The action tokens of turn ``t``
of a leaf lie below ``d(t)`` forks (the forks at turns ``<= t``); with ``n_d`` the leaf's node at
depth ``d``::

    A(turn t) = (V_t(n_{d(t)}) - V_t(n_{d(t) - 1})) / (std_{j in g} G_{j,t} + eps)     (0 when d(t) = 0)

so each segment is judged against the mean of its siblings' subtrees at the fork that created it;
with per-leaf rewards and ``gamma = 1`` (``G_t = r``) the advantages along a leaf's path telescope
to GRPO's unnormalised ``r_i - mean_g r``. Tokens above the first fork (no siblings) get 0. ``std``
is the population standard deviation; a leaf whose turn ``t`` is empty is left out of turn ``t``'s
statistics.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from harts_runtime.errors import InvalidInputError
from harts_runtime.rl.sampler import Leaf

__all__ = ["ESTIMATORS", "advantages", "grpo_advantages", "token_returns", "tree_advantages", "turn_returns"]

EPS = 1e-6


def _check_gamma(gamma) -> float:
    ok = isinstance(gamma, (int, float)) and not isinstance(gamma, bool)
    if not ok or not 0.0 <= float(gamma) <= 1.0 or math.isnan(float(gamma)):
        raise InvalidInputError("gamma", f"a discount in [0, 1], got {gamma!r}")
    return float(gamma)


def token_returns(leaf: Leaf, gamma: float = 1.0) -> list[float]:
    """``G_k`` of each action token of ``leaf`` (module docstring)."""
    sizes = [b - a for _, a, b in leaf.segments]
    rewards = [0.0] * sum(sizes)
    if not rewards:
        return []
    if leaf.turn_rewards is None:
        rewards[-1] += leaf.reward
    else:
        end = 0
        for size, r in zip(sizes, leaf.turn_rewards):
            end += size
            rewards[max(end - 1, 0)] += r
    out, g = [0.0] * len(rewards), 0.0
    for k in range(len(rewards) - 1, -1, -1):
        g = rewards[k] + gamma * g
        out[k] = g
    return out


def turn_returns(leaf: Leaf, gamma: float = 1.0) -> list[float | None]:
    """``G_t`` of each turn of ``leaf`` (None for a turn without action tokens)."""
    g = token_returns(leaf, gamma)
    out: list[float | None] = []
    k = 0
    for _, a, b in leaf.segments:
        out.append(g[k] if b > a else None)
        k += b - a
    return out


def _turn_stats(
    leaves: list[Leaf], returns: list[list[float | None]]
) -> dict[tuple[int, int], tuple[float, float]]:
    """``(prompt, turn) -> (mean, std)`` of the turn's returns over the prompt's leaves."""
    by: dict[tuple[int, int], list[float]] = defaultdict(list)
    for lf, rets in zip(leaves, returns):
        for t, g in enumerate(rets):
            if g is not None:
                by[(lf.prompt, t)].append(g)
    return {key: (float(np.mean(v)), float(np.std(v))) for key, v in by.items()}


def grpo_advantages(
    leaves: list[Leaf], forks: dict[int, int] | None = None, gamma: float = 1.0
) -> list[list[float]]:
    """Per leaf, one advantage per action token (module docstring)."""
    gamma = _check_gamma(gamma)
    tokens = [token_returns(lf, gamma) for lf in leaves]
    returns = [turn_returns(lf, gamma) for lf in leaves]
    stats = _turn_stats(leaves, returns)
    out = []
    for lf, g in zip(leaves, tokens):
        adv, k = [], 0
        for t, (_, a, b) in enumerate(lf.segments):
            if b > a:
                mean, std = stats[(lf.prompt, t)]
                adv.extend((g[k + j] - mean) / (std + EPS) for j in range(b - a))
            k += b - a
        out.append(adv)
    return out


def tree_advantages(leaves: list[Leaf], forks: dict[int, int], gamma: float = 1.0) -> list[list[float]]:
    """Per leaf, one advantage per action token: each turn's segment against its fork's siblings."""
    gamma = _check_gamma(gamma)
    returns = [turn_returns(lf, gamma) for lf in leaves]
    sums: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0])
    for lf, rets in zip(leaves, returns):
        for t, g in enumerate(rets):
            if g is None:
                continue
            for d in range(len(lf.path) + 1):
                s = sums[(lf.prompt, t, lf.path[:d])]
                s[0] += g
                s[1] += 1

    def value(prompt, turn, path):
        s, n = sums[(prompt, turn, path)]
        return s / n

    stats = _turn_stats(leaves, returns)
    fork_turns = sorted(t for t, k in forks.items() if int(k) > 1)
    out = []
    for lf in leaves:
        adv = []
        for turn, s, b in lf.segments:
            if b == s:
                continue
            d = sum(1 for t in fork_turns if t <= turn)
            a = 0.0
            if d:
                a = value(lf.prompt, turn, lf.path[:d]) - value(lf.prompt, turn, lf.path[: d - 1])
            adv.extend([a / (stats[(lf.prompt, turn)][1] + EPS)] * (b - s))
        out.append(adv)
    return out


ESTIMATORS = {"grpo": grpo_advantages, "tree": tree_advantages}


def advantages(name: str, leaves: list[Leaf], forks: dict[int, int], gamma: float = 1.0) -> list[list[float]]:
    """The estimator ``name``'s per-action-token advantages of every leaf; ``gamma``: the discount
    of per-turn rewards (and of a per-leaf reward) to earlier tokens (module docstring)."""
    if name not in ESTIMATORS:
        raise InvalidInputError("advantage", f"unknown estimator {name!r}; choose from {sorted(ESTIMATORS)}")
    return ESTIMATORS[name](leaves, forks, gamma)
