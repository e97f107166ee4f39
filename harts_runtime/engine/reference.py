"""The reference policy of a KL term (:class:`ReferencePolicy`): a frozen copy of an engine's model,
scored through the engine's own step path.

``KL(current || reference)`` needs the reference policy's log-prob of every target
(:attr:`~harts_runtime.rollouts.Rollouts.ref_logprobs`). :class:`ReferencePolicy` holds a copy of
the engine's model taken when it is made (for an RL run, the initial weights), with every parameter
frozen (no gradients, no optimizer state), and scores rollouts with
:meth:`~harts_runtime.engine.HartsEngine.forward_backward` (``forward_only``: the same planner, the
same compact microbatches, the same mapped log-probs, eval mode, no graph) with the copy swapped in
for the call. So at the moment it is made its log-probs are the engine's own, bit for bit, and a
prefix that a rollout tree shares is executed once for the reference too.

Memory: one more copy of the model's parameters and buffers in their dtype (e.g. 2 bytes a
parameter in bfloat16); none of the optimizer state or gradients. One process: a sharded model's
copy would have to be parallelized and read alike on every rank (not done here: refused).
"""

from __future__ import annotations

import copy

import torch

from harts_runtime.errors import InvalidInputError

__all__ = ["ReferencePolicy"]


class ReferencePolicy:
    """A frozen copy of ``engine``'s model as it is now (module docstring), or of ``model``: a
    model of the same configuration and parallel layout (none) to freeze instead, e.g. the initial
    weights rebuilt when a run resumes (its engine then holds trained weights); it is used as it
    is, not copied.

    ``logprobs(rollouts)``: the reference log-probs of every target of ``rollouts`` (a
    :class:`~harts_runtime.rollouts.Rollouts` or a :class:`~harts_runtime.step_inputs.StepInputs`),
    float32 ``[P]`` in the caller's per-target order; ``attach(rollouts)`` stores them as the
    rollouts' ``ref_logprobs``."""

    def __init__(self, engine, model=None):
        if engine.mesh is not None:
            raise InvalidInputError(
                "reference", "a reference policy copies the model in one process only (no mesh)"
            )
        if model is not None and (
            model is engine.model
            or getattr(model, "config", None) != engine.model.config
            or getattr(model, "_harts_parallel", None) is not None
        ):
            raise InvalidInputError(
                "model", "a reference model is another model of the engine's configuration, in one process"
            )
        self.engine = engine
        self.model = copy.deepcopy(engine.model) if model is None else model
        for p in self.model.parameters():
            p.requires_grad_(False)
            p.grad = None
        self.model.eval()
        self.version = engine.step
        """The engine's optimizer steps when the copy was taken."""

    @property
    def num_bytes(self) -> int:
        """What the copy holds: its parameters' and buffers' bytes."""
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.no_grad()
    def logprobs(self, rollouts) -> torch.Tensor:
        """The reference log-probs of every target of ``rollouts`` (class docstring)."""
        engine, own = self.engine, self.engine.model
        engine.model = self.model
        try:
            return engine.forward_backward(rollouts, forward_only=True).logprobs
        finally:
            engine.model = own

    def attach(self, rollouts):
        """``rollouts`` with ``ref_logprobs`` set to :meth:`logprobs` (in place; returned)."""
        lp = self.logprobs(rollouts)
        rollouts.ref_logprobs = lp.to(torch.float32)
        return rollouts
