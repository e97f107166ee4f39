"""The job loop, once for every command (:func:`run_job`): each step the data source's next batch
(``source.next_step(engine)``), :meth:`~harts_runtime.engine.HartsEngine.forward_backward` and
:meth:`~harts_runtime.engine.HartsEngine.optimizer_step`, the source's ``after_step`` (an online
source's weight sync and its check), the step's record (``source.record``) to the metrics writer and
the display, and the save cadence (every ``save_every`` steps and at the end).

A data source is any object with

* ``next_step(engine)``: the next step's batch (:class:`~harts_runtime.step_inputs.StepInputs` or
  :class:`~harts_runtime.rollouts.Rollouts`, what ``forward_backward`` takes);
* ``record(step, result, report, seconds)``: the step's record (a dict with ``step``), from the
  engine's output, the optimizer report and the seconds of its parts (``data``: ``next_step``,
  ``train``: the engine step, ``after``: ``after_step``, ``step``: all);
* optionally ``after_step(engine, result, report)``, and ``progress``: a callback
  ``progress(done, total)`` after each microbatch;
* optionally ``updates(batch)``: the batch as the list of batches each trained by one
  ``forward_backward`` and one ``optimizer_step`` in turn (an online source's PPO epochs and
  mini-batches; an empty list skips the step's update, e.g. when group filtering left nothing).
  Such a source's ``record`` receives the lists of results and reports, one per update (``after_step``
  runs once, after the last update, when there was one).

The sources: a rollout file's steps and the synthetic step (:mod:`harts_runtime.trainer.data`,
``harts-train``) and the online RL source (:class:`harts_runtime.rl.source.OnlineSource`,
``harts-rl``).

A SIGTERM (a scheduler preempting the job) lets the step in flight finish, saves it (when the job
saves) and raises :class:`Stopped`, which the commands report as one line, exit code 130 (in one
process: ranks that receive it at different steps would not meet in the collective save).
"""

from __future__ import annotations

import signal
import threading
import time

__all__ = ["Stopped", "run_job", "train_one"]


class Stopped(KeyboardInterrupt):
    """The job stopped on SIGTERM after a whole step (saved when the job saves)."""


def train_one(engine, source, step: int) -> dict:
    """One step of ``source`` on ``engine``; returns its record (``step``: its 1-based number)."""
    t0 = time.perf_counter()
    batch = source.next_step(engine)
    t1 = time.perf_counter()
    progress = getattr(source, "progress", None)  # the microbatches' progress (done, total), if shown
    split = getattr(source, "updates", None)
    results, reports = [], []
    for b in [batch] if split is None else split(batch):
        results.append(
            engine.forward_backward(b) if progress is None else engine.forward_backward(b, progress=progress)
        )
        reports.append(engine.optimizer_step())
    t2 = time.perf_counter()
    after = getattr(source, "after_step", None)
    if after is not None and results:
        after(engine, results[-1], reports[-1])
    t3 = time.perf_counter()
    seconds = {"data": t1 - t0, "train": t2 - t1, "after": t3 - t2, "step": t3 - t0}
    if split is not None:
        return source.record(step, results, reports, seconds)
    return source.record(step, results[0], reports[0], seconds)


def run_job(
    engine,
    source,
    *,
    done: int,
    steps: int,
    save=None,
    save_every: int = 0,
    writer=None,
    show=None,
    sigterm=True,
):
    """Train from step ``done`` to ``steps`` (a total); returns the records. ``save(k)`` writes the
    checkpoint after step ``k`` (every ``save_every`` steps, and at the end when steps ran);
    ``writer.write(record)`` (a :class:`~harts_runtime.trainer.metrics.MetricsWriter`) and
    ``show(record)`` see every record. ``sigterm``: stop on SIGTERM after the step in flight (module
    docstring; one process only)."""
    records = []
    last_saved = done
    term = []
    previous = None
    if sigterm and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: term.append(signum))
    try:
        for k in range(done, steps):
            rec = train_one(engine, source, k + 1)
            if writer is not None:
                writer.write(rec)
            if show is not None:
                show(rec)
            records.append(rec)
            if save is not None and (term or save_every and (k + 1) % save_every == 0):
                save(k + 1)
                last_saved = k + 1
            if term:
                saved = f"; saved step {k + 1}" if save is not None else " (no checkpoint: nothing saves)"
                raise Stopped(f"stopped by SIGTERM after step {k + 1}{saved}")
        if save is not None and steps > done and last_saved != steps:
            save(steps)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return records
