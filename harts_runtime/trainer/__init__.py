"""The trainer behind ``harts-train`` (:func:`train`) and the job loop of both commands
(:func:`harts_runtime.trainer.job.run_job`): a loop of
:class:`~harts_runtime.engine.HartsEngine` steps over a rollout file's steps (or the synthetic
step), with checkpoints, metrics sinks, a progress display and, under ``torchrun``, a device mesh.
The engine is built by :meth:`HartsEngine.build <harts_runtime.engine.HartsEngine.build>`, the one
builder (checkpoint folder or flavor, mesh, slices, the one freezing rule, optimizer).

Step ``k`` (1-based) trains on the data's step ``position % K`` (``K`` steps in the file; the
position advances by one per step and is saved with the checkpoint, so a resumed run continues
where it stopped; a resumed run on a *different* file starts at that file's first step).

One job per module (none imports :mod:`harts_runtime.cli`):

=====================================  =========================================================
:mod:`harts_runtime.trainer.checks`    device, parallel dims, model config, options, loss, output
                                       paths: decided and checked before any model work
:mod:`harts_runtime.trainer.data`      the offline data sources: the rollout file's steps or the
                                       synthetic step
:mod:`harts_runtime.trainer.job`       the one job loop over a data source (both commands)
:mod:`harts_runtime.trainer.metrics`   the metrics file and TensorBoard (both commands)
:mod:`harts_runtime.trainer.progress`  the progress bar / lines and the per-step text line
:mod:`harts_runtime.trainer.loop`      ``harts-train``'s run of the job loop: records, saves, export
:mod:`harts_runtime.trainer.run`       :func:`train`: all of it in order, under torch.distributed
=====================================  =========================================================
"""

from harts_runtime.trainer.run import train

__all__ = ["train"]
