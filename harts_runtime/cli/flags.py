"""``harts-train``'s flags of the option classes, generated from their declarations, and the
options' errors said as those flags.

Every field of :class:`~harts_runtime.options.ExecutionOptions` and
:class:`~harts_runtime.options.OptimizerOptions` but those in :data:`NOT_FLAGS` is a flag: the field
``name`` is ``--name`` in kebab case, its type comes from the annotation (``int``, ``float``, ``str``;
a ``bool`` is a switch; a tuple of choices, ``keep``, is a comma-separated list), its help, choices
and metavar from the field's metadata, its default from the field. :data:`CLI_FLAGS` says where the
command line differs: defaults decided at run time (``--capacity`` by the device, ``--lr`` by the
model, ``--total-steps`` by ``--steps``), ``--mode both``, ``--max-grad-norm 0`` for no clipping.

A flag parses its type only. The values are checked once, by the options' own ``__post_init__``,
when the trainer builds the options (:func:`harts_runtime.trainer.checks.run_options`); the field's
:class:`~harts_runtime.errors.InvalidInputError` becomes one :class:`~harts_runtime.errors.UsageError`
line named after the flag (:func:`option_error`: ``--keep: needs --recompute ...``), or after the
config file and key the value came from. No torch here.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import types
import typing

from harts_runtime.errors import InvalidInputError, UsageError
from harts_runtime.options import (
    DEFAULT_CAPACITY,
    MODES,
    ExecutionOptions,
    OptimizerOptions,
    option_fields,
)

__all__ = [
    "CLI_FLAGS",
    "NOT_FLAGS",
    "OPTION_CLASSES",
    "add_option_flags",
    "flag_fields",
    "flag_name",
    "float_type",
    "int_type",
    "option_error",
    "option_flag",
]

OPTION_CLASSES = (ExecutionOptions, OptimizerOptions)
"""The option classes whose fields are flags."""
NOT_FLAGS = ("no_replay", "betas", "eps")
"""Option fields without a flag (``harts-train`` never had one; they keep their declared defaults).
``--lr-schedule`` has no ``external`` choice either (``CLI_FLAGS["lr_schedule"]``): no scheduler
outside ``harts-train`` sets its learning rate."""
CLI_FLAGS: dict[str, dict] = {
    "capacity": dict(default=None, more=f"; default: 4096 on CPU, {DEFAULT_CAPACITY} on CUDA"),
    "mode": dict(
        choices=MODES + ("both",),
        more=", or both (the synthetic step on two model copies, compact and trajectory-wise)",
    ),
    "keep": dict(default=""),
    "lr": dict(default=None, more="; default: 1e-6 with --model, 1e-3 for a flavor's random weights"),
    "lr_schedule": dict(
        choices=("constant", "linear", "cosine"),
        help="after warm-up (default: %(default)s): constant, or linear / cosine decay to --min-lr-ratio x --lr "
        "at --total-steps",
    ),
    "total_steps": dict(more="; default: --steps"),
    "max_grad_norm": dict(
        help="clip the global gradient norm to this (default: %(default)s), 0: no clipping (the norm is "
        "reported anyway)"
    ),
}
"""Where a flag differs from its field: ``default`` (None: decided at run time), ``choices``,
``help`` (instead of the field's) or ``more`` (after it)."""


def flag_name(field: str) -> str:
    """``microbatch_cost`` -> ``--microbatch-cost``."""
    return "--" + field.replace("_", "-")


def int_type(lo: int | None = None):
    """An argparse type: an integer (at least ``lo`` when given)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if lo is not None and v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v

    parse.__name__ = "int"
    return parse


def float_type(lo: float | None = None, hi: float | None = None, positive: bool = False, finite=True):
    """An argparse type: a number (finite, and in the bounds given)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if finite and not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
        if positive and v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
        if lo is not None and v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"must be <= {hi}, got {v}")
        return v

    parse.__name__ = "float"
    return parse


def _list_type(text: str) -> str:
    """A comma-separated list flag keeps its text (as given, and as ``trainer.json`` records it);
    the trainer makes it a tuple."""
    return text


_list_type.__name__ = "list"


def _kind(annotation) -> type:
    """The flag kind of a field annotation: ``bool``, ``int``, ``float``, ``str`` or ``tuple``
    (``X | None`` is ``X``)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        (annotation,) = args
    if typing.get_origin(annotation) is tuple:
        return tuple
    if annotation in (bool, int, float, str):
        return annotation
    raise TypeError(f"no flag kind for the annotation {annotation!r}")


def flag_fields(cls) -> list[tuple[dataclasses.Field, type]]:
    """``(field, kind)`` of each field of ``cls`` that is a flag, in declaration order."""
    hints = typing.get_type_hints(cls)
    return [(f, _kind(hints[f.name])) for f in option_fields(cls) if f.name not in NOT_FLAGS]


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()


def add_option_flags(group, cls) -> None:
    """Add the flags of ``cls``'s fields to ``group`` (an argparse parser or argument group)."""
    for f, kind in flag_fields(cls):
        meta = dict(f.metadata)
        cli = CLI_FLAGS.get(f.name, {})
        text = cli.get("help", meta.get("help", "")) + cli.get("more", "")
        choices = cli.get("choices", meta.get("choices"))
        default = cli.get("default", _default(f))
        kw: dict = dict(dest=f.name, default=default)
        if kind is bool:
            group.add_argument(flag_name(f.name), action="store_true", help=text, **kw)
            continue
        if kind is tuple:
            listed = f" ({', '.join(choices)})" if choices else ""
            text += f"; comma-separated{listed}"
            kw.update(type=_list_type)
        else:
            kw.update(type={int: int_type(), float: float_type(finite=False)}.get(kind, str))
            if choices is not None:
                kw.update(choices=tuple(choices))
        if "metavar" in meta:
            kw.update(metavar=meta["metavar"])
        group.add_argument(flag_name(f.name), help=text, **kw)


_FLAG_FIELDS = frozenset(f.name for c in OPTION_CLASSES for f, _ in flag_fields(c))
_FIELD_WORD = re.compile(r"(?<![\w'-])(" + "|".join(sorted(_FLAG_FIELDS, key=len, reverse=True)) + r")\b(=)?")
"""A field named in an options message (``needs recompute``, ``lr_schedule='cosine'``), said as its
flag (``needs --recompute``, ``--lr-schedule 'cosine'``)."""


def option_flag(e: InvalidInputError) -> bool:
    """Whether ``e`` names a field that is a flag (``keep``, ``betas[0]`` is not)."""
    return not isinstance(e, UsageError) and e.field.split("[", 1)[0] in _FLAG_FIELDS


def option_error(e: InvalidInputError, given=None) -> UsageError:
    """An options check's error (``keep: needs recompute ...``) as a ``harts-train`` line: ``--keep:
    needs --recompute ...``, or ``run.toml: keep: ...`` when ``given`` (setting -> where it was
    given: a config file's name, or None for the command line) says the value came from a file."""
    message = str(e)[len(e.field) + 2 :] if str(e).startswith(f"{e.field}: ") else str(e)
    message = _FIELD_WORD.sub(lambda m: flag_name(m.group(1)) + (" " if m.group(2) else ""), message)
    name = e.field.split("[", 1)[0]
    source = given.get(name) if isinstance(given, dict) else None
    if source:
        return UsageError(f"{source}: {e.field}: {message}", flag_name(name))
    return UsageError(f"{flag_name(name)}: {message}", flag_name(name))
