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

from harts_runtime.rl.config import RLConfig
from harts_runtime.rl.environment import Task
from harts_runtime.rl.loop import RLRun
from harts_runtime.rl.rollout_engine import Frontier, RolloutEngine, SyncError, check_sync

__all__ = ["Frontier", "RLConfig", "RLRun", "RolloutEngine", "SyncError", "Task", "check_sync"]
