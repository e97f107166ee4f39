"""Tasks on strings (:class:`TextTask`) and the model's tokenizer (:func:`load_tokenizer`,
:func:`bind_tokenizer`).

A :class:`TextTask` writes its prompts, observations and rewards on text; the sampler still works on
token ids, encoded and decoded with the model's tokenizer (a ``transformers`` tokenizer, or any
object with the same ``encode`` / ``decode`` / ``eos_token_id`` / ``apply_chat_template`` methods):

- :meth:`TextTask.prompt_text` returns a string (encoded with the tokenizer's special tokens, e.g.
  its BOS), a chat as a list of ``{"role", "content"}`` messages (rendered with the tokenizer's chat
  template, generation prompt added, then encoded without adding special tokens again), or token
  ids (taken as they are);
- :meth:`TextTask.observe_text` sees the action decoded and returns a string (encoded without
  special tokens) or token ids;
- :meth:`TextTask.reward_text` sees every turn's action decoded (its stop token left out) and
  returns a number or one per turn.

An action ends at the tokenizer's EOS, at a token of :attr:`TextTask.stop_texts` (strings that are
one token each, e.g. ``"</tool_call>"``) or at the turn's cap. The tokenizer comes from the
checkpoint folder (:func:`bind_tokenizer`, which ``harts-rl --model DIR`` calls), or from
``task_args.tokenizer`` (a folder); a text task without one is refused naming ``task`` before the
first step, as is a tokenizer with more ids than the model's vocabulary.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from harts_runtime.errors import InvalidInputError
from harts_runtime.rl.environment import Task

__all__ = ["TOKENIZER_FILES", "TextTask", "bind_tokenizer", "load_tokenizer"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A folder with any of these has a tokenizer."""


def load_tokenizer(folder):
    """The ``transformers.AutoTokenizer`` of a checkpoint ``folder`` (local files only), or None
    when the folder has no tokenizer files or ``transformers`` is not installed; tokenizer files
    that fail to load raise :class:`InvalidInputError` naming ``tokenizer``."""
    path = Path(folder)
    if not path.is_dir() or not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        msg = " ".join(str(e).split())[:300]
        raise InvalidInputError(
            "tokenizer", f"{path}: its tokenizer does not load ({type(e).__name__}: {msg})"
        ) from None


def bind_tokenizer(task: Task, folder) -> object | None:
    """Give a :class:`TextTask` without a tokenizer the one of the checkpoint ``folder`` (when it
    has one); returns the task's tokenizer (None for a task on token ids)."""
    if not isinstance(task, TextTask):
        return None
    if task.tokenizer is None and folder is not None:
        tok = load_tokenizer(folder)
        if tok is not None:
            task.use_tokenizer(tok)
    return task.tokenizer


def _is_ids(value) -> bool:
    return isinstance(value, (list, tuple, np.ndarray)) and all(
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in value
    )


def _is_chat(value) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(isinstance(m, dict) for m in value)


class TextTask(Task):
    """A task on strings (module docstring). Subclasses implement :meth:`prompt_text`,
    :meth:`reward_text`, :meth:`action_tokens` (the cap of each turn, in tokens) and, for a
    multi-turn task, :meth:`observe_text`; a subclass with its own ``__init__`` passes
    ``tokenizer`` on to this one. The episode state a prompt returns is shared by the branches of
    its tree: read it, do not change it."""

    stop_texts: Sequence[str] = ()
    """Strings that end an action, each one token of the tokenizer (beside its EOS)."""

    def __init__(self, tokenizer=None):
        self.tokenizer = None
        if tokenizer is not None:
            self.use_tokenizer(tokenizer)

    def use_tokenizer(self, tokenizer) -> None:
        """Use ``tokenizer``: a tokenizer object, or a folder to load one from."""
        if isinstance(tokenizer, (str, Path)):
            tok = load_tokenizer(tokenizer)
            if tok is None:
                raise InvalidInputError(
                    "task_args.tokenizer", f"{tokenizer}: no tokenizer files in this folder"
                )
            tokenizer = tok
        for method in ("encode", "decode"):
            if not callable(getattr(tokenizer, method, None)):
                raise InvalidInputError(
                    "task_args.tokenizer",
                    f"a tokenizer has encode and decode methods, got {type(tokenizer).__name__}",
                )
        self.tokenizer = tokenizer

    # ------------------------------------------------------------------ what a subclass writes
    @abstractmethod
    def prompt_text(self, rng: np.random.Generator) -> tuple[object, object]:
        """``(prompt, episode state)``: the prompt a string, a chat (a list of message dicts) or
        token ids."""

    def observe_text(self, state, turn: int, action: str) -> str | Sequence[int]:
        """The observation (a string or token ids) after the decoded ``action`` at ``turn``.
        Default: none."""
        return ""

    @abstractmethod
    def reward_text(self, state, actions: list[str]) -> float | Sequence[float]:
        """The leaf's reward, or one per turn, from its decoded actions."""

    # ------------------------------------------------------------------ the token interface
    def _tok(self):
        if self.tokenizer is None:
            raise InvalidInputError(
                "task",
                f"task {self.name or type(self).__name__!r} works on text and has no tokenizer: the model "
                "folder has none (a flavor has none); give task_args.tokenizer = FOLDER",
            )
        return self.tokenizer

    def encode(self, text: str, special: bool = False) -> list[int]:
        """``text``'s token ids (``special``: with the tokenizer's special tokens, e.g. BOS)."""
        return [int(t) for t in self._tok().encode(text, add_special_tokens=special)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok().decode([int(t) for t in ids])

    def action_text(self, action: Sequence[int]) -> str:
        """The action decoded, its stop token left out."""
        ids = list(action)
        if ids and ids[-1] in set(self.stop_tokens):
            ids = ids[:-1]
        return self.decode(ids)

    @property
    def stop_tokens(self) -> tuple[int, ...]:  # type: ignore[override]
        """The tokenizer's EOS and the ids of :attr:`stop_texts` (each must be one token)."""
        tok = self.tokenizer
        if tok is None:
            return ()
        out = []
        eos = getattr(tok, "eos_token_id", None)
        for e in eos if isinstance(eos, (list, tuple)) else [eos]:
            if e is not None:
                out.append(int(e))
        for s in self.stop_texts:
            ids = self.encode(s)
            if len(ids) != 1:
                raise InvalidInputError("stop_texts", f"{s!r} is {len(ids)} tokens of the tokenizer, not one")
            out.append(ids[0])
        return tuple(dict.fromkeys(out))

    def check(self, vocab_size: int) -> None:
        tok = self._tok()
        n = len(tok) if hasattr(tok, "__len__") else None
        if n is not None and n > vocab_size:
            raise InvalidInputError(
                "tokenizer",
                f"the tokenizer has {n:,} ids, more than the model's vocabulary of {vocab_size:,}",
            )

    def render(self, prompt) -> list[int]:
        """A prompt's token ids: a string with special tokens, a chat through the chat template
        (module docstring), token ids as they are."""
        tok = self._tok()
        if isinstance(prompt, str):
            return self.encode(prompt, special=True)
        if _is_chat(prompt):
            if not getattr(tok, "chat_template", None):
                raise InvalidInputError(
                    "prompt", "a chat prompt needs a chat template; the tokenizer has none"
                )
            text = tok.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
            return self.encode(text)
        if _is_ids(prompt):
            return [int(t) for t in prompt]
        raise InvalidInputError(
            "prompt",
            f"a text task's prompt is a string, a list of messages or token ids, got {type(prompt).__name__}",
        )

    def prompt(self, rng):
        p, state = self.prompt_text(rng)
        return self.render(p), state

    def observe(self, state, turn, tokens, action):
        obs = self.observe_text(state, turn, self.action_text(action))
        if isinstance(obs, str):
            return self.encode(obs) if obs else []
        return obs  # token ids (checked by the sampler)

    def reward(self, state, tokens, actions):
        return self.reward_text(state, [self.action_text(a) for a in actions])
