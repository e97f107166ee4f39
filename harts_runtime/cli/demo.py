"""``harts-train --mode both``: the synthetic step on two copies of one model, compact and
trajectory-wise (:func:`harts_runtime.demo.train_demo`), from the resolved settings."""

from __future__ import annotations

import os

from harts_runtime.cli.flags import flag_name
from harts_runtime.errors import UsageError
from harts_runtime.job_config import JobConfig
from harts_runtime.options import MODES, ExecutionOptions, OptimizerOptions

__all__ = ["DEMO_NAMES", "demo_settings", "run_demo"]

DEMO_NAMES = {"model_path": "model", "json_lines": "json", "modes": "mode"}
""":func:`harts_runtime.demo.train_modes` parameters whose setting has another name."""
SHOWN = ("config", "progress", "progress_every")
"""Settings of how the run is shown or read, which the demo takes without a parameter."""


def demo_settings() -> frozenset[str]:
    """The settings ``--mode both`` takes: :func:`harts_runtime.demo.train_modes`'s parameters
    (read from its signature, so a setting it has no parameter for is refused, never ignored)."""
    import inspect

    from harts_runtime.demo import train_modes

    params = inspect.signature(train_modes).parameters
    return frozenset(DEMO_NAMES.get(p, p) for p in params) | frozenset(SHOWN)


def _refuse_others(args, given: dict) -> None:
    from harts_runtime.cli.parser import build_parser

    defaults = {a.dest: a.default for a in build_parser()._actions}
    takes = demo_settings()
    for k in given:
        if k not in takes and k in defaults and getattr(args, k, None) != defaults[k]:
            flag = next((a.option_strings[0] for a in build_parser()._actions if a.dest == k), flag_name(k))
            raise UsageError(
                f"{flag}: --mode both compares two model copies on the synthetic step; it takes no {flag}",
                flag,
            )


def run_demo(args, given: dict) -> int:
    """Run the two-copy comparison; returns the exit code. Bad settings raise :class:`UsageError`,
    or the options' :class:`~harts_runtime.errors.InvalidInputError` naming the field."""
    import torch

    from harts_runtime.demo import train_demo, train_modes
    from harts_runtime.trainer.checks import run_options

    _refuse_others(args, given)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device: not a device: {device!r}", "--device") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device: {device} requested but CUDA is not available here", "--device")
    cpu = dev.type == "cpu"
    resolved = JobConfig.of(vars(args)).resolve(dev.type, "synthetic")
    capacity = resolved.capacity
    execution = run_options(ExecutionOptions, args, mode="compact", capacity=capacity)
    if args.model is not None and (args.flavor is not None or args.layers is not None):
        raise UsageError("--model: a checkpoint folder replaces --flavor and --layers; give one", "--model")
    if args.model is not None and not os.path.isfile(os.path.join(args.model, "config.json")):
        raise UsageError(f"--model: {args.model!r} is not a checkpoint folder (no config.json)", "--model")
    max_len = args.max_len if args.max_len is not None else (1024 if cpu else None)
    steps = 3 if args.steps is None else args.steps
    lr = resolved.lr
    run_options(OptimizerOptions, args, lr=lr, total_steps=args.total_steps or max(1, steps))
    opts = dict(
        model_path=args.model,
        flavor=args.flavor,
        layers=args.layers,
        capacity=capacity,
        recompute=execution.recompute,
        keep=execution.keep,
        objective=args.objective,
        lr=lr,
    )
    if args.json:
        train_modes(
            MODES,
            preset=args.preset,
            steps=steps,
            seed=args.seed,
            max_len=max_len,
            device=device,
            json_lines=True,
            out=None,
            **opts,
        )
    else:
        train_demo(args.preset, steps, args.seed, max_len, device, **opts)
    return 0
