"""The ``harts-rl`` command (:func:`main`): an RL run from a task to new weights, the second
command of the one CLI beside ``harts-train`` (:mod:`harts_runtime.cli.main`).

::

    harts-rl --task token-set --flavor kimi-linear-tiny --steps 30 --out runs/ts [--seed S]
             [--mode compact|trajectory] [--config FILE] [--save-every K] [--advantage grpo|tree]
    harts-rl --resume runs/ts --steps 40

Its flags are generated from the settings tree (:mod:`harts_runtime.job_config`, by
:func:`harts_runtime.cli.flags.add_group_flags`): the model, execution, objective, optimizer and rl
groups, as ``harts-train``'s are; the defaults that depend on the device and the source
(``capacity``, ``lr``, ``chunk_size``) are :meth:`JobConfig.resolve
<harts_runtime.job_config.JobConfig.resolve>`'s. A config file (``--config``: TOML or JSON,
:func:`harts_runtime.cli.settings.load_config`) holds the same keys (``forks = {0 = 4, 1 = 2}``,
``task_args = {set_size = 16}``); flags override it. One plain progress line per step on stderr;
``DIR/metrics.jsonl`` per step; the reward curve at the end (:mod:`harts_runtime.trainer.metrics`).
Errors are one line: exit code 2 for bad input (a flag, the config file, an environment's token id
out of range or non-finite reward: the step is refused and the last checkpoint stays intact), 1
otherwise. Every setting is checked before any work, and before torch is imported where it can be
(the bounds: :mod:`harts_runtime.rl.config`); the message names the flag (``--layers: ...``) or
the config file and key (``rl.toml: forks: ...``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import typing
from pathlib import Path

from harts_runtime.cli.flags import (
    COMMAND_GROUPS,
    add_group_flags,
    flag_name,
    int_type,
    option_error,
)
from harts_runtime.cli.parser import Formatter, Parser
from harts_runtime.cli.settings import load_config, parse_command_line
from harts_runtime.errors import InvalidInputError, UsageError
from harts_runtime.job_config import (
    ONLINE_LOSS,
    JobConfig,
    declared_flavors,
    group_settings,
    resolve_total_steps,
    rl_defaults,
    setting,
)
from harts_runtime.options import ExecutionOptions, OptimizerOptions
from harts_runtime.rl.config import RLConfig

__all__ = ["PROG", "build_parser", "main"]

PROG = "harts-rl"
_OPTION_GROUPS = ("execution", "optimizer")
_OPTION_KEYS = {s.key for g in _OPTION_GROUPS for s in group_settings(g)}
_LOSS_KEYS = {s.key for s in group_settings("loss")}
_RL_KEYS = {f.name for f in dataclasses.fields(RLConfig)}
_OPTION_HINTS = {
    k: v for c in (ExecutionOptions, OptimizerOptions) for k, v in typing.get_type_hints(c).items()
}


def build_parser() -> argparse.ArgumentParser:
    """The ``harts-rl`` parser (no torch needed)."""
    ap = Parser(
        prog=PROG,
        description="agentic RL on a HARTS engine: rollout trees to new weights.",
        formatter_class=Formatter,
    )
    ap.add_argument("--config", metavar="FILE", help="settings file (.toml or .json) keyed by flag name")
    g = ap.add_argument_group("run")
    d = rl_defaults()
    g.add_argument(
        "--steps", metavar="N", type=int_type(0), default=None, help=f"steps in all (default: {d['steps']})"
    )
    g.add_argument("--out", metavar="DIR", default=None, help="the run folder (metrics, checkpoints)")
    g.add_argument(
        "--resume", metavar="DIR", default=None, help="continue the run in DIR at its last checkpoint"
    )
    g.add_argument(
        "--seed",
        metavar="S",
        type=int_type(0),
        default=None,
        help=f"model, sampler and environment seed (default: {d['seed']})",
    )
    g.add_argument(
        "--save-every",
        metavar="K",
        type=int_type(0),
        default=None,
        help=f"checkpoint every K steps (default: {d['save_every']}: at the end only)",
    )
    g.add_argument(
        "--fallback",
        action="store_true",
        default=None,
        help="with --resume: a newest checkpoint that does not load (damaged, incomplete) is skipped, "
        "said, for the newest one that loads",
    )
    g.add_argument(
        "--export-hf",
        metavar="DIR",
        default=None,
        help="at the end, write the trained policy as a transformers checkpoint folder to DIR (with "
        "--resume and no steps left: export the run's last checkpoint)",
    )
    for group in COMMAND_GROUPS[PROG]:
        add_group_flags(ap, PROG, group)
    return ap


def _option_type_error(key: str, value) -> str | None:
    """What is wrong with the type of an engine option's value from a config file (None: fine);
    the options' own checks see the values after this (``keep = 5`` would reach ``tuple(5)``)."""
    hint = _OPTION_HINTS[key]
    args = typing.get_args(hint)
    if value is None:
        return None if type(None) in args else "must not be null"
    if type(None) in args:
        (hint,) = [a for a in args if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin is tuple:
        items = [a for a in typing.get_args(hint) if a is not Ellipsis]
        kind = items[0] if items else str
        if kind is str and isinstance(value, str):
            return None
        if not isinstance(value, list) or len(value) > 64:
            return f"must be a list of {kind.__name__} values, got {value!r}"
        for v in value:
            if _scalar_error(kind, v):
                return f"must be a list of {kind.__name__} values, got {v!r} in it"
        return None
    return _scalar_error(hint, value)


def _scalar_error(kind, value) -> str | None:
    if kind is bool:
        return None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return None if ok else f"must be an integer, got {value!r}"
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else f"must be a number, got {value!r}"
    if kind is str:
        return None if isinstance(value, str) else f"must be a string, got {value!r}"
    return None


def _settings(argv, given: dict) -> tuple[dict, dict, str | None]:
    """``(rl settings, engine options, resume dir)`` from the flags over the config file;
    ``given`` is filled with each setting's source (the config file's name, or None for a flag)."""
    ap, args, flags = parse_command_line(build_parser, argv)
    settings = load_config(args.config, ap, command=PROG) if args.config else {}
    for k, v in settings.items():
        bad = None
        if k in _OPTION_KEYS:
            bad = _option_type_error(k, v)
        elif k in _LOSS_KEYS and v is not None:
            bad = _scalar_error(setting(k).kind, v)
        if bad:
            raise UsageError(f"{args.config}: {k}: {bad}", "--config")
    given.update({k: str(args.config) for k in settings})
    settings.update({k: v for k, v in flags.items() if k not in ("config",)})
    given.update({k: None for k in flags})
    resume = settings.pop("resume", None)
    out = settings.pop("out", None)
    run_flags = {k: settings.pop(k) for k in ("fallback", "export_hf") if k in settings}
    if run_flags.get("fallback") and resume is None:
        raise UsageError("--fallback: applies to --resume DIR", "--fallback")
    if resume is not None and out is not None and Path(out) != Path(resume):
        raise UsageError("--resume: the run continues in its own folder; drop --out", "--resume")
    rl = {k: v for k, v in settings.items() if k in _RL_KEYS}
    args = rl.get("task_args")
    if isinstance(args, dict) and isinstance(args.get("prompts_file"), str):  # resumable from elsewhere
        rl["task_args"] = dict(args, prompts_file=os.path.abspath(args["prompts_file"]))
    options = {k: v for k, v in settings.items() if k in _OPTION_KEYS}
    loss = {k: v for k, v in settings.items() if k in _LOSS_KEYS}
    if isinstance(options.get("keep"), str):
        options["keep"] = tuple(x for x in options["keep"].split(",") if x)
    elif isinstance(options.get("keep"), list):
        options["keep"] = tuple(options["keep"])
    if isinstance(options.get("betas"), list):
        options["betas"] = tuple(options["betas"])
    if options.get("max_grad_norm") == 0:
        options["max_grad_norm"] = None
    if loss:
        options["objective"] = loss.pop("objective", "grpo")
        options["loss_config"] = {**ONLINE_LOSS, **loss}
    if resume is None:
        if out is None:
            raise UsageError("--out: a run folder is needed (or --resume DIR)", "--out")
        rl["_out"] = out
    rl["_run"] = run_flags
    return rl, options, resume


def _check_out(out: str, flag: str = "--out") -> None:
    """The folder can be made: it is a folder or not there yet, under a writable folder."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{flag}: {out} is a file, not a folder", flag)
    parent = p
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{flag}: {out}: {parent} is a file, not a folder", flag)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}: {out}: {parent} is not writable", flag)


def _check_device(device: str) -> None:
    if device == "cpu":
        return
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= n:
        have = (
            "no CUDA device" if n == 0 else f"{n} CUDA device{'s' if n > 1 else ''} (cuda:0 to cuda:{n - 1})"
        )
        raise InvalidInputError("device", f"{device}: this machine has {have}")


def _preflight(cfg: RLConfig, options: dict) -> str:
    """Every check that needs no model, before any work: the engine options, the task and its
    arguments, the tree's size (:meth:`RLConfig.check_task`), and for a flavor its layers, chunk
    size and the task against its vocabulary; returns the step's shape in words."""
    from harts_runtime.rl.tasks import make_task

    split = {
        c: {k: v for k, v in options.items() if k in {f.name for f in dataclasses.fields(c)}}
        for c in (ExecutionOptions, OptimizerOptions)
    }
    kw = split[OptimizerOptions]
    kw["total_steps"] = resolve_total_steps(
        kw.get("total_steps"), cfg.steps, kw.get("lr_schedule", "constant")
    )
    for c, kw in split.items():
        c(**kw)
    for name in ("param_dtype", "reduce_dtype", "cpu_offload"):  # harts-train refuses them alike
        if options.get(name):
            raise UsageError(
                f"{flag_name(name)}: applies to the sharded model under torchrun (FSDP2); harts-rl runs one "
                "process in the model's dtype",
                flag_name(name),
            )
    if "loss_config" in options:
        for k, v in options["loss_config"].items():
            s = setting(k)
            if s.choices is not None and v not in s.choices:
                raise InvalidInputError(k, f"unknown {v!r}; choose one of {s.choices}")
    task = make_task(cfg.task, **cfg.task_args)
    vocab = None
    if cfg.flavor is not None:
        online = declared_flavors(families_only=True)
        if cfg.flavor not in online:
            kind = "has no transformers family" if cfg.flavor in declared_flavors() else "is unknown"
            raise InvalidInputError(
                "flavor",
                f"{cfg.flavor!r} {kind} (the rollout engine runs a transformers model); "
                f"choose one of {', '.join(online)}",
            )
        cfg.check_task(task)  # the tree's size first: cheap, and before torch is imported
        from harts_runtime.models import model_config
        from harts_runtime.models.registry import family_of

        kw = {} if cfg.chunk_size is None else {"chunk_size": cfg.chunk_size}
        try:
            model_cfg = model_config(cfg.flavor, cfg.layers, **kw)
        except InvalidInputError as e:
            if e.field != "num_layers":
                raise
            raise InvalidInputError("layers", str(e)[len(e.field) + 2 :]) from None
        vocab = model_cfg.vocab_size
        family_of(model_cfg).check_transformers("flavor")  # the rollout engine's model
    shape = cfg.check_task(task, vocab)
    _check_device(cfg.device)
    return f"{shape.leaves:,} leaves ({cfg.prompts:,} prompts x {shape.leaves_per_prompt:,}), {shape.tokens:,} tokens per step"


def _run(argv, err, given: dict) -> int:
    rl, options, resume = _settings(argv, given)
    run_flags = rl.pop("_run")
    export = run_flags.get("export_hf")
    if export is not None:
        _check_out(export, "--export-hf")

    def say(line: str) -> None:
        print(line, file=err, flush=True)

    if resume is not None:
        if set(rl) - {"steps"} or options:
            raise UsageError(
                "--resume: a resumed run keeps its settings; give only --steps, --fallback, --export-hf",
                "--resume",
            )
        from harts_runtime.rl.run import RLRun

        run = RLRun.resume(resume, steps=rl.get("steps"), log=say, fallback=bool(run_flags.get("fallback")))
        say(f"resumed {resume} at step {run.step}")
        out = resume
    else:
        out = rl.pop("_out")
        if (Path(out) / "run.json").exists():
            raise UsageError(f"--out: {out} holds a run already; continue it with --resume {out}", "--out")
        _check_out(out)
        cfg = RLConfig(**rl)
        resolved = JobConfig.of({**rl, **options}).resolve(cfg.device, "online")
        options.setdefault("capacity", resolved.capacity)
        options.setdefault("lr", resolved.lr)
        shape = _preflight(cfg, options)
        from harts_runtime.rl.run import RLRun

        run = RLRun(cfg, options, out)
        say(
            f"{PROG}: task {cfg.task}, {cfg.flavor or cfg.model}, {cfg.steps} steps, forks {run.forks} "
            f"({shape}), out {out}"
        )
    from harts_runtime.trainer.metrics import plot_rewards

    run.run(progress=say)
    say(plot_rewards(out))
    if export is not None:
        from harts_runtime.trainer.export import export_hf

        export_hf(run.engine, export, run.config.model)
        say(f"exported {export}")
    return 0


def _usage_line(e: InvalidInputError, given: dict) -> str:
    """``e`` as one line naming where the value came from: ``--model: ...`` for a flag,
    ``rl.toml: prompts: ...`` for a config file's key, else ``field: ...``."""
    if isinstance(e, UsageError):
        return str(e)
    if e.field.split("[", 1)[0] in _OPTION_KEYS | _LOSS_KEYS:
        return str(option_error(e, given))
    name = re.split(r"[\[.]", e.field, maxsplit=1)[0]
    if name not in given:
        return str(e)
    if given[name] is not None:
        return f"{given[name]}: {e}"
    message = str(e)[len(e.field) + 2 :] if str(e).startswith(f"{e.field}: ") else str(e)
    return f"{flag_name(name)}{e.field[len(name) :]}: {message}"


def main(argv=None) -> int:
    """The ``harts-rl`` entry point; returns the exit code (0, 2 for bad input, 1 otherwise)."""
    err = sys.stderr
    given: dict = {}
    try:
        return _run(argv, err, given)
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM after a whole step (trainer.job.Stopped)
        print(f"{PROG}: error: {e or 'interrupted'}", file=err)
        return 130
    except InvalidInputError as e:
        print(f"{PROG}: error: {' '.join(_usage_line(e, given).split())}", file=err)
        return 2
    except Exception as e:
        if os.environ.get("HARTS_TRACEBACK"):
            raise
        print(f"{PROG}: error: {type(e).__name__}: {e} (set HARTS_TRACEBACK=1 for the traceback)", file=err)
        return 1


if __name__ == "__main__":
    sys.exit(main())
