"""The verl configs of the ``harts`` backend: :class:`HartsEngineConfig` (``actor.harts`` /
``ref.harts``) and :class:`HartsActorConfig` (the actor or reference config that carries it).

:class:`HartsEngineConfig` is verl's engine config (``forward_only``, ``seed``, ``dtype``, ...) plus
every field of :class:`harts_runtime.options.ExecutionOptions` but ``param_dtype`` (which verl's own
``dtype`` sets), generated from that class: the same names, defaults and help, flat under ``harts``
(``actor.harts.capacity``) as verl's YAML and omegaconf expect, and checked by ``ExecutionOptions``
itself (errors name the field as ``harts.<field>``). The checked options are
:attr:`HartsEngineConfig.execution`. The parallel degrees (``tp``, ``cp``, ``ep``, ``dp_replicate``,
``sequence_parallel``) are the settings tree's ``parallel`` group
(:func:`harts_runtime.job_config.group_settings`, declared by ``ParallelDims``), generated the same
way. The model's settings (``model_dtype``: the tree's ``dtype``, named apart from verl's own
``dtype``; ``chunk_size``) are the tree's ``model`` group's too: their kind, help and checks from
it, their defaults the backend's (:data:`_MODEL_DEFAULTS`: float32 masters, chunk 64).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from verl.workers.config import FSDPActorConfig
from verl.workers.config.engine import EngineConfig as VerlEngineConfig

from harts_runtime.errors import InvalidInputError
from harts_runtime.job_config import group_settings, setting
from harts_runtime.options import DEFAULT_CHUNK_SIZE, ExecutionOptions

__all__ = ["HartsActorConfig", "HartsEngineConfig", "dtype_name"]

_FROM_VERL = {"param_dtype": "dtype"}
"""ExecutionOptions fields a verl field sets instead (``harts.dtype``: FSDP2's compute dtype)."""
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""verl's short dtype names."""


def dtype_name(name):
    """The torch dtype name of a verl dtype setting (``bf16`` -> ``bfloat16``; others unchanged)."""
    return _ALIASES.get(name, name)


def _execution_fields(cls):
    """Declare on ``cls`` (before ``@dataclass``) every :class:`ExecutionOptions` field but those
    :data:`_FROM_VERL` maps, with its type, default and metadata."""
    hints = typing.get_type_hints(ExecutionOptions)
    verl_names = {f.name for f in dataclasses.fields(VerlEngineConfig)}
    for f in dataclasses.fields(ExecutionOptions):
        if f.name in _FROM_VERL:
            continue
        if f.name in verl_names or f.name in cls.__dict__.get("__annotations__", {}):
            raise TypeError(f"ExecutionOptions.{f.name} clashes with a field of {cls.__name__}")
        if f.default_factory is not dataclasses.MISSING:
            spec = field(default_factory=f.default_factory, metadata=f.metadata)
        else:
            spec = field(default=f.default, metadata=f.metadata)
        cls.__annotations__[f.name] = hints[f.name]
        setattr(cls, f.name, spec)
    return cls


def _parallel_fields(cls):
    """Declare on ``cls`` (before ``@dataclass``) the settings tree's parallel degrees, each with its
    kind, default and help."""
    for s in group_settings("parallel"):
        if s.name in cls.__dict__.get("__annotations__", {}):
            raise TypeError(f"the parallel setting {s.name} clashes with a field of {cls.__name__}")
        cls.__annotations__[s.name] = s.kind
        setattr(cls, s.name, field(default=s.default, metadata={"help": s.help}))
    return cls


_MODEL_FIELDS = {"model_dtype": "dtype", "chunk_size": "chunk_size"}
"""The model group's settings a ``harts`` config takes: field -> the tree's setting."""
_MODEL_DEFAULTS = {"model_dtype": "float32", "chunk_size": DEFAULT_CHUNK_SIZE}
"""The backend's defaults of those (the tree's are None: the checkpoint's dtype and chunk size);
FSDP2 keeps float32 masters under verl's compute ``dtype``."""


def _model_fields(cls):
    """Declare on ``cls`` (before ``@dataclass``) the settings tree's model settings of
    :data:`_MODEL_FIELDS`, each with its kind and help, and the backend's default."""
    for name, key in _MODEL_FIELDS.items():
        s = setting(key)
        if name in cls.__dict__.get("__annotations__", {}):
            raise TypeError(f"the model setting {name} clashes with a field of {cls.__name__}")
        cls.__annotations__[name] = s.kind
        setattr(cls, name, field(default=_MODEL_DEFAULTS[name], metadata={"help": s.help}))
    return cls


def _check_model(cfg) -> None:
    """The model settings by the tree's declaration (kind, choices, bounds; ``chunk_size`` a power
    of two: :class:`~harts_runtime.job_config.ModelOptions`), named ``harts.<field>``."""
    from harts_runtime.job_config import ModelOptions

    for name, key in _MODEL_FIELDS.items():
        s, v = setting(key), getattr(cfg, name)
        if s.kind is int and (isinstance(v, bool) or not isinstance(v, int) or v < (s.lo or 1)):
            raise InvalidInputError(f"harts.{name}", f"must be an integer >= {int(s.lo or 1)}, got {v!r}")
        if s.kind is str and not isinstance(v, str):
            raise InvalidInputError(f"harts.{name}", f"must be a string, got {v!r}")
        if s.choices is not None and dtype_name(v) not in s.choices:
            raise InvalidInputError(f"harts.{name}", f"choose one of {', '.join(s.choices)}, got {v!r}")
    try:
        ModelOptions(chunk_size=cfg.chunk_size)
    except InvalidInputError as e:
        raise InvalidInputError("harts.chunk_size", str(e)[len(e.field) + 2 :]) from None


def _check_parallel(cfg) -> None:
    """Each degree an integer >= 1 (``sequence_parallel`` a bool), named ``harts.<field>``; the
    rest (``cp`` divides the world, ``sequence_parallel`` needs ``tp > 1``) ``ParallelDims`` checks
    against the world size when the engine is built."""
    for s in group_settings("parallel"):
        v = getattr(cfg, s.name)
        if s.kind is bool:
            if not isinstance(v, bool):
                raise InvalidInputError(f"harts.{s.name}", f"must be true or false, got {v!r}")
        elif isinstance(v, bool) or not isinstance(v, int) or v < (s.lo or 1):
            raise InvalidInputError(f"harts.{s.name}", f"must be an integer >= {int(s.lo or 1)}, got {v!r}")


@dataclass
@_model_fields
@_parallel_fields
@_execution_fields
class HartsEngineConfig(VerlEngineConfig):
    """verl engine config of the ``harts`` backend (``actor.harts`` / ``ref.harts``): verl's common
    fields (``forward_only``, ``seed``, ...), the execution options of
    :class:`harts_runtime.options.ExecutionOptions` (``capacity``, ``microbatch_cost``, ``mode``,
    ``planner``, ``recompute``, ``keep``, ``no_replay``, ``reduce_dtype``, ``cpu_offload``: generated
    from it, module docstring), the parallel degrees and the model settings (``model_dtype``,
    ``chunk_size``) of the settings tree. ``dtype`` (verl's, default bfloat16)
    is the FSDP2 compute dtype over ``model_dtype`` masters (``ExecutionOptions.param_dtype``);
    ``"float32"`` computes in float32. verl's micro-batch settings are ignored (HARTS packs by
    ``capacity``); verl's ``param_offload`` / ``optimizer_offload`` are refused (``cpu_offload``)."""

    strategy: str = "harts"

    def __post_init__(self):
        super().__post_init__()
        if self.strategy != "harts":
            raise InvalidInputError(
                "strategy", f"the harts engine config needs strategy 'harts', got {self.strategy!r}"
            )
        _check_parallel(self)
        _check_model(self)
        given = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(ExecutionOptions)
            if f.name not in _FROM_VERL
        }
        dtype = dtype_name(self.dtype)
        given["param_dtype"] = None if dtype in (None, "float32") else dtype
        try:
            execution = ExecutionOptions(**given)
        except InvalidInputError as e:  # named as verl's config names it
            raise InvalidInputError(
                f"harts.{_FROM_VERL.get(e.field, e.field)}", str(e)[len(e.field) + 2 :]
            ) from None
        self.execution = execution  # the checked options (keep normalised to a sorted tuple)


@dataclass
class HartsActorConfig(FSDPActorConfig):
    """verl actor (or reference) config whose engine is :class:`HartsEngineConfig` (``harts``).
    A subclass of verl's ``FSDPActorConfig``, so verl's default ``dp`` actor / ref YAML keys are
    accepted as they are (the FSDP-only ones are ignored); select it with ``_target_``
    (``examples/verl/``)."""

    strategy: str = "harts"
    harts: HartsEngineConfig = field(default_factory=HartsEngineConfig)

    def __post_init__(self):
        if self.strategy != "harts":
            raise InvalidInputError(
                "actor.strategy", f"HartsActorConfig runs strategy 'harts', got {self.strategy!r}"
            )
        super().__post_init__()
        if not isinstance(self.harts, HartsEngineConfig):
            self.harts = HartsEngineConfig(**dict(self.harts))
        self.engine = self.harts
        if self.entropy_coeff:
            raise InvalidInputError(
                "actor.entropy_coeff",
                f"an entropy loss ({self.entropy_coeff}) needs its gradient, which the harts backend's fused "
                "LM head does not compute; set it to 0",
            )
