"""The built-in tasks (:data:`TASKS`): ``token-set``, ``calculator`` and ``ragged-set``; a user's own
task class by name (:func:`make_task` of ``"package.module:Class"``) and the name a run records for
a task (:func:`task_identity`).

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

``ragged-set``: episodes shaped like an agent's. Prompts of ``prompt_min`` to ``prompt_max`` random
tokens (ragged). Each of ``turns`` turns the policy writes up to ``cap`` tokens, ending early at any
of ``stop_count`` stop ids from ``stop_start``; the environment answers ``OBS`` followed by the
action's tokens that were in the set (``set_size`` ids from ``set_start``): a ragged observation.
Per-turn reward ``(0.5 x [the action ended at a stop token] + 0.5 x min(hits, need) / need) /
turns``, ``hits`` the action's tokens in the set: the best policy writes ``need`` set tokens and
stops (episode reward 1); a random one scores about 0.1.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from collections.abc import Callable, Sequence

from harts_runtime.errors import InvalidInputError
from harts_runtime.rl.environment import Task

__all__ = [
    "TASKS",
    "CalculatorTask",
    "PromptsFile",
    "RaggedSetTask",
    "TokenSetTask",
    "load_task_class",
    "make_task",
    "task_identity",
]

BOS = 1
MAX_ARG = 1 << 20
"""The largest integer a built-in task's argument takes (the tree's tokens are bounded by the
run's ``max_step_tokens``)."""


class PromptsFile:
    """A built-in task's prompts from a JSONL file (``task_args.prompts_file``): one JSON object a
    line, read and checked when the task is made (the task's ``prompt_record`` makes each one the
    prompt's token ids and state); each prompt is a line drawn with the environment RNG (uniformly,
    with replacement), so a resumed run draws what the uninterrupted one would. A bad line is one
    :class:`InvalidInputError` naming ``task_args.prompts_file``, the file and the line."""

    MAX_LINES = 1 << 20

    def __init__(self, path, parse: Callable[[dict], tuple[list[int], object]]):
        field = "task_args.prompts_file"
        if not isinstance(path, str) or not os.path.isfile(path):
            raise InvalidInputError(field, f"{path!r}: no such file")
        self.path, self.items = path, []
        with open(path, encoding="utf-8", errors="replace") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if len(self.items) >= self.MAX_LINES:
                    raise InvalidInputError(field, f"{path}: more than {self.MAX_LINES:,} prompts")
                try:
                    record = json.loads(line)
                    if not isinstance(record, dict):
                        raise ValueError(f"a JSON object, got {type(record).__name__}")
                    self.items.append(parse(record))
                except (ValueError, KeyError, TypeError) as e:
                    raise InvalidInputError(field, f"{path}:{i}: {' '.join(str(e).split())}") from None
        if not self.items:
            raise InvalidInputError(field, f"{path} holds no prompt")

    def draw(self, rng) -> tuple[list[int], object]:
        tokens, state = self.items[int(rng.integers(len(self.items)))]
        return list(tokens), state


def _ids(record: dict) -> tuple[list[int], object]:
    """``{"prompt": [token ids]}``: the prompt as given (no BOS added), no state."""
    ids = record["prompt"]
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"prompt: a non-empty list of token ids, got {ids!r}")
    for j, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"prompt[{j}]: token ids are integers >= 0, got {t!r}")
    return ids, None


class _BuiltIn(Task):
    """A built-in task: its prompts drawn, or read from a file (:class:`PromptsFile`) whose records
    :meth:`prompt_record` makes prompts."""

    prompts: PromptsFile | None = None

    @staticmethod
    def prompt_record(record: dict) -> tuple[list[int], object]:
        return _ids(record)


def _arg(name: str, v, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise InvalidInputError(f"task_args.{name}", f"must be an integer in [{lo:,}, {hi:,}], got {v!r}")
    return v


class TokenSetTask(_BuiltIn):
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
        if self.prompts is not None:
            return self.prompts.draw(rng)
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


class CalculatorTask(_BuiltIn):
    """``a + b`` with a calculator tool (module docstring)."""

    name = "calculator"
    turns = 2
    default_forks = {0: 4, 1: 2}
    CALL_LEN, OBS_LEN, ANSWER_LEN = 6, 5, 4
    prompt_tokens = 7

    @staticmethod
    def prompt_record(record: dict) -> tuple[list[int], object]:
        """``{"a": A, "b": B}`` (integers in [0, 99]): the prompt ``A + B =``."""
        a, b = record["a"], record["b"]
        for k, v in (("a", a), ("b", b)):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 99:
                raise ValueError(f"{k}: an integer in [0, 99], got {v!r}")
        return [BOS, *_digits(a, 2), PLUS, *_digits(b, 2), EQ], (a, b)

    def prompt(self, rng):
        if self.prompts is not None:
            return self.prompts.draw(rng)
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


OBS = 2
"""ragged-set's observation marker."""


class RaggedSetTask(_BuiltIn):
    """Ragged multi-turn episodes with stop tokens and per-turn rewards (module docstring)."""

    name = "ragged-set"
    default_forks = {0: 4, 1: 2}

    def __init__(
        self,
        prompt_min: int = 2,
        prompt_max: int = 6,
        turns: int = 2,
        cap: int = 8,
        need: int = 2,
        set_start: int = 32,
        set_size: int = 32,
        stop_start: int = 16,
        stop_count: int = 8,
    ):
        self.prompt_min = _arg("prompt_min", prompt_min, 1, MAX_ARG)
        self.prompt_max = _arg("prompt_max", prompt_max, self.prompt_min, MAX_ARG)
        self.turns = _arg("turns", turns, 1, 64)
        self.cap = _arg("cap", cap, 1, MAX_ARG)
        self.need = _arg("need", need, 1, self.cap)
        self.set_start = _arg("set_start", set_start, 0, MAX_ARG)
        self.set_size = _arg("set_size", set_size, 1, MAX_ARG)
        self.stop_start = _arg("stop_start", stop_start, 0, MAX_ARG)
        self.stop_count = _arg("stop_count", stop_count, 1, MAX_ARG)
        self.stop_tokens = tuple(range(self.stop_start, self.stop_start + self.stop_count))
        if self.turns == 1:
            self.default_forks = {0: 8}
        top = self.set_start + self.set_size
        if self.stop_start < top and self.set_start < self.stop_start + self.stop_count:
            raise InvalidInputError(
                "task_args.stop_start",
                f"ragged-set's stop ids [{self.stop_start:,}, {self.stop_start + self.stop_count:,}) overlap "
                f"its set [{self.set_start:,}, {top:,})",
            )
        if self.stop_start + self.stop_count > top and self.stop_start < 2 * top:
            raise InvalidInputError(
                "task_args.stop_start",
                f"ragged-set's stop ids [{self.stop_start:,}, {self.stop_start + self.stop_count:,}) overlap "
                f"its prompt ids [{top:,}, {2 * top:,})",
            )

    def check(self, vocab_size: int) -> None:
        top = max(2 * (self.set_start + self.set_size), self.stop_start + self.stop_count) - 1
        if top >= vocab_size:
            raise InvalidInputError(
                "task_args.set_start",
                f"ragged-set uses ids up to {top:,} (its prompts, set and stop ids), outside the "
                f"vocabulary of {vocab_size:,} ids",
            )

    def prompt(self, rng):
        if self.prompts is not None:
            return self.prompts.draw(rng)
        n = int(rng.integers(self.prompt_min, self.prompt_max + 1))
        top = self.set_start + self.set_size
        return [BOS] + [int(t) for t in rng.integers(top, 2 * top, n)], None

    def action_tokens(self, turn: int) -> int:
        return self.cap

    def _split(self, action: Sequence[int]) -> tuple[list[int], bool]:
        """``(the action's tokens before its stop token, whether it stopped)``."""
        stopped = len(action) > 0 and self.stop_start <= action[-1] < self.stop_start + self.stop_count
        return list(action[:-1] if stopped else action), stopped

    def hits(self, action: Sequence[int]) -> list[int]:
        """The action's tokens in the set (its stop token excluded)."""
        body, _ = self._split(action)
        return [t for t in body if self.set_start <= t < self.set_start + self.set_size]

    def observe(self, state, turn, tokens, action):
        return [OBS, *self.hits(action)]

    def reward(self, state, tokens, actions) -> list[float]:
        out = []
        for a in actions:
            _, stopped = self._split(a)
            out.append((0.5 * stopped + 0.5 * min(len(self.hits(a)), self.need) / self.need) / self.turns)
        return out


TASKS = {"token-set": TokenSetTask, "calculator": CalculatorTask, "ragged-set": RaggedSetTask}
"""Task name -> class (constructed with the config's ``task_args``)."""


def _fail(msg: str) -> InvalidInputError:
    return InvalidInputError("task", msg)


def load_task_class(spec: str) -> type[Task]:
    """The class ``"package.module:Class"`` names (a module in the current folder or on the
    Python path; ``Class`` may be dotted for a nested class), checked to be a concrete
    :class:`~harts_runtime.rl.environment.Task` subclass. Every failure is an
    :class:`InvalidInputError` naming ``task``: no such module, the module failed to import (its
    error in one line), no such class, not a Task subclass, abstract methods left."""
    mod, _, qual = spec.partition(":")
    if not mod or not qual or ":" in qual:
        raise _fail(f"a task class is named 'package.module:Class', got {spec!r}")

    def _import():
        return importlib.import_module(mod)

    try:
        try:
            module = _import()
        except ModuleNotFoundError as e:
            here = os.getcwd()
            if not (e.name and (mod == e.name or mod.startswith(e.name + "."))) or here in sys.path:
                raise
            sys.path.append(here)  # a console script's path lacks the current folder
            module = _import()
    except ModuleNotFoundError as e:
        if e.name and (mod == e.name or mod.startswith(e.name + ".")):
            raise _fail(f"no module {mod!r} (not in the current folder or on the Python path)") from None
        raise _fail(f"importing {mod!r} failed: {type(e).__name__}: {' '.join(str(e).split())}") from None
    except Exception as e:
        raise _fail(f"importing {mod!r} failed: {type(e).__name__}: {' '.join(str(e).split())}") from None
    obj = module
    for part in qual.split("."):
        if not hasattr(obj, part):
            raise _fail(f"module {mod!r} has no {qual!r}")
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Task)):
        raise _fail(
            f"{spec!r} is a {type(obj).__name__}, not a subclass of harts_runtime.rl.environment.Task"
        )
    if inspect.isabstract(obj):
        left = ", ".join(sorted(getattr(obj, "__abstractmethods__", ())))
        raise _fail(f"{spec!r} leaves Task's abstract methods unimplemented: {left}")
    return obj


def make_task(name: str, **kwargs) -> Task:
    """The task ``name`` made with ``kwargs`` (the config's ``task_args``; a built-in task also
    takes ``prompts_file``, a JSONL file of its prompts: :class:`PromptsFile`): a built-in name
    (:data:`TASKS`) or a class ``"package.module:Class"`` (:func:`load_task_class`); raises
    :class:`InvalidInputError` naming ``task`` (an unknown task, a class that does not load) or
    ``task_args.<key>`` (a key the task does not take, a required one missing, or a bad value)."""
    if not isinstance(name, str) or not name:
        raise _fail(f"a task name or 'package.module:Class', got {name!r}")
    if ":" in name:
        cls = load_task_class(name)
    elif name in TASKS:
        cls = TASKS[name]
        if "prompts_file" in kwargs:  # every built-in task takes its prompts from a file
            kwargs = dict(kwargs)
            path = kwargs.pop("prompts_file")
            task = make_task(name, **kwargs)
            assert isinstance(task, _BuiltIn)  # every class of TASKS is
            prompts = PromptsFile(path, task.prompt_record)
            task.prompts = prompts
            if task.prompt_tokens is not None:  # the size check counts the longest
                task.prompt_tokens = max(len(t) for t, _ in prompts.items)
            return task
    else:
        raise _fail(
            f"unknown task {name!r}; choose from {sorted(TASKS)} or name your own class as "
            f"'package.module:Class'"
        )
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return cls(**kwargs)
    values = list(sig.parameters.values())
    params = [p.name for p in values if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not any(p.kind == p.VAR_KEYWORD for p in values):
        for k in kwargs:
            if k not in params:
                takes = f"takes {', '.join(params)}" if params else "takes no arguments"
                raise InvalidInputError(f"task_args.{k}", f"task {name!r} {takes}")
    for p in values:
        if (
            p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.default is p.empty
            and p.name not in kwargs
        ):
            raise InvalidInputError(f"task_args.{p.name}", f"task {name!r} needs this argument")
    return cls(**kwargs)


def task_identity(task: Task | type[Task]) -> str:
    """The name a run records for ``task`` (an instance or a class): a built-in's name
    (``"token-set"``), else its class as ``"module:QualName"``, which :func:`make_task` loads
    again. A resumed run compares it with the recorded one."""
    cls = task if isinstance(task, type) else type(task)
    for name, c in TASKS.items():
        if cls is c:
            return name
    return f"{cls.__module__}:{cls.__qualname__}"
