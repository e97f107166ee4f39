"""The trainer behind ``harts-train`` (:func:`train`): a loop of
:class:`~harts_runtime.engine.HartsEngine` steps over a rollout file's steps (or the synthetic
step), with checkpoints, metrics sinks, a progress display and, under ``torchrun``, a device mesh.

The settings come resolved from :mod:`harts_runtime.cli` (flags over a config file over a resumed
checkpoint's settings). Everything that can be checked is checked before any model work, on every
rank alike (so a bad input stops every rank with the same one-line error): flags, the model's
config, the whole rollout file against the model's vocabulary, the loss against the fields the file
has. Only rank 0 prints, writes metrics and ``trainer.json``; every rank saves and exports its
shards (the checkpoints and ``save_pretrained`` are collective).

Step ``k`` (1-based) trains on the data's step ``position % K`` (``K`` steps in the file; the
position advances by one per step and is saved with the checkpoint, so a resumed run continues
where it stopped; a resumed run on a *different* file starts at that file's first step).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from harts_runtime.errors import InvalidInputError
from harts_runtime.trainer_state import STATE_NAME, step_folder, write_trainer_state

__all__ = ["train"]

PROG = "harts-train"
LOSS_FLAGS = (
    "clip_ratio_low",
    "clip_ratio_high",
    "clip_ratio_c",
    "kl_coef",
    "kl_estimator",
    "loss_agg_mode",
    "loss_norm",
)
_DIM_FLAGS = {
    "tp": "--tp",
    "ep": "--ep",
    "dp_replicate": "--dp-replicate",
    "sequence_parallel": "--sp",
    "world_size": "world size",
}


def _usage(message: str):
    from harts_runtime.cli import UsageError

    return UsageError(message)


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        raise _usage(f"environment variable {name}={os.environ[name]!r} is not an integer") from None


# ---------------------------------------------------------------------------------- data sources
class _FileData:
    """A rollout file's steps."""

    def __init__(self, rf):
        self.rf = rf
        self.num_steps = rf.num_steps
        self.fingerprint = {
            "kind": "file",
            "path": os.path.abspath(rf.path),
            "sha256": rf.sha256,
            "steps": rf.num_steps,
        }

    def step(self, i: int):
        key = self.rf.step_keys[i] if self.rf.step_keys is not None else i
        return self.rf.steps[i], key

    def longest(self) -> tuple[int, str]:
        """The longest trajectory's length, and which step holds it."""
        best = (0, "")
        for i, s in enumerate(self.rf.steps):
            n = int(s.lengths.max())
            if n > best[0]:
                key = self.rf.step_keys[i] if self.rf.step_keys is not None else None
                best = (n, f"step {key}" if key is not None else "the file's one step")
        return best

    def describe(self) -> str:
        rf = self.rf
        tokens = sum(int(s.offsets[-1]) for s in rf.steps)
        text = (
            f"data: {rf.path} ({rf.format}): {rf.rows:,} trajectories, {tokens:,} tokens in {rf.num_steps} "
            f"step{'s' if rf.num_steps != 1 else ''}"
            + (" (by its 'step' key)" if rf.step_keys is not None else "")
            + ("; ref_logprobs" if rf.has_ref_logprobs else "; no ref_logprobs")
        )
        if rf.ignored:
            text += f"; ignored keys: {', '.join(rf.ignored)}"
        return text

    @staticmethod
    def same(a: dict, b: dict) -> bool:
        return a.get("kind") == "file" and b.get("kind") == "file" and a.get("sha256") == b.get("sha256")


class _SyntheticData:
    """The synthetic step (``--preset``), the same every step."""

    def __init__(self, step, fingerprint: dict):
        self.inputs = step
        self.num_steps = 1
        self.fingerprint = fingerprint

    def step(self, i: int):
        return self.inputs, 0

    def longest(self) -> tuple[int, str]:
        return int(max(self.inputs.batch.lengths)), "the synthetic step"

    def describe(self) -> str:
        b = self.inputs.batch
        f = self.fingerprint
        return (
            f"batch: preset={f['preset']} seed={f['seed']} trajectories={b.num_trajectories} "
            f"S={b.semantic_tokens:,} C={b.compact_tokens:,} S/C={b.compression:.2f}"
        )

    @staticmethod
    def same(a: dict, b: dict) -> bool:
        return a == b


# ---------------------------------------------------------------------------------- sinks
def _finite(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class _Progress:
    """A tqdm bar on a terminal, or plain lines (logs): the first step, then every ``every``
    seconds, and the last."""

    def __init__(self, mode: str, total: int, initial: int, every: float, stream, enabled: bool):
        tty = bool(getattr(stream, "isatty", lambda: False)())
        if mode == "auto":
            mode = "bar" if tty else "lines"
        self.mode = mode if enabled and total > initial else "off"
        self.total, self.initial, self.every, self.stream = total, initial, every, stream
        self.start = time.perf_counter()
        self.last = None
        self.bar = None
        if self.mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, initial=initial, unit="step", desc=PROG, file=stream, dynamic_ncols=True
            )

    def update(self, done: int, rec: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{rec['loss']:.4g}", refresh=False)
            self.bar.update(1)
            return
        if self.mode != "lines":
            return
        now = time.perf_counter()
        if self.last is not None and done < self.total and now - self.last < self.every:
            return
        self.last = now
        elapsed = now - self.start
        rate = elapsed / max(1, done - self.initial)
        eta = rate * (self.total - done)
        pct = 100.0 * done / max(1, self.total)
        print(
            f"{PROG}: step {done}/{self.total} ({pct:.0f}%) elapsed {_hms(elapsed)} eta {_hms(eta)} "
            f"({rate:.2f} s/step) loss={rec['loss']:.6g}",
            file=self.stream,
            flush=True,
        )

    def write(self, line: str, out) -> None:
        if self.bar is not None:
            self.bar.write(line, file=out)
        else:
            print(line, file=out, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _hms(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _line(rec: dict, total: int) -> str:
    gn = rec["grad_norm"]
    parts = [
        f"step {rec['step']}/{total}",
        f"loss={rec['loss']:.6f}",
        f"policy_loss={rec['policy_loss']:.6f}",
        f"router_loss={rec['router_loss']:.4g}",
        f"grad_norm={gn:.4g}" if gn is not None else "grad_norm=nan",
        f"lr={rec['lr']:.3g}",
        f"tokens={rec['semantic_tokens']:,}",
        f"rows={rec['rows']:,}",
        f"compression={rec['compression']:.2f}x",
        f"microbatches={rec['microbatches']}",
    ]
    if "kda_calls" in rec:
        parts.append(f"calls={rec['kda_calls']}")
    parts += [
        f"replay={rec['replay_tokens']:,}",
        f"plan={rec['plan_seconds'] * 1e3:.1f}ms",
        f"fbg={rec['fbg_seconds']:.2f}s",
        f"step_time={rec['step_seconds']:.2f}s",
    ]
    if rec["skipped"]:
        parts.append(f"SKIPPED ({rec['skip_reason']})")
    return " ".join(parts)


def _trim_metrics(path: Path, upto: int) -> None:
    """Keep the records of steps <= ``upto`` (a resumed run rewrites what follows)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if int(json.loads(line)["step"]) <= upto:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    path.write_text("".join(s + "\n" for s in keep))


# ---------------------------------------------------------------------------------- settings
def _device(name, world: int, local_rank: int) -> torch.device:
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise _usage(f"--device: not a device: {name!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise _usage(f"--device: cpu or cuda[:i], got {name!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise _usage(f"--device: {name} requested but CUDA is not available here")
        if world > 1:
            dev = torch.device("cuda", local_rank)
        if (dev.index or 0) >= torch.cuda.device_count():
            raise _usage(f"--device: {dev} does not exist ({torch.cuda.device_count()} CUDA devices)")
    return dev


def _dims(args, world: int):
    from harts_runtime.parallel.dims import ParallelDims

    if world == 1:
        for dest in ("tp", "ep", "dp_replicate"):
            v = getattr(args, dest)
            if v > 1:
                flag = _DIM_FLAGS[dest]
                raise _usage(
                    f"{flag} {v}: needs several processes: run under torchrun --nproc-per-node N -m "
                    "harts_runtime.cli ... (this is one process)"
                )
        if args.sp:
            raise _usage("--sp: needs --tp > 1 (under torchrun)")
        for dest in ("param_dtype", "reduce_dtype", "cpu_offload"):
            if getattr(args, dest):
                flag = "--" + dest.replace("_", "-")
                raise _usage(
                    f"{flag}: applies to the sharded model under torchrun (FSDP2); one process trains in --dtype"
                )
        return None
    if world % (args.tp * args.dp_replicate):
        raise _usage(
            f"--tp {args.tp} x --dp-replicate {args.dp_replicate} = {args.tp * args.dp_replicate} "
            f"does not divide the world size {world}"
        )
    try:
        return ParallelDims.from_world(
            world, tp=args.tp, ep=args.ep, dp_replicate=args.dp_replicate, sequence_parallel=args.sp
        )
    except InvalidInputError as e:
        flag = _DIM_FLAGS.get(e.field, e.field)
        raise _usage(f"{flag}: {str(e)[len(e.field) + 2 :]} (world size {world})") from None


def _model_config(args, cpu: bool):
    if args.model is not None:
        if args.flavor is not None or args.layers is not None:
            raise _usage("--model: a checkpoint folder replaces --flavor and --layers; give one")
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            raise _usage(f"--model: {args.model!r} is not a checkpoint folder (no config.json)")
        from harts_runtime.hf import _read_config

        return _read_config(args.model, args.dtype, {})[3], str(args.model)
    from harts_runtime.models import model_config

    flavor = args.flavor or ("debug" if cpu else "ling-tiny")
    over = {"dtype": args.dtype} if args.dtype else {}
    return model_config(flavor, args.layers, **over), flavor


def _loss_config(args):
    from harts_runtime.step_inputs import default_loss_config

    over = {k: getattr(args, k) for k in LOSS_FLAGS if getattr(args, k) is not None}
    return dataclasses.replace(default_loss_config(args.objective), **over)


def _data(args, vocab: int, cpu: bool, loss_cfg):
    if args.data is not None:
        from harts_runtime.rollout_files import RolloutFileError, read_rollout_file

        try:
            rf = read_rollout_file(args.data, vocab)
        except InvalidInputError as e:
            if isinstance(e, RolloutFileError) or e.field != "data":
                raise
            raise _usage(f"--{e}") from None
        if loss_cfg.kl_coef and not rf.has_ref_logprobs:
            raise _rf_error(
                rf.path,
                f"the loss has a KL penalty (kl_coef={loss_cfg.kl_coef:g}"
                + (", grpo's default" if args.kl_coef is None else "")
                + ") and needs ref_logprobs in every row; add them or pass --kl-coef 0",
            )
        return _FileData(rf)
    from harts_runtime.demo import synthetic_step

    max_len = args.max_len if args.max_len is not None else (1024 if cpu else None)
    step = synthetic_step(args.preset, args.seed, vocab, max_len, args.objective)
    step.loss_config = loss_cfg
    fp = {"kind": "synthetic", "preset": args.preset, "seed": args.seed, "max_len": max_len, "vocab": vocab}
    return _SyntheticData(step, fp)


def _rf_error(path: str, message: str):
    from harts_runtime.rollout_files import RolloutFileError

    return RolloutFileError(path, None, "ref_logprobs", message)


# ---------------------------------------------------------------------------------- the run
def train(args, given: set, saved: dict | None, out=None, err=None) -> int:
    """Run ``harts-train`` with resolved settings (:func:`harts_runtime.cli.resolve_settings`);
    returns the exit code. Raises :class:`~harts_runtime.errors.InvalidInputError` /
    ``UsageError`` for bad input (the CLI prints them as one line)."""
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
    device = _device(args.device, world, local_rank)
    cpu = device.type == "cpu"
    from harts_runtime.ops.keep import checked_keep

    keep = tuple(k for k in (args.keep or "").split(",") if k)
    if keep and not args.recompute:
        raise _usage("--keep: needs --recompute (it names what recomputation keeps)")
    try:
        checked_keep(keep)
    except InvalidInputError as e:
        raise _usage(f"--{e}") from None
    dims = _dims(args, world)
    model_cfg, model_name = _model_config(args, cpu)
    if args.model is None:  # a flavor: refuse what the device cannot hold before any data or model
        _check_training_fits(model_cfg, model_name, device, world)
    loss_cfg = _loss_config(args)
    for path_flag in ("save", "export", "tensorboard"):
        p = getattr(args, path_flag)
        if p is not None and os.path.exists(p) and not os.path.isdir(p):
            raise _usage(f"--{path_flag}: {p!r} exists and is not a folder")
    if args.metrics is not None and os.path.isdir(args.metrics):
        raise _usage(f"--metrics: {args.metrics!r} is a folder; give a file name")
    if args.tensorboard is not None and importlib.util.find_spec("tensorboard") is None:
        raise _usage(
            "--tensorboard: tensorboard is not installed: pip install 'harts[train]' (or pip install tensorboard)"
        )
    data = _data(args, model_cfg.vocab_size, cpu, loss_cfg)

    same = saved is not None and data.same(saved["data"], data.fingerprint)
    done = int(saved["steps_done"]) if saved else 0
    position = int(saved["data"].get("position", done)) if same else 0
    if "steps" in given and args.steps is not None:
        steps = args.steps
    elif saved is not None and same:
        steps = int(saved["args"].get("steps", done))
    elif saved is not None:
        steps = done + data.num_steps
    elif isinstance(data, _FileData):
        steps = data.num_steps
    else:
        steps = 3
    total_steps = args.total_steps if args.total_steps is not None else max(1, steps)
    lr = args.lr if args.lr is not None else (1e-6 if args.model else 1e-3)
    capacity = args.capacity or (4096 if cpu else 65_536)
    if args.microbatch_cost > capacity:
        raise _usage(f"--microbatch-cost: must be <= T = {capacity} (--capacity), got {args.microbatch_cost}")
    longest, where = data.longest()
    if longest > capacity:  # the planner would refuse it at the first step, after the model is built
        raise _usage(
            f"--capacity: T = {capacity} rows per microbatch is below the longest trajectory "
            f"({longest} tokens, {where}); a trajectory is never split between microbatches"
        )
    from harts_runtime.engine import EngineConfig, HartsEngine

    ecfg = EngineConfig(
        lr=lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        lr_schedule=args.lr_schedule,
        total_steps=total_steps,
        min_lr_ratio=args.min_lr_ratio,
        max_grad_norm=args.max_grad_norm or None,
        capacity=capacity,
        microbatch_cost=args.microbatch_cost,
        mode=args.mode,
        objective=args.objective,
        loss_config=loss_cfg,
        recompute=args.recompute,
        keep=keep,
        param_dtype=args.param_dtype,
        reduce_dtype=args.reduce_dtype,
        cpu_offload=args.cpu_offload,
    )
    record_args = {k: v for k, v in vars(args).items() if k not in ("config", "resume")}
    record_args.update(steps=steps, total_steps=total_steps, lr=lr, capacity=capacity)
    for k in (
        "data",
        "model",
        "save",
        "export",
        "metrics",
        "tensorboard",
    ):  # absolute: resumable from elsewhere
        if record_args.get(k) is not None:
            record_args[k] = os.path.abspath(record_args[k])
    if args.model is None:
        record_args["flavor"] = model_name
    if isinstance(data, _SyntheticData):
        record_args["max_len"] = data.fingerprint["max_len"]

    note(data.describe())

    # ---- processes, model, engine
    created = False
    if world > 1 and not pre_init:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        created = True
    try:
        mesh = dims.build_mesh(device.type) if dims is not None else None
        torch.manual_seed(args.seed)
        if args.model is not None:
            from harts_runtime.hf import load_pretrained

            # as HartsEngine.from_pretrained: with a mesh each rank reads its shards' slices
            par = ecfg.parallelize_options() if mesh is not None else None
            model = load_pretrained(args.model, dtype=args.dtype, device=device, mesh=mesh, parallelize=par)
        else:
            from harts_runtime.models import HybridModel

            model = HybridModel(model_cfg, device=device)
        frozen = _freeze_family_constants(model) if args.model is not None or args.export is not None else []
        engine = HartsEngine(model, ecfg, mesh=mesh)
        cfg = engine.model.config
        params = sum(p.numel() for p in engine.model.parameters())
        where = f" world={world} ({', '.join(f'{k}={v}' for k, v in _dims_text(dims))})" if dims else ""
        note(
            f"model: {model_name} layers={cfg.num_layers} params={params:,} dtype={cfg.dtype} device={device}{where}"
            + (f"; {len(frozen)} parameters the transformers family lacks stay frozen" if frozen else "")
        )
        if saved is not None:
            engine.load(saved["folder"])
            how = "same data" if same else "a different data source: starting at its first step"
            note(
                f"resumed from {saved['folder']}: step {done}, optimizer step {engine.step}, data position {position} ({how})"
            )
        return _loop(engine, data, args, ecfg, steps, done, position, record_args, world, lead, out, err)
    finally:
        if created:
            dist.destroy_process_group()


def _freeze_family_constants(model) -> list[str]:
    """Freeze the parameters the model's transformers family does not have (their values are the
    family's constants, e.g. Kimi-Linear's KDA output-gate bias, zero): trained, they would leave
    the architecture and ``save_pretrained`` would refuse the model. Raises what the family cannot
    express at all (``--export`` of a flavor with a GQA layer), before any step. Returns the names."""
    from harts_runtime.hf import _save_setup

    _, adapter = _save_setup(model, None)
    fixed = set(adapter.extra_ours())
    names = [n for n, p in model.named_parameters() if n in fixed and p.requires_grad]
    for n, p in model.named_parameters():
        if n in names:
            p.requires_grad_(False)
    return names


def _dims_text(dims):
    out = [("dp_shard", dims.dp_shard)]
    for k in ("dp_replicate", "tp", "ep"):
        if getattr(dims, k) > 1:
            out.append((k, getattr(dims, k)))
    if dims.sequence_parallel:
        out.append(("sp", True))
    return out


def _loop(engine, data, args, ecfg, steps, done, position, record_args, world, lead, out, err) -> int:
    metrics_file = writer = None
    if lead and args.metrics is not None:
        mpath = Path(args.metrics)
        mpath.parent.mkdir(parents=True, exist_ok=True)
        if done:
            _trim_metrics(mpath, done)
        metrics_file = open(mpath, "a" if done else "w")  # noqa: SIM115 - closed in finally
    if lead and args.tensorboard is not None:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(args.tensorboard, purge_step=done + 1 if done else None)
    progress = _Progress(args.progress, steps, done, args.progress_every, err, enabled=lead)
    last_saved = done if args.resume else None

    def save(k: int) -> None:
        nonlocal last_saved
        folder = step_folder(args.save, k)
        if lead:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / STATE_NAME).unlink(missing_ok=True)  # complete again only once trainer.json is back
        if dist.is_initialized():
            dist.barrier()
        engine.save(folder)
        if lead:
            state = {
                "steps_done": k,
                "engine_step": engine.step,
                "data": dict(data.fingerprint, position=position),
                "args": record_args,
                "world_size": world,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            write_trainer_state(folder, state)
        if dist.is_initialized():
            dist.barrier()
        last_saved = k
        if lead:
            print(f"saved {folder}", file=err, flush=True)

    try:
        if done >= steps and lead:
            print(
                f"{PROG}: nothing to train: the run is at step {done} and --steps is {steps} "
                "(a total; give a larger --steps to go on)",
                file=err,
                flush=True,
            )
        for k in range(done, steps):
            batch, key = data.step(position % data.num_steps)
            position += 1
            t0 = time.perf_counter()
            res = engine.forward_backward(batch)
            rep = engine.optimizer_step()
            dt = time.perf_counter() - t0
            rec = _record(k + 1, key, res, rep, dt)
            if lead:
                if metrics_file is not None:
                    metrics_file.write(json.dumps({n: _finite(v) for n, v in rec.items()}) + "\n")
                    metrics_file.flush()
                if writer is not None:
                    for n, v in rec.items():
                        if isinstance(v, (int, float)) and not isinstance(v, bool) and n != "step":
                            writer.add_scalar(f"train/{n}", v, k + 1)
                line = json.dumps({n: _finite(v) for n, v in rec.items()}) if args.json else _line(rec, steps)
                progress.write(line, out)
                progress.update(k + 1, rec)
            if args.save is not None and args.save_every and (k + 1) % args.save_every == 0:
                save(k + 1)
        if args.save is not None and steps > done and last_saved != steps:
            save(steps)
        if args.export is not None:
            from harts_runtime.hf import save_pretrained

            save_pretrained(engine.model, args.export)
            if lead:
                print(f"exported {args.export}", file=err, flush=True)
    finally:
        progress.close()
        if metrics_file is not None:
            metrics_file.close()
        if writer is not None:
            writer.close()
    return 0


def _check_training_fits(cfg, name: str, device, world: int) -> None:
    """One-line error, before the model is built, when the flavor's weights, gradients and AdamW
    state (4x the parameter bytes; split over ``world`` ranks) exceed the device's available memory
    (``--flavor ling-tiny`` on a CPU needs about 125 GB: it was OOM-killed with no word)."""
    from harts_runtime.hf import _available_bytes, _human, model_bytes

    needed = 4 * model_bytes(cfg) / max(1, world)
    available, where = _available_bytes(device)
    if available is not None and needed > available:
        raise InvalidInputError(
            "flavor",
            f"{name} with {cfg.num_layers} layers needs about {_human(needed)} for its weights, gradients "
            f"and AdamW state{' per rank' if world > 1 else ''}, more than the {_human(available)} "
            f"available on {where}; take fewer --layers, a smaller flavor, or more ranks",
        )


def _record(step: int, key, res, rep, dt: float) -> dict:
    m = res.metrics
    rec = {
        "step": step,
        "data_step": key,
        "loss": float(res.loss),
        "policy_loss": float(m["policy_loss"]),
        "router_loss": float(m["router_loss"]),
    }
    for k, v in m.items():  # the loss function's own metrics: step sums of their per-microbatch shares
        if k.startswith("loss_fn/"):
            rec[k] = float(v)
    rec.update(
        grad_norm=float(rep.grad_norm),
        lr=float(rep.lr),
        skipped=bool(rep.skipped),
        semantic_tokens=int(m["semantic_tokens"]),
        rows=int(m["rows"]),
        compression=float(m["compression"]),
        microbatches=int(m["microbatches"]),
        replay_tokens=int(m["replay_tokens"]),
    )
    if "kda_calls" in m:
        rec["kda_calls"] = int(m["kda_calls"])
    rec.update(
        plan_seconds=float(m["plan_seconds"]),
        fbg_seconds=float(m["fbg_seconds"]),
        step_seconds=dt,
        tokens_per_second=m["semantic_tokens"] / dt if dt > 0 else None,
    )
    if rep.skipped:
        rec["skip_reason"] = rep.reason
    return rec
