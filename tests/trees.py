"""The suites' one random-tree generator, for hypothesis and for seeded tests.

Both front ends draw through :func:`harts_planner.synth.random_trajectories`:

* ``forests(...)``: a hypothesis strategy; every random choice of the generator is a hypothesis draw,
  so failing examples shrink (fewer trajectories, shorter tails, smaller tokens);
* ``seeded(seed, ...)``: the same generator on ``numpy.random.default_rng(seed)``.

Importable from every test folder (``tests/`` holds the root conftest, which pytest puts on
``sys.path``).
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from harts_planner.synth import random_trajectories


class DrawRng:
    """The three ``numpy.random.Generator`` methods ``random_trajectories`` uses, as hypothesis draws."""

    def __init__(self, draw):
        self.draw = draw

    def integers(self, lo: int, hi: int | None = None, size: int | None = None):
        lo, hi = (0, lo) if hi is None else (lo, hi)
        one = st.integers(lo, hi - 1)
        if size is None:
            return self.draw(one)
        return np.asarray(self.draw(st.lists(one, min_size=size, max_size=size)), dtype=np.int64)

    def random(self) -> float:
        return self.draw(st.floats(0.0, 1.0, exclude_max=True))

    def shuffle(self, items: list) -> None:
        items[:] = self.draw(st.permutations(items))


@st.composite
def forests(draw, max_num: int = 9, **kwargs) -> list[list[int]]:
    """Hypothesis strategy: ``random_trajectories`` with 1 .. ``max_num`` trajectories (keyword
    arguments as there: ``vocab``, ``max_new``, ``new_tree_prob``, ...)."""
    num = draw(st.integers(1, max_num))
    return random_trajectories(DrawRng(draw), num, **kwargs)


def seeded(seed: int, num: int = 8, **kwargs) -> list[list[int]]:
    """``random_trajectories`` on ``numpy.random.default_rng(seed)``."""
    return random_trajectories(np.random.default_rng(seed), num, **kwargs)


def fork_shapes(chunk_size: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Several rollout trees for one microbatch, covering the fork positions that stress the call
    plan: forks at B - 1, B and B + 1 (B = ``chunk_size``), nested forks (the second at 2B + 3),
    two identical trajectories, and a trajectory that is a prefix of another. Each tree starts
    with its own token, so the trees share nothing."""
    rng = np.random.default_rng(seed)
    b = chunk_size

    def toks(n: int) -> list[int]:
        return rng.integers(0, vocab, size=n).tolist()

    trajs: list[list[int]] = []
    for tree, trunk_len in enumerate((b - 1, b, b + 1)):
        trunk = [tree] + toks(trunk_len - 1)
        trajs += [trunk + toks(6), trunk + toks(b - 5), trunk + toks(2)]
    nested = [3] + toks(4)  # forks at 5 and at 2B + 3
    deep = nested + toks(2 * b + 3 - len(nested))
    trajs += [deep + toks(7), deep + toks(12), nested + toks(8)]
    twin = [4] + toks(b // 2 + 3)
    trajs += [twin, list(twin)]  # identical
    longer = [5] + toks(b + 6)
    trajs += [longer, longer[: b - 2]]  # one a prefix of the other
    return trajs
