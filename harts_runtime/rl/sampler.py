"""The tree sampler (:class:`TreeSampler`): a step's episodes as prefix-sharing trees.

For each of ``prompts`` prompts (drawn with the environment's RNG; of any lengths), one branch
opens on the rollout engine; before turn ``t``, every live branch forks ``forks[t]`` ways (when
``t`` is named); the policy samples the turn's action on every branch (with the sampler's
``torch.Generator``): up to the turn's cap, each branch stopping after one of the task's
:attr:`~harts_runtime.rl.environment.Task.stop_tokens`; the task's observations of every live
branch follow in one :meth:`~harts_runtime.rl.environment.Task.observe_batch` call (every turn but
the last; their lengths may differ). Each leaf is a :class:`Leaf`: its tokens, per-token loss mask
(action tokens only) and sampling log-probs, its prompt, its *path* (the child taken at each fork,
root first), per turn where its action tokens lie and whether the cap cut the action, its reward,
(when the task gives them) its per-turn rewards and (when the rollout engine reports them:
:meth:`~harts_runtime.rl.rollout_engine.Frontier.routes`) the MoE experts of each token. The leaves of a prompt share every token up to the
fork that separates them, which HARTS's ingestion finds again from the token ids alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.rl.config import DEFAULT_MAX_STEP_TOKENS
from harts_runtime.rl.environment import Task, check_observation, check_reward

__all__ = ["Leaf", "TreeSampler"]


@dataclass
class Leaf:
    """One trajectory of a step (a leaf of its prompt's tree)."""

    prompt: int
    tokens: list[int]
    path: tuple[int, ...]
    """The child index taken at each fork, root first (its length: the forks above the leaf)."""
    segments: list[tuple[int, int, int]]
    """``(turn, start, end)``: the positions of each turn's action tokens in :attr:`tokens`."""
    action_logprobs: list[float] = field(default_factory=list)
    """The sampling log-prob of each action token, in order."""
    reward: float = 0.0
    """The leaf's reward (with per-turn rewards: their sum)."""
    turn_rewards: list[float] | None = None
    """One reward per turn when the task gives them (None: the task scored the leaf as a whole)."""
    truncated: list[bool] = field(default_factory=list)
    """Per turn: the action reached its cap without a stop token (always False for a task
    without stop tokens, whose actions are all exactly the cap, and for a turn whose cap is 0)."""
    routes: torch.Tensor | None = None
    """The MoE experts the rollout engine ran each token through, int ``[len(tokens), M, k]``
    (None: the engine reports none)."""

    def actions(self) -> list[list[int]]:
        return [self.tokens[a:b] for _, a, b in self.segments]

    def per_token(self, values_per_action: list[float] | None = None, fill: float = 0.0) -> list[float]:
        """A token-aligned list: ``values_per_action`` (default: the sampling log-probs) at the action
        tokens, ``fill`` elsewhere."""
        values = self.action_logprobs if values_per_action is None else values_per_action
        out = [fill] * len(self.tokens)
        k = 0
        for _, a, b in self.segments:
            for p in range(a, b):
                out[p] = values[k]
                k += 1
        return out

    def observation_spans(self) -> list[tuple[int, int, int]]:
        """``(turn, start, end)``: the observation tokens after each turn's action (the turns but
        the last; ``start == end`` for an empty one)."""
        segs = self.segments
        return [(t, b, segs[i + 1][1]) for i, (t, _, b) in enumerate(segs[:-1])]

    def loss_mask(self) -> list[bool]:
        out = [False] * len(self.tokens)
        for _, a, b in self.segments:
            out[a:b] = [True] * (b - a)
        return out


class TreeSampler:
    """Samples a step's leaves. ``forks``: turn -> ``k`` (fork every live branch ``k`` ways before
    that turn); ``prompts``: prompts per step; ``temperature``: sampling temperature. Its RNG
    (``generator``, a ``torch.Generator``) and the environment's (``env_rng``, a numpy Generator)
    are what a checkpoint saves (:meth:`state_dict`)."""

    def __init__(
        self,
        task: Task,
        forks: dict[int, int],
        prompts: int,
        temperature: float,
        seed: int,
        *,
        max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS,
    ):
        self.task, self.forks, self.prompts, self.temperature = task, dict(forks), prompts, temperature
        self.max_step_tokens = max_step_tokens
        self.generator = torch.Generator().manual_seed(seed)
        self.env_rng = np.random.default_rng(seed + 1)
        self._checked_vocab: int | None = None
        self._stops: tuple[int, ...] = ()

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "env_rng": self.env_rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.env_rng.bit_generator.state = state["env_rng"]

    def stop_tokens(self, vocab_size: int) -> tuple[int, ...]:
        """The task's stop tokens, checked: integers in ``[0, vocab_size)`` (field ``stop_tokens``)."""
        raw = self.task.stop_tokens
        if raw is None:
            return ()
        if isinstance(raw, (str, bytes)) or not hasattr(raw, "__iter__"):
            raise InvalidInputError("stop_tokens", f"a list of token ids, got {type(raw).__name__}")
        out = tuple(raw)
        for j, t in enumerate(out):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= int(t) < vocab_size:
                raise InvalidInputError(
                    f"stop_tokens[{j}]", f"token ids are integers in [0, {vocab_size}), got {t!r}"
                )
        return tuple(dict.fromkeys(int(t) for t in out))

    def sample(self, rollout) -> list[Leaf]:
        """The step's leaves, rewards filled in (checked: the task's settings and stop tokens against
        the rollout engine's vocabulary (:meth:`Task.check`), prompts non-empty and in the
        vocabulary, before the rollout engine sees them; each branch's action at most the turn's
        cap, ended early only by a stop token; observations in the vocabulary and the step,
        observations included, at most ``max_step_tokens`` tokens; rewards finite, a per-turn
        reward list one number per turn)."""
        task = self.task
        if self._checked_vocab != rollout.vocab_size:
            task.check(rollout.vocab_size)
            self._stops = self.stop_tokens(rollout.vocab_size)
            self._checked_vocab = rollout.vocab_size
        stops = self._stops
        stop_set = set(stops)
        drawn = [task.prompt(self.env_rng) for _ in range(self.prompts)]
        for i, (p, _) in enumerate(drawn):
            if not isinstance(p, (list, tuple, np.ndarray)) or len(p) == 0:
                got = "an empty one" if isinstance(p, (list, tuple, np.ndarray)) else type(p).__name__
                raise InvalidInputError(
                    f"prompt[{i}]", f"a prompt is a non-empty list of token ids, got {got}"
                )
        prompts = [list(p) for p, _ in drawn]
        grow = [int(self.forks.get(t, 1)) for t in range(task.turns)]
        actions = [int(task.action_tokens(t)) for t in range(task.turns)]
        per_prompt = math.prod(grow)
        size = per_prompt * sum(len(p) + sum(actions) for p in prompts)
        if size > self.max_step_tokens:
            raise InvalidInputError(
                "prompt",
                f"the step's prompts ({sum(map(len, prompts)):,} tokens) would make it {size:,} tokens, "
                f"over the limit max_step_tokens = {self.max_step_tokens:,}",
            )
        check_observation(prompts, rollout.vocab_size, "prompt")
        frontier = rollout.open([[int(t) for t in p] for p in prompts])
        owner = list(range(self.prompts))
        paths: list[tuple[int, ...]] = [() for _ in range(self.prompts)]
        segments: list[list[tuple[int, int, int]]] = [[] for _ in range(self.prompts)]
        logps: list[list[float]] = [[] for _ in range(self.prompts)]
        cut: list[list[bool]] = [[] for _ in range(self.prompts)]
        for turn in range(task.turns):
            k = int(self.forks.get(turn, 1))
            if k > 1:
                index = [i for i in range(len(owner)) for _ in range(k)]
                frontier.fork(index)
                owner = [owner[i] for i in index]
                paths = [paths[i] + (j % k,) for j, i in enumerate(index)]
                segments = [list(segments[i]) for i in index]
                logps = [list(logps[i]) for i in index]
                cut = [list(cut[i]) for i in index]
            n = actions[turn]
            starts = [len(row) for row in frontier.tokens]
            if stops:
                lp = frontier.sample(n, self.generator, self.temperature, stop=stops)
            else:
                lp = frontier.sample(n, self.generator, self.temperature)
            if (
                tuple(lp.shape[:1]) != (len(owner),)
                or lp.dim() != 2
                or lp.shape[1] < max((len(r) - s for r, s in zip(frontier.tokens, starts)), default=0)
            ):
                raise RuntimeError(
                    f"the rollout engine's frontier returned log-probs of shape {tuple(lp.shape)} for "
                    f"{len(owner)} branches of up to {n} tokens at turn {turn}"
                )
            for b in range(len(owner)):
                row, start = frontier.tokens[b], starts[b]
                m = len(row) - start
                stopped = 0 < m and row[-1] in stop_set
                if not (m == n or (stops and 0 < m < n and stopped)) or (
                    stops and stop_set & set(row[start:-1])
                ):
                    raise RuntimeError(
                        f"the rollout engine's frontier sampled {m} tokens on branch {b} at turn {turn}: an "
                        f"action is {n} tokens, or fewer ending at the first stop token {list(stops)}"
                    )
                segments[b].append((turn, start, start + m))
                logps[b].extend(lp[b, :m].tolist())
                cut[b].append(bool(stops) and n > 0 and not stopped)
            if turn + 1 < task.turns:
                rows = task.observe_batch(
                    [drawn[owner[b]][1] for b in range(len(owner))],
                    turn,
                    [frontier.tokens[b] for b in range(len(owner))],
                    [frontier.tokens[b][starts[b] :] for b in range(len(owner))],
                )
                if not isinstance(rows, (list, tuple, np.ndarray)) or len(rows) != len(owner):
                    got = (
                        f"{len(rows)} rows"
                        if isinstance(rows, (list, tuple, np.ndarray))
                        else type(rows).__name__
                    )
                    raise InvalidInputError(
                        "observation",
                        f"observe_batch returns one observation per branch ({len(owner)}), got {got}",
                    )
                for b, r in enumerate(rows):
                    if not isinstance(r, (list, tuple, np.ndarray)):
                        raise InvalidInputError(
                            f"observation[{b}]",
                            f"an observation is a list of token ids, got {type(r).__name__}",
                        )
                later = math.prod(grow[turn + 1 :])
                size = later * sum(
                    len(frontier.tokens[b]) + len(rows[b]) + sum(actions[turn + 1 :])
                    for b in range(len(owner))
                )
                if size > self.max_step_tokens:
                    raise InvalidInputError(
                        "observation",
                        f"turn {turn}'s observations ({sum(len(r) for r in rows):,} tokens) would make the "
                        f"step {size:,} tokens, over the limit max_step_tokens = {self.max_step_tokens:,}",
                    )
                check_observation(rows, rollout.vocab_size)
                frontier.extend([[int(t) for t in r] for r in rows])
        leaves = [
            Leaf(owner[b], list(frontier.tokens[b]), paths[b], segments[b], logps[b], truncated=cut[b])
            for b in range(len(owner))
        ]
        routes = frontier.routes() if hasattr(frontier, "routes") else None
        if routes is not None:
            if len(routes) != len(leaves) or any(
                r.dim() != 3 or r.shape[0] != len(lf.tokens) for r, lf in zip(routes, leaves)
            ):
                raise RuntimeError(
                    "the rollout engine's frontier returned routes that are not one [tokens, M, k] "
                    "tensor per branch"
                )
            for lf, r in zip(leaves, routes):
                lf.routes = r
        rewards = [task.reward(drawn[lf.prompt][1], lf.tokens, lf.actions()) for lf in leaves]
        check_reward(rewards, turns=task.turns)
        for lf, r in zip(leaves, rewards):
            if isinstance(r, (list, tuple, np.ndarray)):
                lf.turn_rewards = [float(v) for v in r]
                lf.reward = float(sum(lf.turn_rewards))
            else:
                lf.reward = float(cast(float, r))  # a number: check_reward refused anything else
        return leaves
