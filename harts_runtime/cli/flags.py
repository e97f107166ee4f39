"""The flags of ``harts-train`` and ``harts-rl``, generated from the settings tree
(:mod:`harts_runtime.job_config`), and a setting's error said as its flag.

Every setting of a group a command takes is a flag (:func:`add_group_flags`) but those in
:data:`NOT_FLAGS` (config-file keys only): the setting ``name`` is ``--name`` in kebab case (``--sp``
for ``sequence_parallel``), its type comes from the declaration (``int``, ``float``, ``str``; a
``bool`` is a switch, ``--no-NAME`` where it is on by default; a tuple of choices, ``keep``, is a
comma-separated list; a table, ``forks``, is a config-file key only), its help, choices and metavar
from the declaration, its default from it. :func:`cli_overrides` says where a command's flag
differs: defaults decided at run time (``--capacity`` by the device, ``--lr`` by the source,
``--total-steps`` by ``--steps``: :meth:`JobConfig.resolve <harts_runtime.job_config.JobConfig.resolve>`),
``harts-train --mode both``, ``--max-grad-norm 0`` for no clipping.

A flag parses its type (and a loss or parallel bound the declaration states in words). The values
are checked once, by the declaring class's own checks, when the job builds it; the field's
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
from harts_runtime.job_config import (
    CAPACITY_DEFAULTS,
    CHUNK_SIZE_DEFAULT,
    LR_DEFAULTS,
    ONLINE_CHUNK_SIZE_DEFAULT,
    ONLINE_LOSS,
    Setting,
    declared_flavors,
    group_settings,
    rl_defaults,
    settings,
)
from harts_runtime.options import (
    MODES,
    ExecutionOptions,
    OptimizerOptions,
    option_fields,
)

__all__ = [
    "CLI_FLAGS",
    "COMMAND_GROUPS",
    "NOT_FLAGS",
    "OPTION_CLASSES",
    "add_group_flags",
    "add_option_flags",
    "cli_overrides",
    "command_settings",
    "flag_fields",
    "flag_name",
    "flag_settings",
    "float_type",
    "int_type",
    "option_error",
    "option_flag",
]

OPTION_CLASSES = (ExecutionOptions, OptimizerOptions)
"""The option classes whose fields are flags."""
COMMAND_GROUPS = {
    "harts-train": ("model", "execution", "loss", "optimizer", "parallel"),
    "harts-rl": ("model", "execution", "loss", "optimizer", "rl"),
}
"""The groups of the settings tree each command takes (``harts-rl`` runs one process: no
``parallel``; ``harts-train`` trains offline data: no ``rl``)."""
NOT_FLAGS = ("no_replay", "betas", "eps")
"""Settings without a flag (they keep their declared defaults; a config file may set them in
``harts-rl``). Tables (``forks``, ``task_args``) are config-file keys only too."""
NOT_SETTINGS = {"harts-train": (), "harts-rl": ("dtype",)}
"""Settings of a command's groups it does not take (``harts-rl`` trains in the flavor's dtype)."""
GROUP_TITLES = {
    "model": "model",
    "parallel": "parallelism (under torchrun; dp_shard = world / (dp_replicate * cp * tp))",
    "execution": "execution (harts_runtime.options.ExecutionOptions)",
    "optimizer": "optimizer (AdamW; harts_runtime.options.OptimizerOptions)",
    "loss": "objective (the built-in policy loss; harts_runtime.loss.objectives.PolicyLossConfig)",
    "rl": "rl (harts_runtime.rl.config.RLConfig)",
}


def _capacity_text() -> str:
    return "; default: " + ", ".join(
        f"{v} on {k.upper() if k == 'cpu' else 'CUDA'}" for k, v in CAPACITY_DEFAULTS.items()
    )


def cli_overrides(command: str) -> dict[str, dict]:
    """Where ``command``'s flag differs from its setting: ``default`` (None: decided at run time),
    ``choices``, ``help`` (instead of the setting's) or ``more`` (after it)."""
    online = command == "harts-rl"
    lr = LR_DEFAULTS["online flavor" if online else "flavor"]
    out: dict[str, dict] = {
        "capacity": dict(default=None, more=_capacity_text()),
        "keep": dict(default=""),
        "lr": dict(
            default=None,
            more=f"; default: {LR_DEFAULTS['model']:g} with --model, {lr:g} for a flavor's random weights",
        ),
        "lr_schedule": dict(
            choices=("constant", "linear", "cosine"),
            help="after warm-up (default: %(default)s): constant, or linear / cosine decay to --min-lr-ratio x --lr "
            "at --total-steps",
        ),
        "total_steps": dict(
            more="; default: --steps (a resumed run with a larger --steps stretches the decay to it)"
        ),
        "max_grad_norm": dict(
            help="clip the global gradient norm to this (default: %(default)s), 0: no clipping (the norm is "
            "reported anyway)"
        ),
    }
    if not online:
        out["mode"] = dict(
            choices=MODES + ("both",),
            more=", or both (the synthetic step on two model copies, compact and trajectory-wise)",
        )
        out["chunk_size"] = dict(more=f"; default: {CHUNK_SIZE_DEFAULT}")
        return out
    rl = rl_defaults()
    out["flavor"] = dict(
        help="a flavor of a transformers family, random weights: "
        + ", ".join(declared_flavors(families_only=True))
    )
    out["device"] = dict(help=f"cpu, cuda or cuda:N (default: {rl['device']})")
    out["chunk_size"] = dict(more=f"; default: {ONLINE_CHUNK_SIZE_DEFAULT}")
    loss = group_settings("loss")
    for s in loss:
        if s.name in ONLINE_LOSS:
            doc = s.help.rsplit(" (default:", 1)[0]
            out[s.name] = dict(help=f"{doc} (default for an online run: {ONLINE_LOSS[s.name]})")
    return out


CLI_FLAGS = cli_overrides("harts-train")
"""``harts-train``'s :func:`cli_overrides`."""


def command_settings(command: str) -> tuple[Setting, ...]:
    """Every setting of the tree ``command`` takes (flags and config-only keys)."""
    return tuple(s for s in settings(COMMAND_GROUPS[command]) if s.name not in NOT_SETTINGS[command])


def flag_settings(command: str, group: str) -> list[Setting]:
    """The settings of ``group`` that are ``command``'s flags, in declaration order."""
    return [
        s
        for s in group_settings(group)
        if s.name not in NOT_FLAGS and s.name not in NOT_SETTINGS[command] and s.kind is not dict
    ]


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


def setting_type(s: Setting):
    """The argparse type of a setting's flag (its kind, and the bounds its declaration states)."""
    if s.kind is int:
        return int_type(None if s.lo is None else int(s.lo))
    if s.kind is float:
        bounded = s.lo is not None or s.hi is not None or s.positive
        return float_type(s.lo, s.hi, s.positive, finite=bounded)
    if s.kind is tuple:
        return _list_type
    return None


def add_group_flags(parser, command: str, group: str, title: str | None = None) -> None:
    """Add ``command``'s flags of the tree's ``group`` to ``parser`` (in an argument group)."""
    g = parser.add_argument_group(title or GROUP_TITLES[group])
    over_all = cli_overrides(command)
    for s in flag_settings(command, group):
        over = over_all.get(s.name, {})
        text = over.get("help", s.help) + over.get("more", "")
        choices = over.get("choices", s.choices)
        default = over.get("default", s.default)
        kw: dict = dict(dest=s.key, default=default)
        if s.kind is bool:
            if default:
                g.add_argument(s.flag, action=argparse.BooleanOptionalAction, help=text, **kw)
            else:
                g.add_argument(s.flag, action="store_true", help=text, **kw)
            continue
        if s.kind is tuple:
            listed = f" ({', '.join(choices)})" if choices else ""
            text += f"; comma-separated{listed}"
        elif choices is not None:
            kw.update(choices=tuple(choices))
        kw.update(type=setting_type(s))
        if s.metavar:
            kw.update(metavar=s.metavar)
        g.add_argument(s.flag, help=text, **kw)


def add_option_flags(group, cls) -> None:
    """Add ``harts-train``'s flags of an options class (:data:`OPTION_CLASSES`) to ``group``."""
    name = "execution" if cls is ExecutionOptions else "optimizer"
    over_all = cli_overrides("harts-train")
    for s in flag_settings("harts-train", name):
        over = over_all.get(s.name, {})
        text = over.get("help", s.help) + over.get("more", "")
        choices = over.get("choices", s.choices)
        kw: dict = dict(dest=s.key, default=over.get("default", s.default))
        if s.kind is bool:
            group.add_argument(s.flag, action="store_true", help=text, **kw)
            continue
        if s.kind is tuple:
            text += f"; comma-separated ({', '.join(choices)})" if choices else "; comma-separated"
        elif choices is not None:
            kw.update(choices=tuple(choices))
        kw.update(type=setting_type(s))
        if s.metavar:
            kw.update(metavar=s.metavar)
        group.add_argument(s.flag, help=text, **kw)


_FLAGS = {s.name: s.flag for s in settings() if s.name not in NOT_FLAGS and s.kind is not dict}
"""Every setting's flag, by field name (``sequence_parallel`` -> ``--sp``)."""
_WORDS = sorted(
    (s.name for s in settings(("execution", "optimizer")) if s.name in _FLAGS), key=len, reverse=True
)
_FIELD_WORD = re.compile(r"(?<![\w'-])(" + "|".join(_WORDS) + r")\b(=)?")
"""An option named in an options message (``needs recompute``, ``lr_schedule='cosine'``), said as
its flag (``needs --recompute``, ``--lr-schedule 'cosine'``)."""


def option_flag(e: InvalidInputError) -> bool:
    """Whether ``e`` names a setting that is a flag (``keep``; ``betas[0]`` is not)."""
    return not isinstance(e, UsageError) and e.field.split("[", 1)[0] in _FLAGS


def option_error(e: InvalidInputError, given=None) -> UsageError:
    """A setting's check's error (``keep: needs recompute ...``) as a command's line: ``--keep:
    needs --recompute ...``, or ``run.toml: keep: ...`` when ``given`` (setting -> where it was
    given: a config file's name, or None for the command line) says the value came from a file."""
    message = str(e)[len(e.field) + 2 :] if str(e).startswith(f"{e.field}: ") else str(e)
    message = _FIELD_WORD.sub(lambda m: _FLAGS[m.group(1)] + (" " if m.group(2) else ""), message)
    name = e.field.split("[", 1)[0]
    flag = _FLAGS.get(name, flag_name(name))
    key = next((s.key for s in settings() if s.name == name), name)
    source = given.get(key, given.get(name)) if isinstance(given, dict) else None
    if source:
        return UsageError(f"{source}: {e.field}: {message}", flag)
    return UsageError(f"{flag}: {message}", flag)
