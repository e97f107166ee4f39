"""The model families: one :class:`Family` per checkpoint format, registered by its own package.

A family (as torchtitan's train specs) bundles what the checkpoint code needs of one transformers
format: the ``config.json`` ``model_type`` values it reads, the config maps both ways, its
state-dict adapter class, the test that says which models built without a checkpoint config belong
to it, and its named tiny flavors. Each family package (:mod:`harts_runtime.models.kimi_linear`,
:mod:`~harts_runtime.models.qwen3_next`, :mod:`~harts_runtime.models.qwen3_5_moe`) calls
:func:`register_family` in its ``__init__``; this module imports no family and no model code at
the top: the built-in family packages are imported (``importlib``) on the first lookup, so the
families import the registry and never the reverse.

Overlaps are the registry's to resolve, not the families': a family's ``owns`` tests only its own
marks (Ling-3.0: full-rank KDA gates or an MLA output gate; Kimi-Linear: any KDA or MLA layer), and
where several families own a config the one of the highest declared ``priority`` (the most specific)
wins. A new family is thus added in its own package, with a priority above the families it refines,
without editing another family's files.

Lookups: :func:`get_family` (by ``model_type``), :func:`family_of` (the family a
:class:`~harts_runtime.models.hybrid.args.ModelConfig` belongs to), :func:`families`,
:func:`model_types`, :func:`family_flavors` (every family's flavors by name). Bad names raise
:class:`~harts_runtime.errors.InvalidInputError` naming the field.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from harts_runtime.errors import InvalidInputError

__all__ = [
    "BUILTIN_FAMILIES",
    "Family",
    "families",
    "family_flavors",
    "family_of",
    "get_family",
    "model_types",
    "register_family",
]

BUILTIN_FAMILIES = {
    "kimi_linear": "harts_runtime.models.kimi_linear",
    "qwen3_next": "harts_runtime.models.qwen3_next",
    "qwen3_5_moe": "harts_runtime.models.qwen3_5_moe",
    "nemotron_h": "harts_runtime.models.nemotron_h",
    "ling3": "harts_runtime.models.ling3",
}
"""Built-in family name -> its package, imported on the first lookup (it registers the family).
Lookups list these first, in this order, whichever was imported first."""


@dataclass(frozen=True)
class Family:
    """One checkpoint family.

    ``name``: the family's name (e.g. ``"kimi_linear"``). ``model_types``: the ``config.json``
    ``model_type`` values it reads; the first is the one it writes (:attr:`model_type`).
    ``from_hf_config(hf_config, *, dtype=None, chunk_size=DEFAULT_CHUNK_SIZE, **overrides) -> ModelConfig``
    and ``to_hf_config(ModelConfig, base=None) -> dict``: the config maps. ``adapter``: its
    :class:`~harts_runtime.models.state_dict_adapter.HFStateDictAdapter` class. ``owns(ModelConfig)
    -> bool``: whether a model built without a checkpoint config has this family's marks (its own
    test only; it may hold for other families too). ``priority``: how specific ``owns`` is: of the
    families that own a config the highest priority wins (:func:`family_of`). ``flavors``: named
    tiny flavors, name -> ``(num_layers=None, **overrides) -> ModelConfig``. ``prefixes``: ``model_type`` -> key prefix of its checkpoints'
    tensors (:meth:`make_adapter`; e.g. a vision-language folder's ``"model.language_model."``).
    ``read_only``: the ``model_types`` read but never written. ``transformers_min``: the first
    transformers release that has the ``model_type`` this family writes (its transformers model: the
    rollout engine, the reference in the tests); None: any (:func:`check_transformers`).
    """

    name: str
    model_types: tuple[str, ...]
    from_hf_config: Callable
    to_hf_config: Callable
    adapter: type
    owns: Callable
    priority: int = 0
    flavors: Mapping[str, Callable] = field(default_factory=dict)
    prefixes: Mapping[str, str] = field(default_factory=dict)
    read_only: tuple[str, ...] = ()
    transformers_min: str | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise InvalidInputError("name", f"a family needs a non-empty name, got {self.name!r}")
        types = tuple(self.model_types)
        if not types or not all(isinstance(t, str) and t for t in types):
            raise InvalidInputError(
                "model_types", f"family {self.name!r} needs non-empty model_type names, got {types!r}"
            )
        if len(set(types)) != len(types):
            raise InvalidInputError("model_types", f"family {self.name!r} lists one twice: {types!r}")
        object.__setattr__(self, "model_types", types)
        object.__setattr__(self, "flavors", MappingProxyType(dict(self.flavors)))
        object.__setattr__(self, "prefixes", MappingProxyType(dict(self.prefixes)))
        object.__setattr__(self, "read_only", tuple(self.read_only))
        for name, values in (("prefixes", tuple(self.prefixes)), ("read_only", self.read_only)):
            for t in values:
                if t not in types:
                    raise InvalidInputError(
                        name, f"{t!r} is not one of family {self.name!r}'s model_types {types!r}"
                    )
        if types[0] in self.read_only:
            raise InvalidInputError(
                "read_only", f"{types[0]!r} is the model_type family {self.name!r} writes"
            )
        for name in ("from_hf_config", "to_hf_config", "owns"):
            if not callable(getattr(self, name)):
                raise InvalidInputError(
                    name, f"family {self.name!r}: {getattr(self, name)!r} is not callable"
                )
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise InvalidInputError(
                "priority", f"family {self.name!r}: expected an integer, got {self.priority!r}"
            )
        if not isinstance(self.adapter, type):
            raise InvalidInputError("adapter", f"family {self.name!r}: {self.adapter!r} is not a class")

    def check_transformers(self, field: str = "model_type") -> None:
        """Refuse an installed transformers without this family's model: one
        :class:`InvalidInputError` naming ``field``, the installed version and the one the family
        needs (``transformers_min``)."""
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        if self.model_type in CONFIG_MAPPING_NAMES:
            return
        have = f"transformers {transformers.__version__} has no {self.model_type!r} model"
        if self.transformers_min is None:
            raise InvalidInputError(field, f"{have}; the {self.name} family needs a transformers that has it")
        raise InvalidInputError(
            field,
            f"{have}; the {self.name} family needs transformers >= {self.transformers_min}: "
            f"pip install -U 'transformers>={self.transformers_min}'",
        )

    @property
    def model_type(self) -> str:
        """The ``model_type`` this family writes (its first)."""
        return self.model_types[0]

    def make_adapter(self, config, model_type: str | None = None):
        """The state-dict adapter of ``config`` for checkpoints of ``model_type`` (None: the one this
        family writes), with that type's tensor-name prefix."""
        model_type = self.model_type if model_type is None else model_type
        if model_type not in self.model_types:
            raise InvalidInputError(
                "model_type",
                f"{model_type!r} is not read by family {self.name!r}; it reads {self.model_types}",
            )
        prefix = self.prefixes.get(model_type)
        return self.adapter(config) if prefix is None else self.adapter(config, prefix=prefix)


_FAMILIES: dict[str, Family] = {}  # name -> family, in registration order
_BY_TYPE: dict[str, Family] = {}  # model_type -> family
_BY_FLAVOR: dict[str, Family] = {}  # flavor name -> family
_state = {"builtins": "no"}  # "no" -> "loading" -> "yes"


def register_family(family: Family) -> Family:
    """Add ``family`` to the registry and return it (a family package calls this in its
    ``__init__``). Registering an equal family again does nothing; a different family with a
    registered name, ``model_type`` or flavor name raises InvalidInputError naming that field."""
    if not isinstance(family, Family):
        raise InvalidInputError("family", f"expected a Family, got {type(family).__name__}")
    old = _FAMILIES.get(family.name)
    if old is not None:
        if old == family:
            return old
        raise InvalidInputError("name", f"family {family.name!r} is registered already")
    for t in family.model_types:
        if t in _BY_TYPE:
            raise InvalidInputError("model_types", f"{t!r} is read by family {_BY_TYPE[t].name!r} already")
    for f in family.flavors:
        if f in _BY_FLAVOR:
            raise InvalidInputError("flavors", f"{f!r} is a flavor of family {_BY_FLAVOR[f].name!r} already")
    _FAMILIES[family.name] = family
    _BY_TYPE.update(dict.fromkeys(family.model_types, family))
    _BY_FLAVOR.update(dict.fromkeys(family.flavors, family))
    return family


def _load_builtins() -> None:
    """Import the built-in family packages once (they register themselves)."""
    if _state["builtins"] != "no":  # done, or under way (a family looking others up as it loads)
        return
    _state["builtins"] = "loading"
    try:
        for package in BUILTIN_FAMILIES.values():
            importlib.import_module(package)
    except BaseException:
        _state["builtins"] = "no"
        raise
    _state["builtins"] = "yes"


def families() -> tuple[Family, ...]:
    """Every registered family: the built-in ones (:data:`BUILTIN_FAMILIES` order), then the others in
    registration order."""
    _load_builtins()
    rank = {name: i for i, name in enumerate(BUILTIN_FAMILIES)}
    order = sorted(enumerate(_FAMILIES.values()), key=lambda p: (rank.get(p[1].name, len(rank)), p[0]))
    return tuple(f for _, f in order)


def model_types() -> tuple[str, ...]:
    """Every ``model_type`` some family reads, family by family."""
    return tuple(t for f in families() for t in f.model_types)


def get_family(model_type: str) -> Family:
    """The family reading ``config.json``'s ``model_type``; InvalidInputError naming ``model_type``
    (and the supported ones) for any other value."""
    _load_builtins()
    family = _BY_TYPE.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise InvalidInputError("model_type", f"{model_type!r}; supported: {', '.join(model_types())}")
    return family


def family_of(config) -> Family:
    """The family a model built without a checkpoint config belongs to: of the registered families
    whose ``owns(config)`` holds, the one of the highest ``priority`` (the built-ins, most specific
    first: Ling-3.0 options, else KDA or MLA layers Kimi-Linear, split-projection GDN layers
    Qwen3.5-MoE, Mamba2 layers Nemotron-H, any other model Qwen3-Next). InvalidInputError naming
    ``config`` when none owns it, or when the highest priority is shared (two families claim it
    equally: one of them must declare a higher priority)."""
    owners = [f for f in families() if f.owns(config)]
    if not owners:
        raise InvalidInputError(
            "config", f"no model family owns this config; families: {', '.join(f.name for f in families())}"
        )
    top = max(f.priority for f in owners)
    best = [f for f in owners if f.priority == top]
    if len(best) > 1:
        raise InvalidInputError(
            "config",
            f"families {', '.join(f.name for f in best)} all own this config at priority {top}; "
            "the more specific one must declare a higher priority",
        )
    return best[0]


def family_flavors() -> dict[str, Callable]:
    """Every family's flavors: name -> ``(num_layers=None, **overrides) -> ModelConfig``."""
    return {name: fn for family in families() for name, fn in family.flavors.items()}
