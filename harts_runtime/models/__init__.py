"""Model families, one package each, as torchtitan's ``models/<name>/model/{args,model}.py``.

:mod:`~harts_runtime.models.hybrid`: the model (``model.py``: KDA / MLA / GQA / gated-attention /
GDN / Mamba2 mixers, dense / MoE / relu2 FFNs), its keyword config :class:`ModelConfig`
(``args.py``) and the hybrid flavors ``ling-tiny`` and ``debug``.
The five checkpoint families :mod:`~harts_runtime.models.kimi_linear`,
:mod:`~harts_runtime.models.qwen3_next`, :mod:`~harts_runtime.models.qwen3_5_moe`,
:mod:`~harts_runtime.models.ling3` (Ling-3.0, ``bailing_hybrid``) and
:mod:`~harts_runtime.models.nemotron_h` (config maps in ``args.py``, state-dict adapters, their
own flavors) register themselves in
:mod:`~harts_runtime.models.registry` (:func:`get_family`, :func:`family_of`, :func:`families`);
:data:`FLAVORS` / :func:`model_config` look every flavor up through it.
"""

from harts_runtime.models.hybrid import FLAVORS, HybridModel, ModelConfig, model_config
from harts_runtime.models.registry import (
    Family,
    families,
    family_of,
    get_family,
    model_types,
    register_family,
)

__all__ = [
    "FLAVORS",
    "Family",
    "HybridModel",
    "ModelConfig",
    "families",
    "family_of",
    "get_family",
    "model_config",
    "model_types",
    "register_family",
]
