"""``harts-train``'s settings: config files (:func:`load_config`) and the resolution of flags over a
config file over a resumed checkpoint's saved settings (:func:`resolve_settings`).

A config file (TOML, YAML or JSON) is a flat table keyed by the flags' long names (``max_grad_norm``
or ``max-grad-norm``); each value is converted as its flag's text would be (a list for a
comma-separated flag such as ``keep``). Every problem is one :class:`UsageError` naming the file
and key. No torch here.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from pathlib import Path

from harts_runtime.cli.parser import build_parser
from harts_runtime.errors import UsageError

__all__ = [
    "NOT_CONFIG",
    "NOT_INHERITED",
    "RUN_OUTPUTS",
    "load_config",
    "parse_command_line",
    "resolve_settings",
]

NOT_CONFIG = ("config", "help")
"""Flags a config file cannot set."""
NOT_INHERITED = ("config", "resume", "steps", "export", "fallback")
"""Settings a resumed run does not take from the checkpoint (``steps``: the trainer decides).
The rule for outputs: a log continues (``--metrics`` and ``--tensorboard`` are inherited; their
records past the resumed step are dropped, then the run appends), a result is per run (``--export``
is not inherited: a resumed run exports only when told, so it never overwrites the earlier export)."""


def _parse(raw: bytes, ext: str, where: str):
    if ext == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            try:
                import tomli as tomllib
            except ImportError:
                raise UsageError(
                    "--config: reading TOML on Python 3.10 needs tomli: pip install 'harts[train]'",
                    "--config",
                ) from None
        return tomllib.loads(raw.decode("utf-8"))
    if ext in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise UsageError(
                "--config: reading YAML needs pyyaml: pip install 'harts[train]'", "--config"
            ) from None
        return yaml.safe_load(raw.decode("utf-8"))
    if ext == ".json":
        return json.loads(raw.decode("utf-8"))
    raise UsageError(
        f"--config: {where!r}: unknown config type {ext or '(none)'!r}; expected .toml, .yaml, .yml or .json",
        "--config",
    )


MAX_CONFIG_BYTES = 1 << 20
"""The largest config file read."""


def load_config(path, parser: argparse.ArgumentParser | None = None, *, command: str = "harts-train") -> dict:
    """The settings of a config file (``.toml``, ``.yaml`` / ``.yml`` or ``.json``: a flat table of
    flag long names, ``-`` or ``_``; the keys of the settings tree the command takes); raises
    :class:`UsageError` naming the file and key. ``harts-train`` converts each value as its flag
    would be; ``harts-rl`` keeps the values as the file types them (tables such as ``forks``; the
    settings' classes check them, naming the key)."""
    parser = parser or build_parser()
    p = Path(path)
    where = str(path)
    if not p.is_file():
        raise UsageError(
            f"--config: {where!r}: {'is a directory' if p.is_dir() else 'no such file'}", "--config"
        )
    size = p.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise UsageError(f"--config: {path}: {size:,} bytes, over the limit {MAX_CONFIG_BYTES:,}", "--config")
    ext = p.suffix.lower()
    if command != "harts-train" and ext not in (".toml", ".json"):
        ext = ".toml"
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise UsageError(f"--config: {where!r}: {e.strerror or e}", "--config") from None
    try:
        data = _parse(raw, ext, where)
    except UsageError:
        raise
    except UnicodeDecodeError as e:
        raise UsageError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})", "--config") from None
    except Exception as e:  # tomllib.TOMLDecodeError, yaml.YAMLError, json.JSONDecodeError
        msg = " ".join(str(e).split())
        raise UsageError(f"{where}: not valid {ext[1:].upper()}: {msg}", "--config") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UsageError(
            f"{where}: expected a table of settings keyed by flag name, got {type(data).__name__}", "--config"
        )
    actions = {a.dest: a for a in parser._actions if a.dest not in NOT_CONFIG and a.option_strings}
    keys = set(actions)
    if command != "harts-train":
        from harts_runtime.cli.flags import command_settings

        keys |= {s.key for s in command_settings(command)}
    out = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in keys or dest.startswith("_"):
            if command != "harts-train":
                raise UsageError(f"{where}: {key}: unknown key (see {command} --help)", "--config")
            close = difflib.get_close_matches(dest, list(actions), n=1)
            hint = (
                f"; did you mean {close[0]!r}?"
                if close
                else "; keys are the long flag names (see harts-train --help)"
            )
            raise UsageError(f"{where}: {key}: unknown key{hint}", "--config")
        if command != "harts-train":
            out[dest] = value
            continue
        out[dest] = _config_value(actions[dest], value, f"{where}: {key}")
    return out


def _config_value(action: argparse.Action, value, where: str):
    if value is None:
        return action.default
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise UsageError(f"{where}: expected true or false, got {value!r}", "--config")
        return value
    if getattr(action.type, "__name__", None) == "list" and isinstance(value, list):
        if not all(isinstance(v, str) for v in value):
            raise UsageError(f"{where}: expected a list of names, got {value!r}", "--config")
        value = ",".join(value)
    if isinstance(value, (list, dict)):
        raise UsageError(f"{where}: expected a single value, got {type(value).__name__}", "--config")
    if isinstance(value, bool):
        raise UsageError(
            f"{where}: expected a {getattr(action.type, '__name__', 'string')}, got {value!r}", "--config"
        )
    if action.type is not None:
        try:
            value = action.type(str(value))
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"{where}: {e}", "--config") from None
    else:
        value = str(value)
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise UsageError(f"{where}: invalid choice {value!r} (choose from {choices})", "--config")
    return value


RUN_OUTPUTS = ("save", "metrics", "tensorboard", "export")
"""Where a run writes: inherited by a resumed run only from a checkpoint in the run's own ``--save``
folder (:func:`resolve_settings`)."""


def _own_run(folder, saved_save) -> bool:
    """Whether the checkpoint ``folder`` lies in the ``--save`` folder of the run that saved it
    (not a copy or a moved folder)."""
    if not isinstance(saved_save, str):
        return False
    return os.path.realpath(Path(folder).parent) == os.path.realpath(saved_save)


def parse_command_line(build, argv) -> tuple[argparse.ArgumentParser, argparse.Namespace, dict]:
    """``(parser, settings, given)`` of a command's ``argv`` (``build()`` makes its parser): every
    flag at its default or as given, and the flags the command line gave (both commands resolve a
    config file under them)."""
    parser = build()
    args = parser.parse_args(argv)
    explicit = build()
    for a in explicit._actions:
        a.default = argparse.SUPPRESS
    return parser, args, vars(explicit.parse_args(argv))


def _intact(folder) -> None:
    """``--fallback``'s test of a ``step-N`` folder: its ``trainer.json`` reads and every file its
    manifest lists is whole (size and SHA-256)."""
    from harts_runtime.parallel.checkpoint_folder import verify_folder
    from harts_runtime.trainer_state import read_trainer_state

    read_trainer_state(folder)
    verify_folder(folder, required=True)


def resolve_settings(argv) -> tuple[argparse.Namespace, dict, dict | None]:
    """``(settings, given, saved)``: the flag defaults, overridden by a resumed checkpoint's saved
    settings, then by ``--config``, then by the command line. ``given`` maps each setting the config
    file or the command line set to where: the config file's name, or None for the command line
    (errors name the file and key for the first). ``saved`` is the resumed checkpoint's
    ``trainer.json`` record (or None), with its ``folder``.

    A resumed run never writes into another run's folders unless told to: it inherits the saved
    ``--save``, ``--metrics``, ``--tensorboard`` and ``--export`` only when the checkpoint is in its
    run's own ``--save`` folder (the run going on). A checkpoint anywhere else (copied or moved)
    saves beside itself (``--save`` = the folder holding it: ``copy/step-2`` goes on to
    ``copy/step-3``) and writes no metrics, TensorBoard or export unless given again."""
    parser, args, given_cli = parse_command_line(build_parser, argv)
    config = load_config(args.config, parser) if args.config else {}
    resume = given_cli.get("resume", config.get("resume"))
    saved = None
    settings = {a.dest: a.default for a in parser._actions if a.dest != "help"}
    if resume:
        from harts_runtime.trainer_state import read_trainer_state, resolve_checkpoint

        check = _intact if given_cli.get("fallback", config.get("fallback")) else None
        folder = resolve_checkpoint(resume, check, lambda line: print(line, file=sys.stderr, flush=True))
        saved = read_trainer_state(folder)
        saved["folder"] = str(folder)
        inherited = saved.get("args", {}) if isinstance(saved.get("args"), dict) else {}
        for k, v in inherited.items():
            if k in settings and k not in NOT_INHERITED:
                settings[k] = v
        if not _own_run(folder, inherited.get("save")):
            settings.update(dict.fromkeys(RUN_OUTPUTS), save=str(Path(folder).absolute().parent))
    settings.update(config)
    settings.update(given_cli)
    settings["resume"] = resume
    given = dict.fromkeys(config, str(args.config) if config else None)
    given.update(dict.fromkeys(given_cli))
    return argparse.Namespace(**settings), given, saved
