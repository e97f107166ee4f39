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
import time

from harts_runtime.trainer.job import run_job
from harts_runtime.trainer.metrics import MetricsWriter, finite
from harts_runtime.trainer.progress import PROG, Progress, step_line
from harts_runtime.trainer_state import STATE_NAME, prune_checkpoints, step_folder, trainer_state_text

__all__ = ["finite", "run_loop", "step_record"]


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
    for k in sorted(m):  # the objective's statistics over the step (harts_runtime.loss.statistics)
        if k.startswith("objective/"):
            rec[k] = float(m[k])
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
    """Train from step ``done`` to ``steps`` (data position ``position``) through the job loop
    (:func:`harts_runtime.trainer.job.run_job`); returns 0. ``record_args``: the settings saved in
    ``trainer.json``; ``lead``: this is rank 0."""
    writer = None
    if lead and (args.metrics is not None or args.tensorboard is not None):
        writer = MetricsWriter(args.metrics, done, tensorboard=args.tensorboard, prefix="train")
    progress = Progress(args.progress, steps, done, args.progress_every, err, enabled=lead)
    data.position = position

    def save(k: int) -> None:
        folder = step_folder(args.save, k)
        state = {
            "steps_done": k,
            "engine_step": engine.step,
            "data": dict(data.fingerprint, position=data.position),
            "args": record_args,
            "world_size": world,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        # trainer.json goes into the staged folder: the checkpoint appears whole, with it, or not at all
        engine.save(folder, files={STATE_NAME: trainer_state_text(state)})
        if lead:
            print(f"saved {folder}", file=err, flush=True)
            for old in prune_checkpoints(args.save, STATE_NAME, getattr(args, "keep_last", 0) or 0):
                print(f"removed {old} (--keep-last {args.keep_last})", file=err, flush=True)

    def show(rec: dict) -> None:
        if lead:
            line = json.dumps({n: finite(v) for n, v in rec.items()}) if args.json else step_line(rec, steps)
            progress.write(line, out)
            progress.update(rec["step"], rec)

    try:
        if done >= steps and lead:
            print(
                f"{PROG}: nothing to train: the run is at step {done} and --steps is {steps} "
                "(a total; give a larger --steps to go on)",
                file=err,
                flush=True,
            )
        run_job(
            engine,
            data,
            done=done,
            steps=steps,
            save=save if args.save is not None else None,
            save_every=args.save_every,
            writer=writer,
            show=show,
            sigterm=world == 1,
        )
        if args.export is not None:
            from harts_runtime.trainer.export import export_hf

            export_hf(engine, args.export, args.model if lead else None)
            if lead:
                print(f"exported {args.export}", file=err, flush=True)
    finally:
        progress.close()
        if writer is not None:
            writer.close()
    return 0
