"""Reading a transformers config: the families' ``from_hf_config`` take a transformers config object
or its ``config.json`` dict (:func:`as_dict`) and read fields under their names or aliases with the
family's defaults (:func:`config_value`)."""

from __future__ import annotations

from collections.abc import Mapping

from harts_runtime.errors import InvalidInputError

__all__ = ["as_dict", "config_value"]


def as_dict(cfg, expected: str = "a transformers config") -> dict:
    """``cfg`` (a transformers config or a mapping) as a plain dict; anything else is refused,
    naming ``config`` and ``expected``."""
    if isinstance(cfg, Mapping):
        return dict(cfg)
    if hasattr(cfg, "to_dict"):
        return cfg.to_dict()
    raise InvalidInputError("config", f"expected {expected} or a dict, got {type(cfg).__name__}")


def config_value(d: Mapping, name: str, aliases: Mapping, defaults: Mapping):
    """Field ``name`` of config dict ``d``: its value under ``name``, else under its alias, else the
    family's default (None when there is none); a None value counts as absent."""
    for key in (name, aliases.get(name)):
        if key is not None and d.get(key) is not None:
            return d[key]
    return defaults.get(name)
