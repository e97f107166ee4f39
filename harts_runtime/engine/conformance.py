"""The runtime's Protocols, held by the engine's concrete types: the type checker proves it here
(pyright, run by ``.ci/lint``, checks this module; nothing in it runs).

* a model's :class:`~harts_runtime.models.hybrid.args.ModelConfig` is a
  :class:`~harts_runtime.layout.rows.RowShape` and the step's
  :class:`~harts_runtime.step_inputs.StepInputs` a :class:`~harts_runtime.layout.rows.StepRows`
  (what the microbatch builders read of them);
* the parallel steps' :class:`~harts_runtime.parallel.tensor.SequenceParallelRows`,
  :class:`~harts_runtime.parallel.context.ContextParallelRows` and
  :class:`~harts_runtime.parallel.expert.ExpertDispatch` are the MoE's
  :class:`~harts_runtime.layers.moe.RowShard` / :class:`~harts_runtime.layers.moe.ExpertDispatchFn`.

A class that stops satisfying one fails ``.ci/lint`` here, naming the missing or mistyped member.
A planner ``CallPlan`` satisfies :class:`~harts_runtime.layout.CallLayoutArrays` at run time only
(``tests/runtime/layout/test_layout_contract.py``): its arrays are read-only descriptors, which pyright by
design does not match against a protocol's attributes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harts_runtime.layers.moe import ExpertDispatchFn, RowShard
    from harts_runtime.layout.rows import RowShape, StepRows
    from harts_runtime.models.hybrid.args import ModelConfig
    from harts_runtime.parallel.context import ContextParallelRows
    from harts_runtime.parallel.expert import ExpertDispatch
    from harts_runtime.parallel.tensor import SequenceParallelRows
    from harts_runtime.step_inputs import StepInputs

    def _model_config(config: ModelConfig) -> RowShape:
        return config

    def _step_inputs(step: StepInputs) -> StepRows:
        return step

    def _sequence_parallel_rows(rows: SequenceParallelRows) -> RowShard:
        return rows

    def _context_parallel_rows(rows: ContextParallelRows) -> RowShard:
        return rows

    def _expert_dispatch(dispatch: ExpertDispatch) -> ExpertDispatchFn:
        return dispatch
