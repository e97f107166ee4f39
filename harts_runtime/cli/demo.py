"""``harts-train --mode both``: the synthetic step on two copies of one model, compact and
trajectory-wise (:func:`harts_runtime.demo.train_demo`), from the resolved settings."""

from __future__ import annotations

import os

from harts_runtime.cli.flags import flag_name
from harts_runtime.errors import UsageError
from harts_runtime.options import DEFAULT_CAPACITY, MODES, ExecutionOptions, OptimizerOptions

__all__ = ["TRAINER_ONLY", "run_demo"]

TRAINER_ONLY = (
    "data",
    "save",
    "save_every",
    "resume",
    "export",
    "metrics",
    "tensorboard",
    "tp",
    "ep",
    "dp_replicate",
    "sp",
    "planner",
)
"""Settings of the engine trainer that ``--mode both`` (the two-copy demo) does not take."""


def run_demo(args, given: dict) -> int:
    """Run the two-copy comparison; returns the exit code. Bad settings raise :class:`UsageError`,
    or the options' :class:`~harts_runtime.errors.InvalidInputError` naming the field."""
    import torch

    from harts_runtime.demo import train_demo, train_modes
    from harts_runtime.trainer.checks import run_options

    bad = [k for k in TRAINER_ONLY if k in given and getattr(args, k) not in (None, False, 0, 1)]
    if bad:
        flag = flag_name(bad[0])
        raise UsageError(
            f"{flag}: --mode both compares two model copies on the synthetic step; it takes no {flag}", flag
        )
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device: not a device: {device!r}", "--device") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device: {device} requested but CUDA is not available here", "--device")
    cpu = dev.type == "cpu"
    capacity = args.capacity or (4096 if cpu else DEFAULT_CAPACITY)
    execution = run_options(ExecutionOptions, args, mode="compact", capacity=capacity)
    if args.model is not None and (args.flavor is not None or args.layers is not None):
        raise UsageError("--model: a checkpoint folder replaces --flavor and --layers; give one", "--model")
    if args.model is not None and not os.path.isfile(os.path.join(args.model, "config.json")):
        raise UsageError(f"--model: {args.model!r} is not a checkpoint folder (no config.json)", "--model")
    max_len = args.max_len if args.max_len is not None else (1024 if cpu else None)
    steps = 3 if args.steps is None else args.steps
    lr = args.lr if args.lr is not None else (1e-6 if args.model else 1e-3)
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
