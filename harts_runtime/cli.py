"""``harts-train``: train steps of a hybrid model on a synthetic rollout batch.

``harts-train [--flavor debug|ling-tiny|qwen3.5-35b-a3b | --model PATH] [--layers N] [--preset P] [--seed N] [--max-len L]
[--mode compact|trajectory|both] [--steps N] [--capacity T] [--recompute [--keep attention,linear_attention]] [--objective grpo|ppo]
[--lr LR] [--device cpu|cuda] [--json]`` prints one line (or JSON object) per step and mode;
``--mode both`` is :func:`harts_runtime.demo.train_demo`. Run it as ``harts-train`` or
``python -m harts_runtime.cli``.

Errors (torch missing, an unknown flavor, a layer count the flavor lacks, a device that is not
there, ...) are one line on stderr and exit code 2, never a traceback; ``--help`` works without torch.
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]

MODES = ("compact", "trajectory")  # harts_runtime.layout.rows.MODES, without importing torch for --help


def main(argv=None) -> int:
    """``harts-train``: train steps on a synthetic rollout batch and print one line per step."""
    ap = argparse.ArgumentParser(prog="harts-train", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--flavor",
        default=None,
        help="model flavor: debug (CPU default), ling-tiny (CUDA default) or qwen3.5-35b-a3b",
    )
    ap.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="a transformers checkpoint folder (Kimi-Linear, Qwen3-Next, Qwen3.5-MoE) instead of a flavor",
    )
    ap.add_argument(
        "--layers", type=int, default=None, help="keep the first N layers of the flavor's pattern"
    )
    ap.add_argument(
        "--preset", default="small", help="harts_planner.synth preset (tiny, small, medium, swe-like)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--max-len",
        type=int,
        default=None,
        help="cap trajectory length (default: 1024 on CPU, the preset's on CUDA)",
    )
    ap.add_argument("--mode", choices=MODES + ("both",), default="compact")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--capacity", type=int, default=None, help="T: rows per microbatch (CPU 4096, CUDA 65536)"
    )
    ap.add_argument("--recompute", action="store_true", help="full-block activation recomputation")
    ap.add_argument(
        "--keep",
        default="",
        metavar="REGIONS",
        help="with --recompute: op regions whose activations are kept instead of recomputed "
        "(comma-separated; 'attention': the attention cores, a third of their cost, ~1.4 GB per MLA layer "
        "of a 65,536-row ling-tiny microbatch; 'linear_attention': the KDA / Gated DeltaNet rounds, "
        "~1.9 GB per KDA layer there)",
    )
    ap.add_argument("--objective", choices=("grpo", "ppo"), default="grpo")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda when available)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per step instead")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError as e:
        ap.exit(
            2, f"harts-train: error: {e.name or e} is not installed: pip install '.[runtime]' torch==2.13.0\n"
        )
    from harts_runtime.demo import train_demo, train_modes
    from harts_runtime.errors import InvalidInputError

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device: not a device: {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device: {args.device} requested but CUDA is not available here")
    for name in ("steps", "layers", "capacity", "max_len"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "steps" else 1):
            ap.error(f"--{name.replace('_', '-')}: must be >= {0 if name == 'steps' else 1}, got {value}")
    keep = tuple(k for k in args.keep.split(",") if k)
    if keep and not args.recompute:
        ap.error("--keep: needs --recompute (it names what recomputation keeps)")
    from harts_runtime.ops.keep import checked_keep

    try:
        checked_keep(keep)
    except InvalidInputError as e:  # "keep: unknown regions [...]; choose from [...]"
        ap.error(f"--{e}")
    cpu = device.type == "cpu"
    if args.model is not None and (args.flavor is not None or args.layers is not None):
        ap.error("--model: a checkpoint folder replaces --flavor and --layers; give one")
    if args.model is not None and not os.path.isfile(os.path.join(args.model, "config.json")):
        ap.error(f"--model: {args.model!r} is not a checkpoint folder (no config.json)")
    opts = dict(
        model_path=args.model,
        flavor=args.flavor,
        layers=args.layers,
        capacity=args.capacity,
        recompute=args.recompute,
        keep=keep,
        objective=args.objective,
        lr=args.lr,
    )
    max_len = args.max_len if args.max_len is not None else (1024 if cpu else None)
    try:
        if args.mode == "both" and not args.json:
            train_demo(args.preset, args.steps, args.seed, max_len, args.device, **opts)
        else:
            modes = MODES if args.mode == "both" else (args.mode,)
            train_modes(
                modes,
                preset=args.preset,
                steps=args.steps,
                seed=args.seed,
                max_len=max_len,
                device=args.device,
                json_lines=args.json,
                out=None,
                **opts,
            )
    except (InvalidInputError, ValueError) as e:  # planner and runtime errors name their field
        ap.exit(2, f"harts-train: error: {e}\n")
    except BrokenPipeError:  # `harts-train ... | head`
        sys.stderr.close()
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
