"""Kimi-Linear (transformers ``KimiLinearForCausalLM``) as a :class:`~harts_runtime.models.hybrid.HybridModel`.

``args``: :func:`from_hf_config` (a ``KimiLinearConfig`` or its ``config.json`` dict -> our
:class:`~harts_runtime.models.hybrid.args.ModelConfig`) and :func:`to_hf_config` (back);
``state_dict_adapter``: :func:`from_hf` / :func:`to_hf` (state dicts, every tensor mapped and
checked); ``flavors``: ``kimi-linear-tiny``. The family registers itself (:data:`FAMILY`,
:mod:`harts_runtime.models.registry`). Loading and saving checkpoint folders is :mod:`harts_runtime.hf`.

Kimi-Linear is the hybrid family with KDA linear-attention layers (``linear_attention``), MLA
full-attention layers without positional encoding (``full_attention``; ``mla.use_rope=False``), a
dense SwiGLU in the first ``first_k_dense_replace`` layers and elsewhere a sigmoid-routed MoE with
``e_score_correction_bias`` (our ``expert_bias``), group-limited top-k, renormalised top-k weights,
``routed_scaling_factor`` and shared experts.
"""

from harts_runtime.models.kimi_linear.args import from_hf_config, to_hf_config
from harts_runtime.models.kimi_linear.flavors import FLAVORS
from harts_runtime.models.kimi_linear.state_dict_adapter import KimiLinearStateDictAdapter, from_hf, to_hf
from harts_runtime.models.registry import Family, register_family

__all__ = [
    "FAMILY",
    "FLAVORS",
    "KimiLinearStateDictAdapter",
    "from_hf",
    "from_hf_config",
    "to_hf",
    "to_hf_config",
]


def owns(cfg) -> bool:
    """A model with any KDA or MLA layer has Kimi-Linear's marks (a more specific family, such as
    Ling-3.0, claims some of them at a higher priority: the registry decides)."""
    return any(m in ("kda", "mla") for m in cfg.mixers)


FAMILY = register_family(
    Family(
        name="kimi_linear",
        model_types=("kimi_linear",),
        from_hf_config=from_hf_config,
        to_hf_config=to_hf_config,
        adapter=KimiLinearStateDictAdapter,
        owns=owns,
        priority=30,
        flavors=FLAVORS,
        transformers_min="5.17.0",  # the first release with its model_type
    )
)
"""The registered family (:mod:`harts_runtime.models.registry`)."""
