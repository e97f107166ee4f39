"""Per-turn rewards and the discount in the advantage estimators, against a brute-force reference
written from the formulas (token rewards, returns summed term by term, group statistics per turn,
tree node values as means over the leaves below) on random ragged trees; per-leaf rewards with
``gamma = 1`` give the GRPO and tree advantages of before, exactly."""

from __future__ import annotations

import random
from itertools import product

import numpy as np
import pytest

from harts_runtime.errors import InvalidInputError
from harts_runtime.rl.advantages import EPS, advantages, token_returns
from harts_runtime.rl.sampler import Leaf


def _random_leaves(rng: random.Random, per_turn: bool):
    turns = rng.randint(1, 3)
    forks = {t: rng.randint(1, 3) for t in range(turns)}
    forks[rng.randrange(turns)] = 2
    fork_turns = [t for t in range(turns) if forks[t] > 1]
    leaves = []
    for g in range(rng.randint(1, 3)):
        for path in product(*[range(forks[t]) for t in fork_turns]):
            pos, segs = rng.randint(1, 4), []
            for t in range(turns):
                n = rng.randint(1, 4)
                segs.append((t, pos, pos + n))
                pos += n + rng.randint(0, 3)
            n_act = sum(b - a for _, a, b in segs)
            lf = Leaf(g, [0] * pos, tuple(path), segs, [0.0] * n_act, 0.0)
            if per_turn:
                lf.turn_rewards = [round(rng.uniform(-1, 1), 3) for _ in range(turns)]
                lf.reward = float(sum(lf.turn_rewards))
            else:
                lf.reward = round(rng.uniform(-1, 1), 3)
            leaves.append(lf)
    return leaves, forks


def _ref_returns(lf: Leaf, gamma: float) -> list[float]:
    """Brute force: every token's return summed term by term over the token rewards."""
    tokens = [(t, p) for t, a, b in lf.segments for p in range(a, b)]
    r = [0.0] * len(tokens)
    if lf.turn_rewards is None:
        r[-1] = lf.reward
    else:
        for t, rt in enumerate(lf.turn_rewards):
            last = max(i for i, (u, _) in enumerate(tokens) if u == t)
            r[last] += rt
    return [sum(gamma ** (j - k) * r[j] for j in range(k, len(r))) for k in range(len(r))]


def _ref_turn_return(lf, gamma, turn):
    first = sum(b - a for t, a, b in lf.segments if t < turn)
    return _ref_returns(lf, gamma)[first]


def _ref_grpo(leaves, gamma):
    out = []
    for lf in leaves:
        g = _ref_returns(lf, gamma)
        adv, k = [], 0
        for t, a, b in lf.segments:
            group = [_ref_turn_return(x, gamma, t) for x in leaves if x.prompt == lf.prompt]
            for _ in range(a, b):
                adv.append((g[k] - np.mean(group)) / (np.std(group) + EPS))
                k += 1
        out.append(adv)
    return out


def _ref_tree(leaves, forks, gamma):
    fork_turns = sorted(t for t, k in forks.items() if k > 1)
    out = []
    for lf in leaves:
        adv = []
        for t, a, b in lf.segments:
            d = sum(1 for u in fork_turns if u <= t)
            group = [x for x in leaves if x.prompt == lf.prompt]
            std = np.std([_ref_turn_return(x, gamma, t) for x in group])

            def v(path, t=t, group=group):
                return np.mean([_ref_turn_return(x, gamma, t) for x in group if x.path[: len(path)] == path])

            val = 0.0 if d == 0 else v(lf.path[:d]) - v(lf.path[: d - 1])
            adv.extend([val / (std + EPS)] * (b - a))
        out.append(adv)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_estimators_equal_the_brute_force_formulas(seed):
    rng = random.Random(seed)
    leaves, forks = _random_leaves(rng, per_turn=seed % 2 == 0)
    gamma = rng.choice([1.0, 0.9, 0.5, 0.0])
    for lf in leaves:
        assert token_returns(lf, gamma) == pytest.approx(_ref_returns(lf, gamma), abs=1e-12)
    for got, want in zip(advantages("grpo", leaves, forks, gamma), _ref_grpo(leaves, gamma)):
        assert got == pytest.approx(want, abs=1e-9)
    for got, want in zip(advantages("tree", leaves, forks, gamma), _ref_tree(leaves, forks, gamma)):
        assert got == pytest.approx(want, abs=1e-9)


@pytest.mark.parametrize("seed", range(5))
def test_per_leaf_rewards_with_gamma_one_are_grpo_exactly(seed):
    leaves, forks = _random_leaves(random.Random(seed), per_turn=False)
    for lf, a in zip(leaves, advantages("grpo", leaves, forks)):
        group = [x.reward for x in leaves if x.prompt == lf.prompt]
        want = (lf.reward - float(np.mean(group))) / (float(np.std(group)) + EPS)
        assert a == [want] * len(a)  # bit for bit: the same operations as before per-turn rewards


def test_per_turn_rewards_give_each_turn_its_reward_to_go():
    # one prompt, two leaves, two turns of two tokens: leaf 0 earns (1, 0), leaf 1 earns (0, 1)
    segs = [(0, 1, 3), (1, 4, 6)]
    a = Leaf(0, [0] * 6, (0,), segs, [0.0] * 4, 1.0, turn_rewards=[1.0, 0.0])
    b = Leaf(0, [0] * 6, (1,), segs, [0.0] * 4, 1.0, turn_rewards=[0.0, 1.0])
    # turn 0's returns are 1 and 1 (no signal); turn 1's are 0 and 1
    adv = advantages("grpo", [a, b], {0: 2})
    assert adv[0] == pytest.approx([0, 0, -1, -1], abs=1e-5) and adv[1] == pytest.approx(
        [0, 0, 1, 1], abs=1e-5
    )
    # discounted: turn 0's first token sees leaf 0's reward one token later, leaf 1's three later
    assert token_returns(a, 0.5) == [0.5, 1.0, 0.0, 0.0] and token_returns(b, 0.5) == [0.125, 0.25, 0.5, 1.0]


@pytest.mark.parametrize("gamma", [-0.1, 1.5, float("nan"), True, "1"])
def test_a_bad_gamma_is_refused_naming_it(gamma):
    with pytest.raises(InvalidInputError) as e:
        advantages("grpo", [Leaf(0, [0, 0], (0,), [(0, 1, 2)], [0.0], 1.0)], {0: 2}, gamma)
    assert e.value.field == "gamma"
