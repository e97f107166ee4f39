"""The built-in tasks (:data:`TASKS`): ``token-set`` and ``calculator``.

``token-set``: the prompt is ``prompt_len`` random tokens; the policy writes ``2 x 8`` tokens in two
turns (no observation between them, so the tree forks inside the answer); reward = the share of the
generated tokens in a fixed set (``set_size`` ids from ``set_start``: 32 of 512, a random policy
scores ~0.06). A tiny flavor learns it on a CPU in about a minute.

``calculator``: a multi-turn tool task. The prompt asks ``a + b`` (``a``, ``b`` in ``[0, 100)``,
two digits each). Turn 0: the policy writes a 6-token tool call ``CALL d d OP d d``; the calculator
answers with 5 tokens ``RES d d d d`` (the zero-padded result, or ``ERR`` and four ``PAD`` for a
malformed call). Turn 1: the policy writes the 4-digit answer. Reward = 0.2 for a well-formed call +
0.8 x the share of answer digits that are right. A pretrained checkpoint is what improves on it;
on the tiny flavors its test checks that calls, observations, forks and rewards flow as specified.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

from harts_runtime.errors import InvalidInputError
from harts_runtime.rl.environment import Task

__all__ = ["TASKS", "CalculatorTask", "TokenSetTask", "make_task"]

BOS = 1
MAX_ARG = 1 << 20
"""The largest integer a built-in task's argument takes (the tree's tokens are bounded by the
run's ``max_step_tokens``)."""


def _arg(name: str, v, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise InvalidInputError(f"task_args.{name}", f"must be an integer in [{lo:,}, {hi:,}], got {v!r}")
    return v


class TokenSetTask(Task):
    """Reward: the share of generated tokens in ``[set_start, set_start + set_size)``."""

    name = "token-set"
    turns = 2
    default_forks = {0: 4, 1: 2}

    def __init__(
        self, prompt_len: int = 4, tokens_per_turn: int = 8, set_start: int = 32, set_size: int = 32
    ):
        self.prompt_len = _arg("prompt_len", prompt_len, 1, MAX_ARG)
        self.tokens_per_turn = _arg("tokens_per_turn", tokens_per_turn, 1, MAX_ARG)
        self.set_start = _arg("set_start", set_start, 0, MAX_ARG)
        self.set_size = _arg("set_size", set_size, 1, MAX_ARG)
        self.prompt_tokens = 1 + self.prompt_len

    def check(self, vocab_size: int) -> None:
        top = 2 * (self.set_start + self.set_size) - 1
        if top >= vocab_size:
            raise InvalidInputError(
                "task_args.set_start",
                f"token-set's prompts use ids up to 2 x (set_start + set_size) - 1 = {top:,}, outside the "
                f"vocabulary of {vocab_size:,} ids (set_start + set_size must be at most {vocab_size // 2:,}; "
                f"got {self.set_start:,} + {self.set_size:,})",
            )

    def prompt(self, rng):
        toks = rng.integers(
            self.set_start + self.set_size, 2 * (self.set_start + self.set_size), self.prompt_len
        )
        return [BOS] + [int(t) for t in toks], None

    def action_tokens(self, turn: int) -> int:
        return self.tokens_per_turn

    def reward(self, state, tokens, actions) -> float:
        gen = [t for a in actions for t in a]
        hit = sum(self.set_start <= t < self.set_start + self.set_size for t in gen)
        return hit / max(1, len(gen))


# calculator vocabulary: digits and symbols at fixed ids
DIGIT0, PLUS, TIMES, EQ, CALL, RES, ERR, PAD = 10, 20, 21, 22, 23, 24, 25, 26


def _digits(v: int, n: int) -> list[int]:
    return [DIGIT0 + int(c) for c in f"{v:0{n}d}"[-n:]]


def _number(tokens: Sequence[int]) -> int | None:
    if not all(DIGIT0 <= t < DIGIT0 + 10 for t in tokens):
        return None
    return int("".join(str(t - DIGIT0) for t in tokens))


class CalculatorTask(Task):
    """``a + b`` with a calculator tool (module docstring)."""

    name = "calculator"
    turns = 2
    default_forks = {0: 4, 1: 2}
    CALL_LEN, OBS_LEN, ANSWER_LEN = 6, 5, 4
    prompt_tokens = 7

    def prompt(self, rng):
        a, b = (int(x) for x in rng.integers(0, 100, 2))
        return [BOS, *_digits(a, 2), PLUS, *_digits(b, 2), EQ], (a, b)

    def action_tokens(self, turn: int) -> int:
        return self.CALL_LEN if turn == 0 else self.ANSWER_LEN

    @staticmethod
    def call_value(action: Sequence[int]) -> int | None:
        """The calculator's result of a tool call ``CALL d d OP d d``, or None when malformed."""
        if len(action) != 6 or action[0] != CALL or action[3] not in (PLUS, TIMES):
            return None
        x, y = _number(action[1:3]), _number(action[4:6])
        if x is None or y is None:
            return None
        return x + y if action[3] == PLUS else x * y

    def check(self, vocab_size: int) -> None:
        if vocab_size <= PAD:
            raise InvalidInputError(
                "task", f"calculator uses token ids up to {PAD}; the model's vocabulary has {vocab_size}"
            )

    def observe(self, state, turn, tokens, action):
        v = self.call_value(action)
        return [RES, *_digits(v, 4)] if v is not None else [ERR, PAD, PAD, PAD, PAD]

    def reward(self, state, tokens, actions) -> float:
        a, b = state
        well_formed = self.call_value(actions[0]) is not None
        right = sum(x == y for x, y in zip(actions[1], _digits(a + b, 4)))
        return 0.2 * well_formed + 0.8 * right / self.ANSWER_LEN


TASKS = {"token-set": TokenSetTask, "calculator": CalculatorTask}
"""Task name -> class (constructed with the config's ``task_args``)."""


def make_task(name: str, **kwargs) -> Task:
    """The built-in task ``name`` made with ``kwargs`` (the config's ``task_args``); raises
    :class:`InvalidInputError` naming ``task`` (an unknown task) or ``task_args.<key>`` (a key the
    task does not take, or a bad value)."""
    if not isinstance(name, str) or name not in TASKS:
        raise InvalidInputError("task", f"unknown task {name!r}; choose from {sorted(TASKS)}")
    cls = TASKS[name]
    params = [
        p.name
        for p in inspect.signature(cls).parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    for k in kwargs:
        if k not in params:
            takes = f"takes {', '.join(params)}" if params else "takes no arguments"
            raise InvalidInputError(f"task_args.{k}", f"task {name!r} {takes}")
    return cls(**kwargs)
