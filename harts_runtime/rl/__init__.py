"""Agentic RL on the engine (``harts-rl``): rollout trees to new weights.

One job per module:

==========================================  =========================================================
:mod:`harts_runtime.rl.rollout_engine`      the rollout engine's interface, the weight-sync check
:mod:`harts_runtime.rl.transformers_backend` the transformers rollout engine (in-memory weight sync)
:mod:`harts_runtime.rl.environment`         the task / environment interface (multi-turn episodes)
:mod:`harts_runtime.rl.tasks`               built-in tasks: ``token-set``, ``calculator``
:mod:`harts_runtime.rl.sampler`             the tree sampler (forks ``k`` ways at configured turns)
:mod:`harts_runtime.rl.advantages`          GRPO and tree-aware advantage estimators
:mod:`harts_runtime.rl.config`              a run's settings (:class:`RLConfig`)
:mod:`harts_runtime.rl.metrics`             ``metrics.jsonl``, TensorBoard, the reward curve
:mod:`harts_runtime.rl.loop`                the loop and its checkpoints (:class:`RLRun`)
:mod:`harts_runtime.rl.cli`                 the ``harts-rl`` command
==========================================  =========================================================
"""

import importlib

from harts_runtime.rl.config import RLConfig
from harts_runtime.rl.environment import Task

__all__ = ["Frontier", "RLConfig", "RLRun", "RolloutEngine", "SyncError", "Task", "check_sync"]

_LAZY = {
    "RLRun": "harts_runtime.rl.loop",
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
