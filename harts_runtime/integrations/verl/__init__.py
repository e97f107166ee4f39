"""verl backend ``"harts"``: a verl 0.9.1 ``BaseEngine`` on :class:`harts_runtime.engine.HartsEngine`.

Importing this package registers :class:`VerlHartsEngine` with verl's ``EngineRegistry`` as backend
``"harts"`` (``model_type="language_model"``, ``cuda`` and ``cpu``); a verl run names it in
``actor_rollout_ref.model.external_lib`` and selects :class:`HartsActorConfig` with ``_target_``
(``examples/verl/``).

=================================================  ===============================================
module                                             what
=================================================  ===============================================
:mod:`~harts_runtime.integrations.verl.config`     :class:`HartsEngineConfig` (``actor.harts``:
                                                   verl's engine fields, HARTS's execution options
                                                   and the parallel layout), :class:`HartsActorConfig`
:mod:`~harts_runtime.integrations.verl.data`       the DP all-gather of verl's ``TensorDict`` shares,
                                                   token ids as ``Rollouts``, verl's global loss
                                                   denominators, per-target values as verl's jagged
                                                   log-probs
:mod:`~harts_runtime.integrations.verl.loss`       :class:`VerlLoss` (verl's loss per HARTS
                                                   microbatch, its metrics), :func:`row_entropy`
:mod:`~harts_runtime.integrations.verl.engine`     :class:`VerlHartsEngine`, the registered backend
                                                   (what a step does: its module docstring)
=================================================  ===============================================
"""

from harts_runtime.integrations.verl.config import HartsActorConfig, HartsEngineConfig
from harts_runtime.integrations.verl.data import (
    gather_rows,
    harts_logprobs_to_verl,
    rollouts_of,
    step_denominators,
)
from harts_runtime.integrations.verl.engine import VerlHartsEngine
from harts_runtime.integrations.verl.loss import VerlLoss, row_entropy

__all__ = [
    "HartsActorConfig",
    "HartsEngineConfig",
    "VerlHartsEngine",
    "VerlLoss",
    "gather_rows",
    "harts_logprobs_to_verl",
    "rollouts_of",
    "row_entropy",
    "step_denominators",
]
