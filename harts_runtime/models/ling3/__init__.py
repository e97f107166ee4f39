"""Ling-3.0 (transformers ``BailingHybridForCausalLM``, ``model_type: bailing_hybrid``) as a
:class:`~harts_runtime.models.hybrid.HybridModel`.

``args``: :func:`from_hf_config` / :func:`to_hf_config` (config maps both ways);
``state_dict_adapter``: :class:`Ling3StateDictAdapter`, :func:`from_hf` / :func:`to_hf` (both
spellings read, MTP tensors kept aside and written back); ``flavors``: ``ling3-tiny``. The family
registers itself (:data:`FAMILY`, :mod:`harts_runtime.models.registry`).

Ling-3.0 is the hybrid family with KDA layers (bounded forget gate, full-rank gate projections)
and MLA layers (interleaved RoPE, head-wise sigmoid output gate) at 5:1, a dense SwiGLU in the
first ``first_k_dense_replace`` layers and elsewhere a sigmoid-routed MoE with
``e_score_correction_bias``, group-limited top-k, renormalised and scaled top-k weights, shared
experts and per-layer clipped SwiGLU (``expert_swiglu_limit_list``,
``share_expert_swiglu_limit_list``).
"""

from harts_runtime.models.ling3.args import from_hf_config, owns, to_hf_config
from harts_runtime.models.ling3.flavors import FLAVORS
from harts_runtime.models.ling3.state_dict_adapter import Ling3StateDictAdapter, from_hf, to_hf
from harts_runtime.models.registry import Family, register_family

__all__ = [
    "FAMILY",
    "FLAVORS",
    "Ling3StateDictAdapter",
    "from_hf",
    "from_hf_config",
    "to_hf",
    "to_hf_config",
]

FAMILY = register_family(
    Family(
        name="ling3",
        model_types=("bailing_hybrid",),
        from_hf_config=from_hf_config,
        to_hf_config=to_hf_config,
        adapter=Ling3StateDictAdapter,
        owns=owns,
        priority=40,  # above Kimi-Linear's: Ling-3.0's marks refine KDA / MLA models
        flavors=FLAVORS,
        transformers_min="5.20.0",  # the first release with its model_type
    )
)
"""The registered family (:mod:`harts_runtime.models.registry`)."""
