"""Qwen3-Next (transformers ``Qwen3NextForCausalLM``) as a :class:`~harts_runtime.models.hybrid.HybridModel`.

``args``: :func:`from_hf_config` / :func:`to_hf_config`; ``state_dict_adapter``: :func:`from_hf` /
:func:`to_hf` (every tensor mapped and shape-checked). The family registers itself (:data:`FAMILY`,
:mod:`harts_runtime.models.registry`). Loading and saving checkpoint folders is
:mod:`harts_runtime.hf`.

Qwen3-Next is the hybrid family with gated delta-net layers (``linear_attention``; our ``gdn``
mixer, fused ``in_proj_qkvz`` / ``in_proj_ba``), gated full attention (``full_attention``; our
``gated_attention``), zero-centred RMSNorms, and softmax top-k MoE with one sigmoid-gated shared
expert (dense SwiGLU layers in ``mlp_only_layers`` and off the ``decoder_sparse_step``).
"""

from harts_runtime.models.qwen3_next.args import from_hf_config, to_hf_config
from harts_runtime.models.qwen3_next.state_dict_adapter import QwenStateDictAdapter, from_hf, to_hf
from harts_runtime.models.registry import Family, register_family

__all__ = ["FAMILY", "QwenStateDictAdapter", "from_hf", "from_hf_config", "to_hf", "to_hf_config"]


def owns(cfg) -> bool:
    """Every model: Qwen3-Next is the fallback family (priority 0), which a model no other family
    claims is offered to and which then names what it cannot write."""
    return True


FAMILY = register_family(
    Family(
        name="qwen3_next",
        model_types=("qwen3_next",),
        from_hf_config=from_hf_config,
        to_hf_config=to_hf_config,
        adapter=QwenStateDictAdapter,
        owns=owns,
        priority=0,
    )
)
"""The registered family (:mod:`harts_runtime.models.registry`)."""
