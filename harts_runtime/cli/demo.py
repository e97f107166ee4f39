"""``harts-train --mode both``: the synthetic step trained by two runs of the one job loop
(:func:`harts_runtime.trainer.job.train_one`), one per execution (compact and trajectory-wise), on
two copies of one model, interleaved step by step so that each step's two losses can be compared
(the same math: they agree to float rounding). Every setting of the offline trainer applies to both
copies (the model, execution, objective and optimizer groups); what the comparison has no use for
(the rollout file, the parallel degrees, checkpoints and metrics files) is refused, never ignored.
"""

from __future__ import annotations

import os

from harts_runtime.cli.flags import flag_settings
from harts_runtime.errors import UsageError
from harts_runtime.job_config import JobConfig
from harts_runtime.options import MODES, ExecutionOptions, OptimizerOptions

__all__ = ["NOT_TAKEN", "demo_line", "not_taken", "run_demo"]

NOT_TAKEN = ("data", "checkpoints", "output")
"""The argument groups of ``harts-train``'s own job settings that the comparison does not take
(the rollout file; saves, resume, export; metrics files and TensorBoard), beside the ``parallel``
settings: its outputs are the per-step lines."""
SHOWN = ("json", "progress", "progress_every")
"""Output settings it takes (how the lines are printed)."""


def not_taken() -> dict[str, str]:
    """``dest -> flag`` of every setting ``--mode both`` refuses: the tree's parallel group and the
    job settings of :data:`NOT_TAKEN` (read from the parser's argument groups)."""
    from harts_runtime.cli.parser import build_parser

    out = {s.key: s.flag for s in flag_settings("harts-train", "parallel")}
    for group in build_parser()._action_groups:
        if group.title in NOT_TAKEN:
            for a in group._group_actions:
                if a.dest not in SHOWN and a.dest not in ("steps", "preset", "max_len", "seed"):
                    out[a.dest] = a.option_strings[0]
    return out


def _refuse_others(args, given: dict) -> None:
    from harts_runtime.cli.parser import build_parser

    defaults = {a.dest: a.default for a in build_parser()._actions}
    for dest, flag in not_taken().items():
        if dest in given and getattr(args, dest, None) != defaults.get(dest):
            raise UsageError(
                f"{flag}: --mode both compares two model copies on the synthetic step; it takes no {flag}",
                flag,
            )


def demo_line(i: int, mode: str, rec: dict) -> str:
    """A step's line (``step 0 compact tokens=... loss=...``)."""
    return (
        f"step {i} {mode:<10} tokens={rec['semantic_tokens']:,} rows={rec['rows']:,} "
        f"compression={rec['compression']:.2f}x microbatches={rec['microbatches']} calls={rec.get('kda_calls', 0)} "
        f"replay={rec['replay_tokens']:,} plan={rec['plan_seconds'] * 1e3:.1f}ms "
        f"fbg={rec['fbg_seconds']:.2f}s loss={rec['loss']:.6f}"
    )


def run_demo(args, given: dict, out=None, err=None) -> int:
    """Run the two-copy comparison; returns the exit code. Bad settings raise :class:`UsageError`,
    or the options' :class:`~harts_runtime.errors.InvalidInputError` naming the field."""
    import json
    import sys

    import torch

    from harts_runtime.engine import EngineConfig, HartsEngine
    from harts_runtime.trainer.checks import loss_config, model_config, run_options
    from harts_runtime.trainer.data import load_data
    from harts_runtime.trainer.job import train_one

    out = out or sys.stdout
    err = err or sys.stderr
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
    steps = 3 if args.steps is None else args.steps
    execution = {m: run_options(ExecutionOptions, args, mode=m, capacity=resolved.capacity) for m in MODES}
    total = args.total_steps or max(1, steps)
    optimizer = run_options(OptimizerOptions, args, lr=resolved.lr, total_steps=total)
    if args.model is not None and not os.path.isfile(os.path.join(args.model, "config.json")):
        raise UsageError(f"--model: {args.model!r} is not a checkpoint folder (no config.json)", "--model")
    model_cfg, name = model_config(args, cpu)
    loss = loss_config(args)
    source = args.model if args.model is not None else model_cfg
    over = {"chunk_size": args.chunk_size} if args.model is not None and args.chunk_size else {}
    engines, sources = {}, {}
    for mode in MODES:
        cfg = EngineConfig(
            execution=execution[mode], optimizer=optimizer, objective=args.objective, loss_config=loss
        )
        torch.manual_seed(args.seed)
        engines[mode] = HartsEngine.build(source, cfg, dtype=args.dtype, device=dev, freeze=False, **over)
        sources[mode] = load_data(args, engines[mode].vocab_size, cpu, loss)
    print(sources[MODES[0]].describe(), file=err)
    m = engines[MODES[0]].model
    print(
        f"model: {name} layers={m.config.num_layers} params={sum(p.numel() for p in m.parameters()):,} "
        f"dtype={m.config.dtype} device={dev}",
        file=err,
    )
    for i in range(steps):
        losses = {}
        for mode in MODES:
            rec = train_one(engines[mode], sources[mode], i + 1)
            losses[mode] = rec["loss"]
            line = json.dumps(dict(rec, step=i, mode=mode)) if args.json else demo_line(i, mode, rec)
            print(line, file=out, flush=True)
        if not args.json:
            diff = abs(losses["compact"] - losses["trajectory"])
            print(f"step {i} |loss(compact) - loss(trajectory)| = {diff:.3e}", file=out, flush=True)
    return 0
