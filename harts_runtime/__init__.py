"""HARTS runtime: compact-layout execution of hybrid-attention models in PyTorch.

Requires the ``runtime`` extra (torch). Nothing in :mod:`harts_planner` imports it. The runtime is
a pipeline of rooms, one per stage:

=================================  ===============================================================
package                            what
=================================  ===============================================================
:mod:`harts_runtime.layout`        plan arrays -> device index tensors (rows, KDA rounds, views,
                                   convolution windows); the planner contract (``CallLayoutArrays``)
:mod:`harts_runtime.modules`       building blocks: norms, short convolution, RoPE, SwiGLU
:mod:`harts_runtime.ops`           the compact-attention op and its backends, packed-row gathers, kept
                                   regions, the MoE's grouped GEMMs, expert dispatch / combine,
                                   row-weighted SwiGLU
:mod:`harts_runtime.layers`        one file per layer (KDA, attention, MLA, MoE, FFN), each called
                                   as ``forward(x, layout)``
:mod:`harts_runtime.models`        model families: ``models/<family>/{args,model}.py``
:mod:`harts_runtime.loss`          mapped log-probs (optional TP group) and GRPO / PPO objectives
:mod:`harts_runtime.parallel`      DP from the step plan, TP / SP, EP, vocabulary parallelism
``rollouts``                       :class:`Rollouts`: RL frameworks' rollout shapes <-> HARTS's layout
``step_inputs``, ``train``         the step's inputs (:class:`StepInputs`), the step (:func:`train_step`)
``engine``, ``options``            :class:`HartsEngine` (model, optimizer, planner of a training job),
                                   :class:`EngineConfig` and its option dataclasses
``recompute``, ``errors``          the one recomputation switch, the one error class
``hf``                             :func:`load_pretrained` / :func:`save_pretrained`: HF checkpoint
                                   folders (Kimi-Linear, Qwen3-Next, Qwen3.5-MoE text) <-> ``HybridModel``
``demo``, ``cli``                  :func:`model_demo`, :func:`train_demo`, ``harts-train``
``flops``, ``testing``             the FLOP model; test-only trees, decompositions and dense masks
=================================  ===============================================================

The public API (:data:`__all__`) is importable from ``harts_runtime`` itself; module paths inside
may move. Names are loaded on first use, so ``import harts_runtime`` needs neither torch nor the
planner, and a submodule (``harts_runtime.ops.attention``, say) imports only what it needs.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "model_demo": "harts_runtime.demo",
    "train_demo": "harts_runtime.demo",
    "ConfigError": "harts_runtime.errors",
    "InvalidInputError": "harts_runtime.errors",
    "ParallelConfigError": "harts_runtime.errors",
    "StepInputsError": "harts_runtime.errors",
    "EngineConfig": "harts_runtime.engine",
    "EngineOutput": "harts_runtime.engine",
    "HartsEngine": "harts_runtime.engine",
    "StepReport": "harts_runtime.engine",
    "export_weights": "harts_runtime.hf",
    "load_pretrained": "harts_runtime.engine.load",
    "save_pretrained": "harts_runtime.hf",
    "CallLayoutArrays": "harts_runtime.layout",
    "MODES": "harts_runtime.layout",
    "Microbatch": "harts_runtime.layout",
    "RowLayout": "harts_runtime.layout",
    "compact_layout": "harts_runtime.layout",
    "compact_microbatch": "harts_runtime.layout",
    "pack_trajectories": "harts_runtime.layout",
    "trajectory_layout": "harts_runtime.layout",
    "trajectory_microbatch": "harts_runtime.layout",
    "PolicyLossConfig": "harts_runtime.loss",
    "mapped_logprobs": "harts_runtime.loss",
    "policy_loss": "harts_runtime.loss",
    "targets_from_batch": "harts_runtime.loss",
    "FLAVORS": "harts_runtime.models",
    "HybridModel": "harts_runtime.models",
    "ModelConfig": "harts_runtime.models",
    "model_config": "harts_runtime.models",
    "DEFAULT_CAPACITY": "harts_runtime.options",
    "ExecutionOptions": "harts_runtime.options",
    "OptimizerOptions": "harts_runtime.options",
    "apply_recompute": "harts_runtime.recompute",
    "recompute_enabled": "harts_runtime.recompute",
    "Rollouts": "harts_runtime.rollouts",
    "StepInputs": "harts_runtime.step_inputs",
    "StepResult": "harts_runtime.train",
    "forward_microbatch": "harts_runtime.microbatch",
    "make_microbatch": "harts_runtime.microbatch",
    "plan_microbatches": "harts_runtime.train",
    "run_microbatch": "harts_runtime.microbatch",
    "step_logprobs": "harts_runtime.train",
    "train_step": "harts_runtime.train",
}
"""Public name -> the module that defines it."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'harts_runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
