"""The environment interface of multi-turn, tree-shaped episodes (:class:`Task`).

An episode starts from a prompt the task draws (:meth:`Task.prompt`, with the environment's RNG).
Turn ``t`` (``0 .. turns - 1``): the policy samples :meth:`Task.action_tokens` tokens; unless it was
the last turn, the task's tool or environment answers with observation tokens
(:meth:`Task.observe`, seeing that branch's whole sequence so far and its action). At the end,
:meth:`Task.reward` scores each leaf. The sampler (:mod:`harts_runtime.rl.sampler`) forks every live
branch ``k`` ways before the turns its config names, so one prompt's leaves form a tree that shares
prefixes.

Every value a task returns is checked (:func:`check_observation`, :func:`check_reward`): a prompt or
observation token id outside ``[0, vocab)``, an empty prompt, or a non-finite reward raises
:class:`~harts_runtime.errors.InvalidInputError` naming the field (``prompt[0][2]``,
``observation[3][1]``, ``reward[5]``) before the step trains. A task's own settings are checked
against the model's vocabulary by :meth:`Task.check`; its turns, action tokens and the size of its
trees by :meth:`harts_runtime.rl.config.RLConfig.check_task`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np

from harts_runtime.errors import InvalidInputError

__all__ = ["Task", "check_observation", "check_reward"]


class Task(ABC):
    """A task: prompts, turns, observations and rewards. Subclasses set :attr:`name`,
    :attr:`turns` and :attr:`default_forks` (turn -> ``k``), and :attr:`prompt_tokens` when known."""

    name: str = ""
    turns: int = 1
    default_forks: dict[int, int] = {0: 8}
    prompt_tokens: int | None = None
    """The length of every prompt when the task knows it ahead (the run's size check counts it
    before any work); None: unknown (the sampler checks the prompts it draws)."""

    @abstractmethod
    def prompt(self, rng: np.random.Generator) -> tuple[list[int], object]:
        """``(prompt token ids, episode state)``: one prompt (all of one length per task) and what the
        task needs to answer and score it."""

    @abstractmethod
    def action_tokens(self, turn: int) -> int:
        """How many tokens the policy samples at ``turn``."""

    def observe(self, state, turn: int, tokens: Sequence[int], action: Sequence[int]) -> list[int]:
        """The observation after the policy's ``action`` at ``turn`` (not called after the last
        turn); ``tokens``: the branch's sequence so far, action included. Default: none."""
        return []

    @abstractmethod
    def reward(self, state, tokens: Sequence[int], actions: Sequence[Sequence[int]]) -> float:
        """The leaf's reward; ``actions``: its action tokens turn by turn."""

    def check(self, vocab_size: int) -> None:
        """Refuse settings that cannot work with a model of ``vocab_size`` token ids (raise
        :class:`~harts_runtime.errors.InvalidInputError` naming the setting, e.g.
        ``task_args.set_start``); called before the first step. Default: nothing to check (the
        prompts and observations are checked token by token anyway)."""
        return None


def check_observation(rows: Sequence[Sequence[int]], vocab_size: int, field: str = "observation") -> None:
    """Refuse observation tokens that are not integers in ``[0, vocab_size)``."""
    for i, row in enumerate(rows):
        for j, t in enumerate(row):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= int(t) < vocab_size:
                raise InvalidInputError(
                    f"{field}[{i}][{j}]", f"token ids are integers in [0, {vocab_size}), got {t!r}"
                )


def check_reward(values: Sequence[float], field: str = "reward") -> None:
    """Refuse rewards that are not finite numbers."""
    for i, r in enumerate(values):
        ok = isinstance(r, (int, float, np.floating, np.integer)) and not isinstance(r, bool)
        if not ok or not math.isfinite(float(r)):
            raise InvalidInputError(f"{field}[{i}]", f"a reward is a finite number, got {r!r}")
