"""``harts-train``'s run (:func:`train`): settings checked, data read, the engine built through
:meth:`HartsEngine.build <harts_runtime.engine.HartsEngine.build>` (under ``torchrun`` over the
device mesh of ``--tp`` / ``--ep`` / ``--dp-replicate`` / ``--sp``), a resumed checkpoint loaded, and
the step loop (:func:`harts_runtime.trainer.loop.run_loop`).

The settings come resolved from :mod:`harts_runtime.cli` (flags over a config file over a resumed
checkpoint's settings). Everything that can be checked is checked before any model work, on every
rank alike (so a bad input stops every rank with the same one-line error): the flags, the options
(:func:`~harts_runtime.trainer.checks.run_options`: their own checks), the model's config, the whole
rollout file against the model's vocabulary, the loss against the fields the file has.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from harts_runtime.errors import UsageError
from harts_runtime.job_config import JobConfig, resolve_total_steps
from harts_runtime.options import ExecutionOptions, OptimizerOptions
from harts_runtime.trainer.checks import (
    check_outputs,
    check_training_fits,
    dims_text,
    loss_config,
    model_config,
    parallel_dims,
    run_options,
    training_device,
)
from harts_runtime.trainer.data import FileData, SyntheticData, load_data
from harts_runtime.trainer.loop import run_loop

__all__ = ["train"]


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        raise UsageError(f"environment variable {name}={os.environ[name]!r} is not an integer") from None


def _steps(args, given, saved, data, same: bool) -> int:
    """The total of steps to reach: ``--steps`` when given; resumed on the same data, the saved
    total; resumed on other data, one more pass; else one pass over the file (3 synthetic steps)."""
    done = int(saved["steps_done"]) if saved else 0
    if "steps" in given and args.steps is not None:
        return args.steps
    if saved is not None and same:
        return int(saved["args"].get("steps", done))
    if saved is not None:
        return done + data.num_steps
    if isinstance(data, FileData):
        return data.num_steps
    return 3


def _check_schedule(args, done: int, steps: int, total_steps: int) -> None:
    """A decaying schedule whose end is behind the run would train the steps past it at
    ``--min-lr-ratio x --lr`` (at lr = 0 by default): refused, naming ``--total-steps``. Without
    ``--total-steps`` the decay ends at ``--steps`` (a resumed run's new total), so this needs an
    explicit ``--total-steps`` (given now or saved with the run) below the steps still to train."""
    if args.lr_schedule not in ("linear", "cosine") or steps <= done or args.min_lr_ratio:
        return
    if total_steps <= done:
        raise UsageError(
            f"--total-steps: the {args.lr_schedule} schedule ended at step {total_steps}, so steps "
            f"{done + 1}..{steps} would train at lr 0; give a larger --total-steps (or --min-lr-ratio)",
            "--total-steps",
        )


def _record_args(args, model_name: str, data, **resolved) -> dict:
    """The settings saved in ``trainer.json`` (a resumed run inherits them): paths absolute (so a
    run resumes from elsewhere), the values decided at run time filled in."""
    record = {k: v for k, v in vars(args).items() if k not in ("config", "resume", "fallback")}
    record.update(resolved)
    for k in ("data", "model", "save", "export", "metrics", "tensorboard"):
        if record.get(k) is not None:
            record[k] = os.path.abspath(record[k])
    if args.model is None:
        record["flavor"] = model_name
    if isinstance(data, SyntheticData):
        record["max_len"] = data.fingerprint["max_len"]
    return record


def _load(engine, folder) -> None:
    """Load the resumed checkpoint; refused, the error names the older complete checkpoints beside
    it that ``--fallback`` would try."""
    from harts_runtime.errors import InvalidInputError
    from harts_runtime.trainer_state import STATE_NAME, complete_steps

    try:
        engine.load(folder)
    except InvalidInputError as e:
        here = Path(folder)
        n = int(here.name[5:]) if here.name.startswith("step-") and here.name[5:].isdigit() else None
        older = [f.name for k, f in complete_steps(here.parent, STATE_NAME) if n is not None and k < n]
        if not older:
            raise
        text = str(e)[len(e.field) + 2 :] if str(e).startswith(f"{e.field}: ") else str(e)
        hint = f" (older checkpoints: {', '.join(older)}; --resume {here.parent} --fallback resumes from the newest that loads)"
        raise InvalidInputError(e.field, text + hint) from None


def train(args, given, saved: dict | None, out=None, err=None) -> int:
    """Run ``harts-train`` with resolved settings (:func:`harts_runtime.cli.resolve_settings`:
    ``given`` names the settings given on the command line or in a config file, ``saved`` is a
    resumed checkpoint's ``trainer.json``); returns the exit code. Bad input raises
    :class:`~harts_runtime.errors.InvalidInputError` (an option's names its field) or
    :class:`~harts_runtime.errors.UsageError`; the CLI prints either as one line."""
    out = out or sys.stdout
    err = err or sys.stderr
    pre_init = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if pre_init else _env_int("WORLD_SIZE", 1)
    rank = dist.get_rank() if pre_init else _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank)
    lead = rank == 0

    def note(text: str) -> None:
        if lead:
            print(text, file=err, flush=True)

    # ---- settings, checked before any work (on every rank alike)
    device = training_device(args.device, world, local_rank)
    cpu = device.type == "cpu"
    job = JobConfig.of(vars(args))
    capacity = job.resolve(device.type, "file" if args.data else "synthetic").capacity
    execution = run_options(ExecutionOptions, args, capacity=capacity)
    dims = parallel_dims(args, world)
    model_cfg, model_name = model_config(args, cpu)
    if args.model is None:  # a flavor: refuse what the device cannot hold before any data or model
        check_training_fits(model_cfg, model_name, device, world)
    loss_cfg = loss_config(args)
    check_outputs(args)
    data = load_data(args, model_cfg.vocab_size, cpu, loss_cfg)

    same = saved is not None and data.same(saved["data"], data.fingerprint)
    done = int(saved["steps_done"]) if saved else 0
    position = int(saved["data"].get("position", done)) if same else 0
    steps = _steps(args, given, saved, data, same)
    total_steps = resolve_total_steps(args.total_steps, steps, args.lr_schedule) or max(1, steps)
    _check_schedule(args, done, steps, total_steps)
    lr = job.resolve(device.type, "file" if args.data else "synthetic").lr
    optimizer = run_options(OptimizerOptions, args, lr=lr, total_steps=total_steps)
    longest, where = data.longest()
    cp = 1 if dims is None else dims.cp
    if longest > capacity * cp:  # the planner would refuse it at the first step, after the model is built
        if cp == 1:
            raise UsageError(
                f"--capacity: T = {capacity} rows per microbatch is below the longest trajectory "
                f"({longest} tokens, {where}); a trajectory is never split between microbatches "
                "(--cp C runs microbatches of C x T rows on C ranks)",
                "--capacity",
            )
        raise UsageError(
            f"--cp: C x T = {cp} x {capacity} = {cp * capacity} rows per microbatch is below the "
            f"longest trajectory ({longest} tokens, {where})",
            "--cp",
        )
    from harts_runtime.engine import EngineConfig, HartsEngine

    ecfg = EngineConfig(
        execution=execution, optimizer=optimizer, objective=args.objective, loss_config=loss_cfg
    )
    # total_steps recorded as given (None: it follows --steps, also in a resumed run that goes on)
    record_args = _record_args(
        args, model_name, data, steps=steps, total_steps=args.total_steps, lr=lr, capacity=capacity
    )
    note(data.describe())

    # ---- processes, engine
    created = False
    if world > 1 and not pre_init:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        created = True
    try:
        torch.manual_seed(args.seed)
        # a checkpoint folder, or the flavor's config; frozen: what the transformers family lacks
        # (always for a checkpoint, for a flavor when it will be exported)
        source = args.model if args.model is not None else model_cfg
        engine = HartsEngine.build(
            source,
            ecfg,
            dims,
            dtype=args.dtype,
            device=device,
            freeze=args.model is not None or args.export is not None,
            **({"chunk_size": args.chunk_size} if args.model is not None and args.chunk_size else {}),
        )
        cfg = engine.model.config
        params = sum(p.numel() for p in engine.model.parameters())
        on = f" world={world} ({', '.join(f'{k}={v}' for k, v in dims_text(dims))})" if dims else ""
        frozen = engine.frozen
        note(
            f"model: {model_name} layers={cfg.num_layers} params={params:,} dtype={cfg.dtype} device={device}{on}"
            + (f"; {len(frozen)} parameters the transformers family lacks stay frozen" if frozen else "")
        )
        if saved is not None:
            _load(engine, saved["folder"])
            how = "same data" if same else "a different data source: starting at its first step"
            note(
                f"resumed from {saved['folder']}: step {done}, optimizer step {engine.step}, data position "
                f"{position} ({how})"
            )
        return run_loop(engine, data, args, steps, done, position, record_args, world, lead, out, err)
    finally:
        if created:
            dist.destroy_process_group()
