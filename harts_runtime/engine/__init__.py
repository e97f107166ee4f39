"""A training engine RL frameworks can call (:class:`HartsEngine`): framework-neutral, one object
that owns the model, its optimizer, LR schedule and gradient clipping, and the planner.

::

    engine = HartsEngine.build("Qwen3.5-...", EngineConfig(lr=1e-6), dims)   # dims optional
    rollouts = Rollouts.from_padded(input_ids, attention_mask, advantages=adv, loss_mask=mask,
                                    old_logprobs=old, vocab_size=engine.vocab_size)
    out = engine.forward_backward(rollouts, loss_fn)   # loss_fn(logprobs, inputs) -> loss
    report = engine.optimizer_step()                   # grad norm; a non-finite step is skipped
    lp = rollouts.to_padded(engine.logprobs(rollouts), attention_mask)
    engine.save("ckpt/step-10"); engine.load("ckpt/step-10")
    for name, tensor in engine.export_weights(): ...   # vLLM / SGLang weight sync

A step is every trajectory of the step on every rank (as a step plan needs): HARTS's ingestion finds
the prefix trees, :func:`harts_planner.plan_step` packs them into microbatches and, with a mesh,
assigns them to DP replicas and slots (no tree is ever split across ranks); each rank runs its
replica's microbatches (:func:`harts_runtime.parallel.run_replica_step`) and the log-probs come back
in the caller's per-target order on every rank. ``loss_fn`` sees the log-probs of one microbatch and
its per-target fields (:mod:`harts_runtime.loss.functions`); it must use step-level denominators
(``inputs.weights``), which makes the sum over microbatches the step loss in any grouping.

The package, one job per module: :mod:`~harts_runtime.engine.config` (:class:`EngineConfig`, the
composition of :mod:`harts_runtime.options`), :mod:`~harts_runtime.engine.engine`
(:class:`HartsEngine`: its inputs, plan and step loop, and its methods' doors to the modules
below), :mod:`~harts_runtime.engine.load` (``build_model``: every source of a job's model built and
parallelized by one path, for :meth:`HartsEngine.build` and the constructor alike;
``load_pretrained``: a checkpoint folder read into a model, sharded over a mesh: parallelized here,
then read by :mod:`harts_runtime.hf`), :mod:`~harts_runtime.engine.planning` (the only planner
calls: the step plan and each microbatch's call plan; the microbatch below never plans),
:mod:`~harts_runtime.engine.trajectory_plan` (the trajectory-wise baseline's plan-like packing),
:mod:`~harts_runtime.engine.metrics` (a step's metrics), :mod:`~harts_runtime.engine.optimizer_step`
(clipping, the optimizer and schedule, the expert-bias update: :class:`StepReport`),
:mod:`~harts_runtime.engine.checkpoint` (save and load: DCP plus each rank's RNG state),
:mod:`~harts_runtime.engine.weights` (the weights a rollout engine loads),
:mod:`~harts_runtime.engine.process_state` (rank, barrier and RNG state of this process) and
:mod:`~harts_runtime.engine.reference` (the frozen reference policy of a KL term:
:class:`ReferencePolicy`).
"""

from harts_runtime.engine.config import EngineConfig
from harts_runtime.engine.engine import EngineOutput, HartsEngine, StepReport
from harts_runtime.engine.planning import microbatch_call_plan
from harts_runtime.engine.reference import ReferencePolicy

__all__ = [
    "EngineConfig",
    "EngineOutput",
    "HartsEngine",
    "ReferencePolicy",
    "StepReport",
    "microbatch_call_plan",
]
