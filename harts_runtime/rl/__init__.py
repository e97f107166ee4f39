"""Agentic RL on the engine (``harts-rl``): rollout trees to new weights. What is RL's own; the
job loop, its metrics and resume are :mod:`harts_runtime.trainer` and
:mod:`harts_runtime.trainer_state`, the command :mod:`harts_runtime.cli.rl`.

One job per module:

==========================================  =========================================================
:mod:`harts_runtime.rl.rollout_engine`      the rollout engine's interface, the weight-sync check
:mod:`harts_runtime.rl.transformers_backend` the transformers rollout engine (in-memory weight sync)
:mod:`harts_runtime.rl.environment`         the task / environment interface (multi-turn episodes)
:mod:`harts_runtime.rl.tasks`               built-in tasks: ``token-set``, ``calculator``
:mod:`harts_runtime.rl.sampler`             the tree sampler (forks ``k`` ways at configured turns)
:mod:`harts_runtime.rl.advantages`          GRPO and tree-aware advantage estimators
:mod:`harts_runtime.rl.config`              a run's settings (:class:`RLConfig`)
:mod:`harts_runtime.rl.source`              the online data source of the job loop (:class:`OnlineSource`)
:mod:`harts_runtime.rl.source_state`        the RL state a checkpoint carries (``rl.json``) and its reader
:mod:`harts_runtime.rl.async_source`        the asynchronous source (:class:`AsyncSource`, ``max_staleness``)
:mod:`harts_runtime.rl.async_versions`      per-token weight versions: the switch turn, the versioned frontier
:mod:`harts_runtime.rl.run`                 ``harts-rl``'s job (:class:`RLRun`: the source picked, run folder
                                            and resume by :class:`harts_runtime.trainer.run_folder.JobRun`)
:mod:`harts_runtime.rl.evaluate`            the greedy policy's reward on held-out prompts (``eval_every``)
==========================================  =========================================================
"""

import importlib
from typing import TYPE_CHECKING

from harts_runtime.rl.config import RLConfig
from harts_runtime.rl.environment import Task

if TYPE_CHECKING:  # the lazy names below, for type checkers
    from harts_runtime.rl.async_source import AsyncSource
    from harts_runtime.rl.rollout_engine import Frontier, RolloutEngine, SyncError, check_sync
    from harts_runtime.rl.run import RLRun, make_source
    from harts_runtime.rl.source import OnlineSource

__all__ = [
    "AsyncSource",
    "Frontier",
    "OnlineSource",
    "RLConfig",
    "RLRun",
    "RolloutEngine",
    "SyncError",
    "Task",
    "check_sync",
    "make_source",
]

_LAZY = {
    "OnlineSource": "harts_runtime.rl.source",
    "RLRun": "harts_runtime.rl.run",
    "make_source": "harts_runtime.rl.run",
    "AsyncSource": "harts_runtime.rl.async_source",
    "Frontier": "harts_runtime.rl.rollout_engine",
    "RolloutEngine": "harts_runtime.rl.rollout_engine",
    "SyncError": "harts_runtime.rl.rollout_engine",
    "check_sync": "harts_runtime.rl.rollout_engine",
}
"""Names imported on first use: they need torch, which ``harts-rl`` imports only once its settings
have passed their checks (a refused setting answers without it)."""


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
