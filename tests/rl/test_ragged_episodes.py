"""Ragged episodes through the tree sampler: actions that end at a stop token or their cap, prompts
and observations of different lengths, observations for every branch in one ``observe_batch`` call
(threads or not), per-turn rewards. Random trees on a fake policy are checked leaf by leaf against
the definition (each action re-derived from the policy's stop rule, each observation recomputed,
each log-prob the policy's); a frontier that ignores the stop tokens is caught."""

from __future__ import annotations

import math
import random
import threading

import numpy as np
import pytest
import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.rl.environment import Task
from harts_runtime.rl.rollout_engine import Frontier, RolloutEngine
from harts_runtime.rl.sampler import TreeSampler

pytestmark = pytest.mark.usefixtures("one_thread")

V = 48


def policy_logits(prefix) -> torch.Tensor:
    """A fixed next-token distribution of the prefix (its last token and its length)."""
    last = prefix[-1] if prefix else 0
    return 3.0 * torch.sin(torch.arange(V, dtype=torch.float64) * (0.37 * (last + 1)) + len(prefix))


class _Frontier(Frontier):
    """Each branch on its own: the simplest ragged frontier."""

    def __init__(self, prompts, honour_stop=True):
        self.tokens = [list(p) for p in prompts]
        self.honour_stop = honour_stop

    def sample(self, n, generator, temperature=1.0, stop=()):
        out = torch.zeros(len(self.tokens), n, dtype=torch.float64)
        live = list(range(len(self.tokens)))
        for step in range(n):
            if not live:
                break
            logp = torch.log_softmax(
                torch.stack([policy_logits(self.tokens[b]) for b in live]) / temperature, -1
            )
            tok = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
            for i, b in enumerate(live):
                self.tokens[b].append(int(tok[i]))
                out[b, step] = logp[i, tok[i]]
            if self.honour_stop:
                live = [b for b in live if self.tokens[b][-1] not in set(stop)]
        return out.float()

    def extend(self, rows):
        for row, r in zip(self.tokens, rows):
            row.extend(int(t) for t in r)

    def fork(self, index):
        self.tokens = [list(self.tokens[i]) for i in index]


class _Rollout(RolloutEngine):
    vocab_size = V

    def __init__(self, honour_stop=True):
        self.honour_stop = honour_stop

    def load_weights(self, pairs):
        pass

    def logprobs(self, sequences):
        raise NotImplementedError

    def open(self, prompts):
        return _Frontier(prompts, self.honour_stop)


class _RandomTask(Task):
    """Random turns, caps, stop tokens, ragged prompts and observations, per-leaf or per-turn
    rewards; every observe_batch call recorded."""

    name = "random"

    def __init__(self, rng: random.Random):
        self.turns = rng.randint(1, 3)
        self.caps = [rng.randint(0, 5) for _ in range(self.turns)]
        self.caps[rng.randrange(self.turns)] = rng.randint(1, 6)
        self.stop_tokens = tuple(rng.sample(range(4, V), rng.choice([0, 3, 8, 16])))
        self.per_turn = rng.random() < 0.5
        self.observe_workers = rng.choice([1, 3])
        self.batch_calls: list[tuple[int, int]] = []
        self.threads: set[int] = set()

    def prompt(self, rng):
        n = int(rng.integers(1, 7))
        return [1] + [int(t) for t in rng.integers(2, V, n - 1)], n

    def action_tokens(self, turn):
        return self.caps[turn]

    def observe(self, state, turn, tokens, action):
        self.threads.add(threading.get_ident())
        return [(sum(action) + turn + state + i) % V for i in range((sum(action) + len(tokens)) % 5)]

    def observe_batch(self, states, turn, tokens, actions):
        self.batch_calls.append((turn, len(states)))
        return super().observe_batch(states, turn, tokens, actions)

    def reward(self, state, tokens, actions):
        per = [(sum(a) % 7) / 7.0 - 0.2 * t for t, a in enumerate(actions)]
        return per if self.per_turn else sum(per) + 0.01 * len(tokens)


def _check_leaf(task: _RandomTask, lf, prompt, state, temperature):
    """Walk the leaf's tokens by the episode's definition."""
    stops = set(task.stop_tokens)
    assert lf.tokens[: len(prompt)] == prompt
    pos, k = len(prompt), 0
    assert [t for t, _, _ in lf.segments] == list(range(task.turns))
    for t in range(task.turns):
        _, a, b = lf.segments[t]
        assert a == pos
        action = lf.tokens[a:b]
        cap = task.caps[t]
        assert len(action) <= cap
        first_stop = next((i for i, x in enumerate(action) if x in stops), None)
        if first_stop is None:
            assert len(action) == cap and lf.truncated[t] == (bool(stops) and cap > 0)
        else:
            assert first_stop == len(action) - 1 and not lf.truncated[t]
        for i in range(a, b):  # each log-prob is the policy's for that token after that prefix
            want = torch.log_softmax(policy_logits(lf.tokens[:i]) / temperature, -1)[lf.tokens[i]]
            assert lf.action_logprobs[k] == pytest.approx(float(want), abs=1e-5)
            k += 1
        pos = b
        if t + 1 < task.turns:
            obs = task.observe(state, t, lf.tokens[:b], action)
            assert lf.tokens[b : b + len(obs)] == obs
            pos = b + len(obs)
    assert pos == len(lf.tokens) and k == len(lf.action_logprobs)
    want = task.reward(state, lf.tokens, lf.actions())
    if task.per_turn:
        assert lf.turn_rewards == pytest.approx(want) and lf.reward == pytest.approx(sum(want))
    else:
        assert lf.turn_rewards is None and lf.reward == pytest.approx(want)


@pytest.mark.parametrize("seed", range(12))
def test_random_ragged_trees_follow_the_episode_definition(seed):
    rng = random.Random(seed)
    task = _RandomTask(rng)
    forks = {t: rng.randint(1, 3) for t in range(task.turns) if rng.random() < 0.7}
    if math.prod(forks.values()) < 2:
        forks[0] = 2
    prompts = rng.randint(1, 4)
    temperature = rng.choice([0.7, 1.0])
    sampler = TreeSampler(task, forks, prompts, temperature, seed)
    env = np.random.default_rng(seed + 1)  # the sampler's environment RNG, replayed
    drawn = [task.prompt(env) for _ in range(prompts)]
    leaves = sampler.sample(_Rollout())
    per_prompt = math.prod(forks.get(t, 1) for t in range(task.turns))
    assert len(leaves) == prompts * per_prompt
    for p in range(prompts):
        mine = [lf for lf in leaves if lf.prompt == p]
        paths = [lf.path for lf in mine]
        assert len(set(paths)) == per_prompt
        for lf in mine:
            _check_leaf(task, lf, drawn[p][0], drawn[p][1], temperature)
        for x in mine:  # siblings share every token before the fork that separates them
            for y in mine:
                d = next((i for i, (u, v) in enumerate(zip(x.path, y.path)) if u != v), None)
                if d is None:
                    continue
                fork_turn = sorted(t for t, k in forks.items() if k > 1)[d]
                cut = x.segments[fork_turn][1]
                assert x.tokens[:cut] == y.tokens[:cut]
    # observations: one observe_batch call per turn but the last, every live branch at once
    branches, want = prompts, []
    for t in range(task.turns - 1):
        branches *= forks.get(t, 1)
        want.append((t, branches))
    assert task.batch_calls == want
    if task.observe_workers == 1:
        assert task.threads <= {threading.get_ident()}


def test_observe_workers_give_the_same_observations_on_threads():
    class Slow(_RandomTask):
        def observe(self, state, turn, tokens, action):
            self.threads.add(threading.get_ident())
            return [len(tokens) % V, turn]

    task = Slow(random.Random(3))
    task.turns, task.caps, task.stop_tokens, task.per_turn = 2, [3, 2], (), False
    task.observe_workers = 4
    states = list(range(9))
    toks = [[1] * (i + 1) for i in range(9)]
    rows = task.observe_batch(states, 0, toks, [[2]] * 9)
    assert rows == [[(i + 1) % V, 0] for i in range(9)]
    assert threading.get_ident() not in task.threads
    task.observe_workers = 0
    with pytest.raises(InvalidInputError) as e:
        task.observe_batch(states, 0, toks, [[2]] * 9)
    assert e.value.field == "observe_workers"


def test_a_frontier_that_runs_past_a_stop_token_is_caught():
    rng = random.Random(0)
    task = _RandomTask(rng)
    task.turns, task.caps, task.stop_tokens = 1, [40], tuple(range(4, V))  # stops almost surely
    with pytest.raises(RuntimeError, match="stop token"):
        TreeSampler(task, {0: 2}, 2, 1.0, 0).sample(_Rollout(honour_stop=False))


@pytest.mark.parametrize(
    "stops, field",
    [((3, V), "stop_tokens[1]"), ("ab", "stop_tokens"), ((1.5,), "stop_tokens[0]"), (5, "stop_tokens")],
)
def test_bad_stop_tokens_are_refused_naming_them(stops, field):
    task = _RandomTask(random.Random(0))
    task.stop_tokens = stops
    with pytest.raises(InvalidInputError) as e:
        TreeSampler(task, {0: 2}, 1, 1.0, 0).sample(_Rollout())
    assert e.value.field == field


@pytest.mark.parametrize(
    "reward, field",
    [([0.5], "reward[0]"), ([0.5, float("nan")], "reward[0][1]"), ("x", "reward[0]")],
)
def test_bad_per_turn_rewards_are_refused_naming_them(reward, field):
    task = _RandomTask(random.Random(0))
    task.turns, task.caps, task.stop_tokens = 2, [2, 2], ()
    task.reward = lambda state, tokens, actions: reward
    with pytest.raises(InvalidInputError) as e:
        TreeSampler(task, {0: 2}, 1, 1.0, 0).sample(_Rollout())
    assert e.value.field == field


def test_observe_batch_must_answer_every_branch():
    task = _RandomTask(random.Random(0))
    task.turns, task.caps, task.stop_tokens = 2, [2, 2], ()
    task.observe_batch = lambda states, turn, tokens, actions: [[1]]
    with pytest.raises(InvalidInputError) as e:
        TreeSampler(task, {0: 2}, 1, 1.0, 0).sample(_Rollout())
    assert e.value.field == "observation" and "one observation per branch (2), got 1 rows" in str(e.value)
