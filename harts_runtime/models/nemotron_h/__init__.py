"""Nemotron-H (transformers ``NemotronHForCausalLM``, ``model_type: nemotron_h``) as a
:class:`~harts_runtime.models.hybrid.HybridModel`.

``args``: :func:`from_hf_config` / :func:`to_hf_config`; ``state_dict_adapter``: :func:`from_hf` /
:func:`to_hf` (every tensor mapped and shape-checked); ``flavors``: ``nemotron-h-tiny``. The
family registers itself (:data:`FAMILY`, :mod:`harts_runtime.models.registry`).

Nemotron-H layers hold one sublayer each, in the order ``hybrid_override_pattern`` gives: Mamba2
(``M``; our ``mamba2`` mixer, :mod:`harts_runtime.layers.mamba2`, run over the rollout tree's
minimum-call plan like KDA), attention without RoPE (``*``; ``gqa`` with ``gqa.use_rope`` off),
relu2 MLPs (``-``; FFN ``relu2``) and MoE with relu2 experts, sigmoid group routing and a shared
expert (``E``; FFN ``moe`` with ``moe.activation="relu2"``).
"""

from harts_runtime.models.nemotron_h.args import from_hf_config, to_hf_config
from harts_runtime.models.nemotron_h.flavors import FLAVORS
from harts_runtime.models.nemotron_h.state_dict_adapter import NemotronHStateDictAdapter, from_hf, to_hf
from harts_runtime.models.registry import Family, register_family

__all__ = [
    "FAMILY",
    "FLAVORS",
    "NemotronHStateDictAdapter",
    "from_hf",
    "from_hf_config",
    "to_hf",
    "to_hf_config",
]


def owns(cfg) -> bool:
    """A model with any Mamba2 layer is a Nemotron-H model."""
    return "mamba2" in cfg.mixers


FAMILY = register_family(
    Family(
        name="nemotron_h",
        model_types=("nemotron_h",),
        from_hf_config=from_hf_config,
        to_hf_config=to_hf_config,
        adapter=NemotronHStateDictAdapter,
        owns=owns,
        priority=10,
        flavors=FLAVORS,
        transformers_min="5.3.0",  # the first release with its model_type
    )
)
"""The registered family (:mod:`harts_runtime.models.registry`)."""
