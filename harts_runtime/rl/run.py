"""``harts-rl``'s job (:class:`RLRun`): an :class:`~harts_runtime.rl.config.RLConfig`'s data source
and engine, run and resumed in its run folder by :class:`harts_runtime.trainer.run_folder.JobRun`.

The source is chosen here, explicitly (:func:`make_source`): the asynchronous
:class:`~harts_runtime.rl.async_source.AsyncSource` when ``max_staleness > 0``, else the synchronous
:class:`~harts_runtime.rl.source.OnlineSource`. With a KL term (the loss's ``kl_coef > 0``) the
source's reference policy is the engine's weights before any step or checkpoint load: the initial
weights (a resumed run builds its engine from the same model source and seed, then loads the
checkpoint).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.job_config import ONLINE_LOSS, JobConfig, resolve_total_steps
from harts_runtime.rl.async_source import AsyncSource
from harts_runtime.rl.config import RLConfig
from harts_runtime.rl.source import OnlineSource, read_state
from harts_runtime.rl.tasks import make_task, task_identity
from harts_runtime.trainer.run_folder import JobRun
from harts_runtime.trainer_state import RUN_NAME, read_run

__all__ = ["RLRun", "make_source"]


def make_source(config: RLConfig, *, task=None) -> OnlineSource:
    """The data source of ``config``: :class:`AsyncSource` when ``config.max_staleness > 0``, else
    :class:`OnlineSource` (``task``: a task instead of the config's)."""
    cls = AsyncSource if config.max_staleness > 0 else OnlineSource
    return cls(config, task=task)


def _rl_config(rl: dict, path: Path) -> RLConfig:
    try:
        return RLConfig(**rl)
    except (TypeError, InvalidInputError) as e:
        raise InvalidInputError(RUN_NAME, f"{path}: {' '.join(str(e).split())}") from None


def _normalize(record: dict, path: Path) -> dict:
    """A run record with its settings' defaults filled in (an older ``run.json`` lacks newer keys)."""
    return dict(record, rl=_rl_config(dict(record["rl"]), path).to_dict())


def _engine_config(options: dict, steps: int):
    """The engine's config of the run's options; a decaying schedule without ``total_steps`` ends at
    the run's ``steps`` (a resumed run's new total: :func:`harts_runtime.job_config.resolve_total_steps`,
    the rule ``harts-train`` follows)."""
    from harts_runtime.engine import EngineConfig
    from harts_runtime.loss.objectives import PolicyLossConfig

    options = dict(options)
    loss = PolicyLossConfig(**options.pop("loss_config"))
    objective = options.pop("objective")
    total = resolve_total_steps(options.get("total_steps"), steps, options.get("lr_schedule", "constant"))
    if total is not None:
        options["total_steps"] = total
    return EngineConfig(objective=objective, loss_config=loss, **options)


class RLRun(JobRun):
    """One RL run in ``out_dir``: the data source of ``config`` (:func:`make_source`) trained on an engine built
    for it, in its run folder (:class:`~harts_runtime.trainer.run_folder.JobRun`: ``run.json``,
    checkpoints, resume). ``engine_options``: flat :class:`EngineConfig` options (``lr``,
    ``capacity``, ``mode``, ...); the objective is GRPO without a KL term unless ``loss_config``
    (a dict of :class:`PolicyLossConfig` fields) says otherwise. ``task``: a
    :class:`~harts_runtime.rl.environment.Task` instead of the config's; the run records its
    class (:func:`~harts_runtime.rl.tasks.task_identity`), which a resume loads again.
    ``rollout_factory(engine)``: the rollout engine (default: the transformers backend)."""

    def __init__(
        self, config: RLConfig, engine_options: dict, out_dir, *, task=None, rollout_factory=None, log=None
    ):
        from harts_runtime.engine import HartsEngine

        self.config = config
        opts = dict(engine_options)
        opts.setdefault("objective", "grpo")
        opts.setdefault("loss_config", dict(ONLINE_LOSS))
        self.engine_options = opts
        torch.manual_seed(config.seed)
        source = make_source(config, task=task)
        self.task, self.forks, self.sampler = source.task, source.forks, source.sampler
        job = JobConfig(model={"chunk_size": config.chunk_size})
        self.chunk_size = job.resolve(config.device, "online", chunk_size=source.chunk_size).chunk_size
        source.trained_chunk_size = self.chunk_size
        model = config.model if config.model is not None else config.flavor
        layers: dict[str, Any] = {} if config.layers is None else {"num_layers": config.layers}
        engine = HartsEngine.build(
            model,
            _engine_config(opts, config.steps),
            device=config.device,
            chunk_size=self.chunk_size,
            **layers,
        )
        source.attach(engine, rollout_factory)
        source.episodes_dir = Path(out_dir)
        record = {"rl": config.to_dict(), "engine": opts, "task": task_identity(source.task)}
        super().__init__(
            engine,
            source,
            out_dir,
            record,
            steps=config.steps,
            save_every=config.save_every,
            keep_last=config.keep_last,
            normalize=_normalize,
            log=log,
        )
        if config.eval_every:
            from harts_runtime.rl.evaluate import Evaluation

            source.evaluate = Evaluation(config, source)
        self.rollout = source.rollout

    @property
    def last_leaves(self):
        return self.source.last_leaves

    @property
    def last_output(self):
        return self.source.last_output

    def rollouts(self, leaves, old_logprobs=None):
        """The :class:`~harts_runtime.rollouts.Rollouts` of ``leaves`` (:meth:`OnlineSource.rollouts`)."""
        return self.source.rollouts(self.engine, leaves, old_logprobs)

    _read_state = staticmethod(read_state)

    @classmethod
    def resume(  # type: ignore[override]
        cls,
        out_dir,
        *,
        steps: int | None = None,
        task=None,
        rollout_factory=None,
        log=None,
        fallback: bool = False,
    ) -> RLRun:
        """The run of ``out_dir`` at its newest complete checkpoint (``steps``: a new total;
        ``fallback``: skip checkpoints that do not load, :meth:`JobRun.load_latest`). Its task is the
        class ``run.json`` records (a custom class loaded by name, :func:`make_task`); a ``task``
        given instead is used as it is (a note says so where its class differs); a recorded class
        that no longer loads, or loads as another, is refused naming ``task``."""
        record = read_run(out_dir)
        rl = dict(record["rl"])
        if steps is not None:
            rl["steps"] = steps
        config = _rl_config(rl, Path(out_dir) / RUN_NAME)
        recorded = record.get("task", config.task)
        if not isinstance(recorded, str):
            raise InvalidInputError(
                RUN_NAME, f"{Path(out_dir) / RUN_NAME}: task must be a string, got {recorded!r}"
            )
        if task is None:
            try:
                task = make_task(recorded, **config.task_args)
            except InvalidInputError as e:
                raise InvalidInputError(
                    "task", f"the run in {out_dir} trained {recorded!r}, which does not load now ({e})"
                ) from None
            if task_identity(task) != recorded:
                raise InvalidInputError(
                    "task",
                    f"the run in {out_dir} trained {recorded!r}, which loads as {task_identity(task)!r} now",
                )
        elif task_identity(task) != recorded and log is not None:
            log(f"task: the run trained {recorded!r}; resuming with the given {task_identity(task)!r}")
        run = cls(config, record["engine"], out_dir, task=task, rollout_factory=rollout_factory, log=log)
        run.record["task"] = recorded
        run.load_latest(fallback=fallback)
        return run
