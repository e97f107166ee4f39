"""The ``harts-rl`` command (:func:`main`): an RL run from a task to new weights.

::

    harts-rl --task token-set --flavor kimi-linear-tiny --steps 30 --out runs/ts [--seed S]
             [--mode compact|trajectory] [--config FILE] [--save-every K] [--advantage grpo|tree]
    harts-rl --resume runs/ts --steps 40

The engine's flags (``--lr``, ``--capacity``, ``--mode``, ``--lr-schedule``, ...) are generated from
:mod:`harts_runtime.options` by :func:`harts_runtime.cli.flags.add_option_flags`, as
``harts-train``'s are; the RL settings are :class:`~harts_runtime.rl.config.RLConfig`'s. A config
file (``--config``: TOML or JSON) holds the same keys (``forks = {0 = 4, 1 = 2}``,
``task_args = {set_size = 16}``); flags override it. One plain progress line per step on stderr;
``DIR/metrics.jsonl`` per step; the reward curve at the end (:mod:`harts_runtime.rl.metrics`).
Errors are one line: exit code 2 for bad input (a flag, the config file, an environment's token id
out of range or non-finite reward: the step is refused and the last checkpoint stays intact), 1
otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from harts_runtime.cli.flags import add_option_flags, float_type, int_type, option_error, option_flag
from harts_runtime.errors import InvalidInputError, UsageError
from harts_runtime.options import ExecutionOptions, OptimizerOptions
from harts_runtime.rl.config import RLConfig

__all__ = ["build_parser", "main"]

PROG = "harts-rl"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # noqa: D102 (argparse API)
        raise UsageError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, description="agentic RL on a HARTS engine: rollout trees to new weights.")
    ap.add_argument("--config", metavar="FILE", help="settings file (.toml or .json) keyed by flag name")
    g = ap.add_argument_group("run")
    g.add_argument("--task", default=None, help="built-in task: token-set or calculator (default: token-set)")
    g.add_argument(
        "--flavor", default=None, help="flavor with random weights (kimi-linear-tiny, qwen3.5-tiny)"
    )
    g.add_argument("--model", metavar="PATH", default=None, help="a transformers checkpoint folder")
    g.add_argument("--layers", metavar="N", type=int_type(1), default=None, help="a flavor's first N layers")
    g.add_argument("--steps", metavar="N", type=int_type(0), default=None, help="steps in all (default: 30)")
    g.add_argument("--out", metavar="DIR", default=None, help="the run folder (metrics, checkpoints)")
    g.add_argument(
        "--resume", metavar="DIR", default=None, help="continue the run in DIR at its last checkpoint"
    )
    g.add_argument(
        "--seed", metavar="S", type=int_type(0), default=None, help="model, sampler and environment seed"
    )
    g.add_argument(
        "--save-every", metavar="K", type=int_type(0), default=None, help="checkpoint every K steps"
    )
    g.add_argument(
        "--prompts", metavar="N", type=int_type(1), default=None, help="prompts per step (default: 4)"
    )
    g.add_argument(
        "--advantage", choices=("grpo", "tree"), default=None, help="advantage estimator (default: grpo)"
    )
    g.add_argument("--temperature", type=float_type(positive=True), default=None, help="sampling temperature")
    g.add_argument("--chunk-size", metavar="C", type=int_type(1), default=None, help="KDA / GDN chunk size")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cpu)")
    add_option_flags(
        ap.add_argument_group("execution (harts_runtime.options.ExecutionOptions)"), ExecutionOptions
    )
    add_option_flags(
        ap.add_argument_group("optimizer (harts_runtime.options.OptimizerOptions)"), OptimizerOptions
    )
    return ap


_RL_KEYS = {f.name for f in dataclasses.fields(RLConfig)}
_OPTION_KEYS = {f.name for c in (ExecutionOptions, OptimizerOptions) for f in dataclasses.fields(c)}


def _load_config(path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--config: {path!r}: no such file", "--config")
    text = p.read_text()
    try:
        if p.suffix == ".json":
            data = json.loads(text)
        else:
            try:
                import tomllib
            except ImportError:  # Python 3.10
                import tomli as tomllib

            data = tomllib.loads(text)
    except Exception as e:  # tomllib.TOMLDecodeError, json.JSONDecodeError
        raise UsageError(f"{path}: not valid {p.suffix[1:].upper()}: {e}", "--config") from None
    out = {}
    for k, v in data.items():
        key = k.replace("-", "_")
        if key not in _RL_KEYS and key not in _OPTION_KEYS:
            raise UsageError(f"{path}: {k}: unknown key (see {PROG} --help)", "--config")
        out[key] = v
    return out


def _settings(argv) -> tuple[dict, dict, str | None]:
    """``(rl settings, engine options, resume dir)`` from the flags over the config file."""
    ap = build_parser()
    args = ap.parse_args(argv)
    explicit = build_parser()
    for a in explicit._actions:
        a.default = argparse.SUPPRESS
    given = vars(explicit.parse_args(argv))
    settings = _load_config(args.config) if args.config else {}
    settings.update({k: v for k, v in given.items() if k not in ("config",)})
    resume = settings.pop("resume", None)
    out = settings.pop("out", None)
    if resume is not None and out is not None and Path(out) != Path(resume):
        raise UsageError("--resume: the run continues in its own folder; drop --out", "--resume")
    rl = {k: v for k, v in settings.items() if k in _RL_KEYS}
    options = {k: v for k, v in settings.items() if k in _OPTION_KEYS}
    if isinstance(options.get("keep"), str):
        options["keep"] = tuple(x for x in options["keep"].split(",") if x)
    if options.get("max_grad_norm") == 0:
        options["max_grad_norm"] = None
    if resume is None:
        if out is None:
            raise UsageError("--out: a run folder is needed (or --resume DIR)", "--out")
        rl["_out"] = out
    return rl, options, resume


def _run(argv, err) -> int:
    rl, options, resume = _settings(argv)

    def say(line: str) -> None:
        print(line, file=err, flush=True)

    from harts_runtime.rl.loop import RLRun
    from harts_runtime.rl.metrics import plot_rewards

    if resume is not None:
        if set(rl) - {"steps"} or options:
            raise UsageError("--resume: a resumed run keeps its settings; give only --steps", "--resume")
        run = RLRun.resume(resume, steps=rl.get("steps"))
        say(f"resumed {resume} at step {run.step}")
        out = resume
    else:
        out = rl.pop("_out")
        if (Path(out) / "run.json").exists():
            raise UsageError(f"--out: {out} holds a run already; continue it with --resume {out}", "--out")
        cfg = RLConfig(**rl)
        options.setdefault("capacity", 4096 if cfg.device == "cpu" else 65_536)
        options.setdefault("lr", 1e-6 if cfg.model else 1e-2)
        if options.get("lr_schedule", "constant") in ("linear", "cosine"):
            options.setdefault("total_steps", cfg.steps)
        run = RLRun(cfg, options, out)
        say(
            f"{PROG}: task {cfg.task}, {cfg.flavor or cfg.model}, {cfg.steps} steps, forks {run.forks}, out {out}"
        )
    run.run(progress=say)
    say(plot_rewards(out))
    return 0


def main(argv=None) -> int:
    """The ``harts-rl`` entry point; returns the exit code (0, 2 for bad input, 1 otherwise)."""
    err = sys.stderr
    try:
        return _run(argv, err)
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        print(f"{PROG}: error: interrupted", file=err)
        return 130
    except InvalidInputError as e:
        if option_flag(e):
            e = option_error(e)
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=err)
        return 2
    except Exception as e:
        if os.environ.get("HARTS_TRACEBACK"):
            raise
        print(f"{PROG}: error: {type(e).__name__}: {e} (set HARTS_TRACEBACK=1 for the traceback)", file=err)
        return 1


if __name__ == "__main__":
    sys.exit(main())
