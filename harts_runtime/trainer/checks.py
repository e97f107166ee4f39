"""What ``harts-train`` decides and checks before any model work, on every rank alike (so a bad
input stops every rank with the same one-line error): the device, the parallel dimensions, the
model's config (and, for a flavor, whether its training state fits the device), the loss, the
output paths. Bad input raises :class:`~harts_runtime.errors.UsageError` naming the flag, or
:class:`~harts_runtime.errors.InvalidInputError` naming the field."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import torch

from harts_runtime.errors import InvalidInputError, UsageError
from harts_runtime.job_config import group_settings
from harts_runtime.options import option_fields

__all__ = [
    "LOSS_FLAGS",
    "check_outputs",
    "check_training_fits",
    "dims_text",
    "loss_config",
    "model_config",
    "parallel_dims",
    "run_options",
    "training_device",
]

LOSS_FLAGS = tuple(s.name for s in group_settings("loss") if s.name != "objective")
"""Settings that override the objective's default :class:`PolicyLossConfig` fields (the tree's
``loss`` group)."""
_DIM_FLAGS = {s.name: s.flag for s in group_settings("parallel")} | {"world_size": "world size"}
"""The parallel degrees' flags (the tree's ``parallel`` group), by :class:`ParallelDims` field."""
_DIM_KEYS = {s.name: s.key for s in group_settings("parallel")}


def run_options(cls, args, **resolved):
    """``cls`` (:class:`~harts_runtime.options.ExecutionOptions` or
    :class:`~harts_runtime.options.OptimizerOptions`) of the run's settings: each field that is a
    setting (a flag) from ``args``, ``resolved`` replacing some (the values decided at run time:
    ``capacity``, ``lr``, ``total_steps``, ``mode``), the others at their declared defaults.
    ``keep``'s comma-separated text is a tuple and ``max_grad_norm`` 0 is None (no clipping). The
    options' own checks raise :class:`InvalidInputError` naming the field (the CLI says the flag)."""
    values = {}
    for f in option_fields(cls):
        if f.name in resolved:
            values[f.name] = resolved[f.name]
        elif hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
    if isinstance(values.get("keep"), str):
        values["keep"] = tuple(k.strip() for k in values["keep"].split(",") if k.strip())
    if values.get("max_grad_norm") == 0:
        values["max_grad_norm"] = None
    return cls(**values)


def training_device(name, world: int, local_rank: int) -> torch.device:
    """``--device`` (None: cuda when available), under several processes ``cuda:LOCAL_RANK``."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device: not a device: {name!r}", "--device") from None
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device: cpu or cuda[:i], got {name!r}", "--device")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device: {name} requested but CUDA is not available here", "--device")
        if world > 1:
            dev = torch.device("cuda", local_rank)
        if (dev.index or 0) >= torch.cuda.device_count():
            raise UsageError(
                f"--device: {dev} does not exist ({torch.cuda.device_count()} CUDA devices)", "--device"
            )
    return dev


def parallel_dims(args, world: int):
    """The :class:`~harts_runtime.parallel.ParallelDims` of ``--tp`` / ``--cp`` / ``--ep`` /
    ``--dp-replicate`` / ``--sp`` over ``world`` processes; None for one process (where those flags
    and the FSDP2 ones are refused)."""
    from harts_runtime.parallel.dims import ParallelDims

    degrees = {name: getattr(args, key) for name, key in _DIM_KEYS.items()}
    if world == 1:
        for name, v in degrees.items():
            if not isinstance(v, bool) and v > 1:
                flag = _DIM_FLAGS[name]
                raise UsageError(
                    f"{flag} {v}: needs several processes: run under torchrun --nproc-per-node N -m "
                    "harts_runtime.cli ... (this is one process)",
                    flag,
                )
        if degrees.get("sequence_parallel"):
            raise UsageError("--sp: needs --tp > 1 (under torchrun)", "--sp")
        for dest in ("param_dtype", "reduce_dtype", "cpu_offload"):
            if getattr(args, dest):
                flag = "--" + dest.replace("_", "-")
                raise UsageError(
                    f"{flag}: applies to the sharded model under torchrun (FSDP2); one process trains in --dtype",
                    flag,
                )
        return None
    tp, cp, dp_replicate = degrees["tp"], degrees["cp"], degrees["dp_replicate"]
    if world % cp:
        raise UsageError(f"--cp {cp}: does not divide the world size {world}", "--cp")
    if world % (tp * cp * dp_replicate):
        raise UsageError(
            f"--tp {tp} x --cp {cp} x --dp-replicate {dp_replicate} = "
            f"{tp * cp * dp_replicate} does not divide the world size {world}",
            "--tp",
        )
    try:
        return ParallelDims.from_world(world, **degrees)
    except InvalidInputError as e:
        flag = _DIM_FLAGS.get(e.field, e.field)
        raise UsageError(f"{flag}: {str(e)[len(e.field) + 2 :]} (world size {world})", flag) from None


def dims_text(dims) -> list[tuple[str, object]]:
    """The degrees of ``dims`` worth saying (dp_shard, and those above 1)."""
    out = [("dp_shard", dims.dp_shard)]
    for k in ("dp_replicate", "cp", "tp", "ep"):
        if getattr(dims, k) > 1:
            out.append((k, getattr(dims, k)))
    if dims.sequence_parallel:
        out.append(("sp", True))
    return out


def model_config(args, cpu: bool):
    """``(ModelConfig, name)``: ``--model``'s ``config.json`` (read, not loaded), or the flavor's
    (``--flavor``, default debug on CPU and ling-tiny on CUDA; ``--layers``, ``--dtype``), at
    ``--chunk-size`` when given."""
    if args.model is not None:
        if args.flavor is not None or args.layers is not None:
            raise UsageError(
                "--model: a checkpoint folder replaces --flavor and --layers; give one", "--model"
            )
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            raise UsageError(
                f"--model: {args.model!r} is not a checkpoint folder (no config.json)", "--model"
            )
        from harts_runtime.hf import read_config

        return read_config(args.model, args.dtype, _chunk(args))[3], str(args.model)
    from harts_runtime.models import model_config as flavor_config

    flavor = args.flavor or ("debug" if cpu else "ling-tiny")
    over = {"dtype": args.dtype} if args.dtype else {}
    return flavor_config(flavor, args.layers, **over, **_chunk(args)), flavor


def _chunk(args) -> dict:
    """``--chunk-size`` as a model-config override (none when not given: the model's own), checked
    by the model group's declaration (:class:`~harts_runtime.job_config.ModelOptions`)."""
    from harts_runtime.job_config import ModelOptions

    chunk = getattr(args, "chunk_size", None)
    if chunk is None:
        return {}
    ModelOptions(chunk_size=chunk)
    return {"chunk_size": chunk}


def check_training_fits(cfg, name: str, device, world: int) -> None:
    """One-line error, before the model is built, when the flavor's weights, gradients and AdamW
    state (4x the parameter bytes; split over ``world`` ranks) exceed the device's available memory
    (``--flavor ling-tiny`` on a CPU needs about 125 GB: it was OOM-killed with no word)."""
    from harts_runtime import hf

    needed = 4 * hf.model_bytes(cfg) / max(1, world)
    available, where = hf.available_bytes(device)
    if available is not None and needed > available:
        raise InvalidInputError(
            "flavor",
            f"{name} with {cfg.num_layers} layers needs about {hf.human_bytes(needed)} for its weights, "
            f"gradients and AdamW state{' per rank' if world > 1 else ''}, more than the "
            f"{hf.human_bytes(available)} available on {where}; take fewer --layers, a smaller flavor, or "
            "more ranks",
        )


def loss_config(args):
    """The objective's default :class:`PolicyLossConfig` with the loss flags given."""
    from harts_runtime.step_inputs import default_loss_config

    over = {k: getattr(args, k) for k in LOSS_FLAGS if getattr(args, k) is not None}
    return dataclasses.replace(default_loss_config(args.objective), **over)


def check_outputs(args) -> None:
    """``--save`` / ``--export`` / ``--tensorboard`` are folders (or new), ``--metrics`` a file, and
    TensorBoard is installed when asked for."""
    for path_flag in ("save", "export", "tensorboard"):
        p = getattr(args, path_flag)
        if p is not None and os.path.exists(p) and not os.path.isdir(p):
            raise UsageError(f"--{path_flag}: {p!r} exists and is not a folder", f"--{path_flag}")
    if args.metrics is not None and os.path.isdir(args.metrics):
        raise UsageError(f"--metrics: {args.metrics!r} is a folder; give a file name", "--metrics")
    if args.tensorboard is not None and importlib.util.find_spec("tensorboard") is None:
        raise UsageError(
            "--tensorboard: tensorboard is not installed: pip install 'harts[train]' (or pip install tensorboard)",
            "--tensorboard",
        )
