"""The options of a :class:`~harts_runtime.engine.HartsEngine`: :class:`EngineConfig` composes
:class:`~harts_runtime.options.ExecutionOptions` and :class:`~harts_runtime.options.OptimizerOptions`
(each option declared and checked there, once) with the objective."""

from __future__ import annotations

import dataclasses
from typing import Any

from harts_runtime.errors import InvalidInputError
from harts_runtime.loss.objectives import PolicyLossConfig
from harts_runtime.options import ExecutionOptions, OptimizerOptions

__all__ = ["EngineConfig"]


class EngineConfig:
    """What a :class:`HartsEngine` runs: its execution options, its optimizer options and its
    objective. Every option is declared once, in :mod:`harts_runtime.options`; this class composes
    them. Flat keywords are routed to the options class that declares them (``EngineConfig(lr=1e-3,
    capacity=4096)``), with the same checks; reading ``config.lr`` or ``config.capacity`` reads
    through. An unknown keyword raises :class:`InvalidInputError` naming it."""

    __slots__ = ("execution", "optimizer", "objective", "loss_config")

    def __init__(
        self,
        *,
        execution: ExecutionOptions | None = None,
        optimizer: OptimizerOptions | None = None,
        objective: str = "grpo",
        loss_config: PolicyLossConfig | None = None,
        **options,
    ):
        routed: dict[type, dict] = {ExecutionOptions: {}, OptimizerOptions: {}}
        for name, value in options.items():
            owner = _OWNER.get(name)
            if owner is None:
                raise InvalidInputError(
                    name, f"not an engine option; choose from {sorted(_OWNER) + ['objective', 'loss_config']}"
                )
            routed[owner][name] = value
        base = {ExecutionOptions: execution, OptimizerOptions: optimizer}
        for cls, given in routed.items():
            if base[cls] is None:
                base[cls] = cls(**given)
            elif given:
                base[cls] = dataclasses.replace(base[cls], **given)
        self.execution: ExecutionOptions = base[ExecutionOptions]
        self.optimizer: OptimizerOptions = base[OptimizerOptions]
        if objective not in ("grpo", "ppo"):
            raise InvalidInputError("objective", f"choose grpo or ppo, got {objective!r}")
        self.objective = objective
        self.loss_config = loss_config

    def __getattr__(self, name):
        owner = _OWNER.get(name)
        if owner is ExecutionOptions:
            return getattr(object.__getattribute__(self, "execution"), name)
        if owner is OptimizerOptions or name == "lr_factor":
            return getattr(object.__getattribute__(self, "optimizer"), name)
        raise AttributeError(name)

    def __eq__(self, other) -> bool:
        return isinstance(other, EngineConfig) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return (
            f"EngineConfig(execution={self.execution!r}, optimizer={self.optimizer!r}, "
            f"objective={self.objective!r}, loss_config={self.loss_config!r})"
        )

    def replace(self, **changes) -> EngineConfig:
        """A copy with ``changes`` (flat option names, or ``execution`` / ``optimizer`` / ...)."""
        kw = dict(
            execution=self.execution,
            optimizer=self.optimizer,
            objective=self.objective,
            loss_config=self.loss_config,
        )
        kw.update({k: changes.pop(k) for k in list(changes) if k in kw})
        return EngineConfig(**kw, **changes)

    def parallelize_options(self) -> dict:
        """The ``parallelize`` keywords the execution options ask for."""
        return self.execution.parallelize_options()

    def to_dict(self) -> dict:
        """A JSON-able record (saved with checkpoints)."""
        out: dict[str, Any] = {"objective": self.objective}
        for part in (self.execution, self.optimizer):
            out.update(
                {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(part).items()}
            )
        return out


_OWNER = {f.name: cls for cls in (ExecutionOptions, OptimizerOptions) for f in dataclasses.fields(cls)}
