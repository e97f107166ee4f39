"""The step loop of ``harts-train`` (:func:`run_loop`): each step a
:meth:`~harts_runtime.engine.HartsEngine.forward_backward` and an
:meth:`~harts_runtime.engine.HartsEngine.optimizer_step` on the data's next step, its record
(:func:`step_record`) printed, appended to ``--metrics`` and written to ``--tensorboard``, and
checkpoints (``--save DIR``: ``DIR/step-N`` every ``--save-every`` steps and at the end, with its
``trainer.json``, written whole or not at all by :meth:`~harts_runtime.engine.HartsEngine.save`)
and ``--export`` at the end.

Only rank 0 prints and writes metrics and ``trainer.json``; every rank saves and exports its shards
(both are collective). Step ``k`` (1-based) trains on the data's step ``position % K`` (``K`` steps);
the position advances by one per step and is saved with the checkpoint.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from harts_runtime.trainer.progress import PROG, Progress, step_line
from harts_runtime.trainer_state import STATE_NAME, step_folder, trainer_state_text

__all__ = ["finite", "run_loop", "step_record", "trim_metrics"]


def finite(v):
    """``v``, or None for a non-finite float (JSON has no NaN)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def trim_metrics(path: Path, upto: int) -> None:
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


def step_record(step: int, key, res, rep, dt: float) -> dict:
    """The record of step ``step`` (data step ``key``): the engine's output ``res`` and optimizer
    report ``rep``, and the step's wall time ``dt``."""
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
    for k, v in m.items():  # cp_mode's choice: microbatches that ran block i by state passing
        if k.startswith("cp_states/"):
            rec[k] = int(v)
    rec.update(
        plan_seconds=float(m["plan_seconds"]),
        fbg_seconds=float(m["fbg_seconds"]),
        step_seconds=dt,
        tokens_per_second=m["semantic_tokens"] / dt if dt > 0 else None,
    )
    if rep.skipped:
        rec["skip_reason"] = rep.reason
    return rec


def run_loop(engine, data, args, steps, done, position, record_args, world, lead, out, err) -> int:
    """Train from step ``done`` to ``steps`` (data position ``position``); returns 0.
    ``record_args``: the settings saved in ``trainer.json``; ``lead``: this is rank 0."""
    metrics_file = writer = None
    if lead and args.metrics is not None:
        mpath = Path(args.metrics)
        mpath.parent.mkdir(parents=True, exist_ok=True)
        if done:
            trim_metrics(mpath, done)
        metrics_file = open(mpath, "a" if done else "w")  # noqa: SIM115 - closed in finally
    if lead and args.tensorboard is not None:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(args.tensorboard, purge_step=done + 1 if done else None)
    progress = Progress(args.progress, steps, done, args.progress_every, err, enabled=lead)
    last_saved = done if args.resume else None

    def save(k: int) -> None:
        nonlocal last_saved
        folder = step_folder(args.save, k)
        state = {
            "steps_done": k,
            "engine_step": engine.step,
            "data": dict(data.fingerprint, position=position),
            "args": record_args,
            "world_size": world,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        # trainer.json goes into the staged folder: the checkpoint appears whole, with it, or not at all
        engine.save(folder, files={STATE_NAME: trainer_state_text(state)})
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
            rec = step_record(k + 1, key, res, rep, dt)
            if lead:
                if metrics_file is not None:
                    metrics_file.write(json.dumps({n: finite(v) for n, v in rec.items()}) + "\n")
                    metrics_file.flush()
                if writer is not None:
                    for n, v in rec.items():
                        if isinstance(v, (int, float)) and not isinstance(v, bool) and n != "step":
                            writer.add_scalar(f"train/{n}", v, k + 1)
                line = (
                    json.dumps({n: finite(v) for n, v in rec.items()}) if args.json else step_line(rec, steps)
                )
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
