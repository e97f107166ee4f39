"""The environment interface of multi-turn, tree-shaped episodes (:class:`Task`).

An episode starts from a prompt the task draws (:meth:`Task.prompt`, with the environment's RNG;
prompts may differ in length). Turn ``t`` (``0 .. turns - 1``): the policy samples up to
:meth:`Task.action_tokens` tokens: the action ends after a token of :attr:`Task.stop_tokens` (kept
in the action, trained like the others) or at that cap; without stop tokens every action is exactly
the cap. Unless it was the last turn, the task's tool or environment answers with observation tokens
(:meth:`Task.observe_batch`, once per turn for every live branch; its default calls
:meth:`Task.observe` per branch, on :attr:`Task.observe_workers` threads when more than one);
observations may differ in length from branch to branch. At the end, :meth:`Task.reward` scores
each leaf: one number (the leaf's reward) or one per turn (rewards earned by each turn's action,
discounted to tokens by the advantage estimators: :mod:`harts_runtime.rl.advantages`). The sampler
(:mod:`harts_runtime.rl.sampler`) forks every live branch ``k`` ways before the turns its config
names, so one prompt's leaves form a tree that shares prefixes. A task that works on strings
subclasses :class:`harts_runtime.rl.text.TextTask`.

Every value a task returns is checked (:func:`check_observation`, :func:`check_reward`): a prompt or
observation token id outside ``[0, vocab)``, an empty prompt, a non-finite reward or a per-turn
reward list of the wrong length raises :class:`~harts_runtime.errors.InvalidInputError` naming the
field (``prompt[0][2]``, ``observation[3][1]``, ``reward[5]``, ``reward[5][1]``) before the step
trains. A task's own settings are checked
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

MAX_OBSERVE_WORKERS = 1024


class Task(ABC):
    """A task: prompts, turns, observations and rewards. Subclasses set :attr:`name`,
    :attr:`turns` and :attr:`default_forks` (turn -> ``k``), and :attr:`prompt_tokens` when known."""

    name: str = ""
    turns: int = 1
    default_forks: dict[int, int] = {0: 8}
    prompt_tokens: int | None = None
    """The length of every prompt when the task knows it ahead (the run's size check counts it
    before any work); None: unknown or ragged (the sampler checks the prompts it draws)."""
    stop_tokens: Sequence[int] = ()
    """Token ids that end an action (the policy's last token of the turn); empty: every action is
    exactly :meth:`action_tokens` long."""
    observe_workers: int = 1
    """Threads the default :meth:`observe_batch` calls :meth:`observe` on (1: in order on the
    caller's thread); for an environment that waits on I/O (a sandbox, a web tool)."""

    @abstractmethod
    def prompt(self, rng: np.random.Generator) -> tuple[list[int], object]:
        """``(prompt token ids, episode state)``: one prompt (of any non-zero length) and what the
        task needs to answer and score it."""

    @abstractmethod
    def action_tokens(self, turn: int) -> int:
        """How many tokens the policy samples at ``turn``: exactly, or at most when the task has
        :attr:`stop_tokens` (the run's size check counts this cap)."""

    def observe(self, state, turn: int, tokens: Sequence[int], action: Sequence[int]) -> list[int]:
        """The observation after the policy's ``action`` at ``turn`` (not called after the last
        turn); ``tokens``: the branch's sequence so far, action included. Default: none."""
        return []

    def observe_batch(
        self,
        states: Sequence[object],
        turn: int,
        tokens: Sequence[Sequence[int]],
        actions: Sequence[Sequence[int]],
    ) -> list[list[int]]:
        """The observations of many branches at ``turn`` (one per branch, in order; the sampler
        calls it once per turn with every live branch). Override it to batch the environment's
        work (one call to a tool server, a vectorised simulator). Default: :meth:`observe` per
        branch, on :attr:`observe_workers` threads when more than one (so :meth:`observe` must
        then be thread-safe)."""
        workers = self.observe_workers
        if (
            isinstance(workers, bool)
            or not isinstance(workers, int)
            or not 1 <= workers <= MAX_OBSERVE_WORKERS
        ):
            raise InvalidInputError(
                "observe_workers", f"an integer in [1, {MAX_OBSERVE_WORKERS}], got {workers!r}"
            )
        args = list(zip(states, tokens, actions))
        if workers == 1 or len(args) <= 1:
            return [self.observe(s, turn, t, a) for s, t, a in args]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(workers, len(args))) as pool:
            return list(pool.map(lambda x: self.observe(x[0], turn, x[1], x[2]), args))

    @abstractmethod
    def reward(
        self, state, tokens: Sequence[int], actions: Sequence[Sequence[int]]
    ) -> float | Sequence[float]:
        """The leaf's reward, or one reward per turn (a sequence of :attr:`turns` numbers: what each
        turn's action earned; the leaf's reward is their sum); ``actions``: its action tokens turn
        by turn (a stop token ends its action)."""

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


def _finite(r) -> bool:
    ok = isinstance(r, (int, float, np.floating, np.integer)) and not isinstance(r, bool)
    return ok and math.isfinite(float(r))


def check_reward(values: Sequence, field: str = "reward", turns: int | None = None) -> None:
    """Refuse rewards that are not finite numbers; with ``turns``, a reward may also be a sequence
    of ``turns`` finite numbers (one per turn)."""
    for i, r in enumerate(values):
        if turns is not None and isinstance(r, (list, tuple, np.ndarray)):
            if len(r) != turns:
                raise InvalidInputError(
                    f"{field}[{i}]", f"per-turn rewards are {turns} numbers (one per turn), got {len(r)}"
                )
            for t, v in enumerate(r):
                if not _finite(v):
                    raise InvalidInputError(f"{field}[{i}][{t}]", f"a reward is a finite number, got {v!r}")
        elif not _finite(r):
            what = "a finite number or one per turn" if turns is not None else "a finite number"
            raise InvalidInputError(f"{field}[{i}]", f"a reward is {what}, got {r!r}")
