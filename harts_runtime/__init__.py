"""HARTS runtime: compact-layout execution of hybrid-attention models in PyTorch.

Requires the ``runtime`` extra (torch). Nothing in :mod:`harts_planner` imports it. The runtime is
a pipeline of rooms, one per stage:

=================================  ===============================================================
package                            what
=================================  ===============================================================
:mod:`harts_runtime.layout`        plan arrays -> device index tensors (rows, KDA rounds, views,
                                   convolution windows); the planner contract (``CallLayoutArrays``)
:mod:`harts_runtime.modules`       building blocks: norms, short convolution, RoPE, SwiGLU
:mod:`harts_runtime.ops`           the compact-attention op and its backends
:mod:`harts_runtime.layers`        one file per layer (KDA, attention, MLA, MoE, FFN), each called
                                   as ``forward(x, layout)``
:mod:`harts_runtime.models`        model families: ``models/<family>/{args,model}.py``
:mod:`harts_runtime.loss`          mapped log-probs (optional TP group) and GRPO / PPO objectives
:mod:`harts_runtime.parallel`      DP from the step plan, TP / SP, EP, vocabulary parallelism
``step_inputs``, ``train``         the step's inputs (:class:`StepInputs`), the step (:func:`train_step`)
``recompute``, ``errors``          the one recomputation switch, the one error class
``demo``, ``cli``                  :func:`train_demo`, ``harts-train``
``flops``, ``testing``             the FLOP model; test-only trees, decompositions and dense masks
=================================  ===============================================================

The public API below is importable from ``harts_runtime`` itself; module paths inside may move.
"""

from harts_runtime.demo import train_demo
from harts_runtime.errors import ConfigError, InvalidInputError, ParallelConfigError, StepInputsError
from harts_runtime.layout import (
    MODES,
    CallLayoutArrays,
    Microbatch,
    RowLayout,
    compact_layout,
    compact_microbatch,
    pack_trajectories,
    trajectory_layout,
    trajectory_microbatch,
)
from harts_runtime.loss import PolicyLossConfig, mapped_logprobs, policy_loss, targets_from_batch
from harts_runtime.models import FLAVORS, HybridModel, ModelConfig, model_config
from harts_runtime.recompute import apply_recompute, recompute_enabled
from harts_runtime.step_inputs import StepInputs
from harts_runtime.train import (
    StepResult,
    forward_microbatch,
    make_microbatch,
    plan_microbatches,
    run_microbatch,
    step_logprobs,
    train_step,
)

__all__ = [
    "FLAVORS",
    "MODES",
    "CallLayoutArrays",
    "ConfigError",
    "HybridModel",
    "InvalidInputError",
    "Microbatch",
    "ModelConfig",
    "ParallelConfigError",
    "PolicyLossConfig",
    "RowLayout",
    "StepInputs",
    "StepInputsError",
    "StepResult",
    "apply_recompute",
    "compact_layout",
    "compact_microbatch",
    "forward_microbatch",
    "make_microbatch",
    "mapped_logprobs",
    "model_config",
    "pack_trajectories",
    "plan_microbatches",
    "policy_loss",
    "recompute_enabled",
    "run_microbatch",
    "step_logprobs",
    "targets_from_batch",
    "train_demo",
    "train_step",
    "trajectory_layout",
    "trajectory_microbatch",
]
